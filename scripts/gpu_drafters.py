"""Drafter step costs on a GPU, with random weights at published target shapes.

For each shape: a random-weight target (bench.core.costs.random_engine) and random-weight
drafters built for it (DFlash/DSpark with the paper's 5 layers and 5 taps, EAGLE-3 with
a 32k draft vocabulary). Each decodes the same prompts greedily through the shared loop;
the table gives draft and verify milliseconds per round and whether the tokens equal
AR's. Random weights make acceptance meaningless: this measures what a round costs
(the block drafters' one pass vs EAGLE-3's pass per tree level) and checks the decode
paths are lossless on CUDA.

    python -m scripts.gpu_drafters [--shapes smollm2-135m,llama-3.2-1b,llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

from bench.core.costs import random_engine
from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.sampling import SamplingConfig
from scripts.gpu_loop import repetitive_prompt


def fake_target(engine) -> SimpleNamespace:
    return SimpleNamespace(engine=engine, config=engine.config)


def block_model(engine, block: int, markov: int = 0, draft_vocab: int = 32768):
    from methods.dflash.model import BlockConfig, BlockDraftModel, block_taps

    config = BlockConfig.for_target(engine.config, block_taps(engine.num_layers), num_layers=5, block_size=block,
                                    draft_vocab_size=min(draft_vocab, engine.vocab_size), markov_rank=markov,
                                    confidence=bool(markov))
    model = BlockDraftModel(config)
    return model.to(device=engine.device, dtype=torch.bfloat16)


def eagle3_head(engine, draft_vocab: int = 32768):
    from methods.eagle.model import EagleConfig, EagleHead
    from methods.eagle.training import eagle3_taps

    config = EagleConfig.for_target(engine.config, "eagle3", eagle3_taps(engine.num_layers),
                                    min(draft_vocab, engine.vocab_size))
    return EagleHead(config).to(device=engine.device, dtype=torch.bfloat16)


def drafters_for(engine) -> dict[str, Drafter]:
    from methods.dflash.drafter import BlockDrafter, BlockSettings
    from methods.eagle.drafter import EagleDrafter, TreeSettings

    target = fake_target(engine)
    flat = [0.01] * 20  # the scheduler's cost curve is irrelevant here: schedule=none
    out: dict[str, Drafter] = {"ar": Drafter()}
    model = block_model(engine, 16)
    for block in (4, 8, 16):
        out[f"dflash b{block}"] = BlockDrafter(target, model, BlockSettings(mode="chain", block=block), "dflash")
    for budget in (16, 64):
        out[f"ddtree {budget}"] = BlockDrafter(target, model, BlockSettings(mode="tree", budget=budget), "ddtree")
    out["dspark b16"] = BlockDrafter(target, block_model(engine, 16, markov=256),
                                     BlockSettings(mode="scheduled", block=16, schedule="none"), "dspark", flat)
    head = eagle3_head(engine)
    out["eagle3 12/5/4"] = EagleDrafter(target, head, TreeSettings(total_token=12, depth=5, top_k=4), "eagle3")
    out["eagle3 60/6/10"] = EagleDrafter(target, head, TreeSettings(total_token=60, depth=6, top_k=10), "eagle3")
    return out


def time_shape(shape: str, device: torch.device, prompts: int = 2, new_tokens: int = 64) -> list[dict]:
    dtype = torch.float32 if shape == "smollm2-135m" else torch.bfloat16
    engine = random_engine(shape, device, dtype, logit_scale=8.0)
    config = DecodeConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(0.0))
    prompt_list = [repetitive_prompt(engine.vocab_size, 7 + i) for i in range(prompts)]
    methods = drafters_for(engine)
    references = [decode(engine, methods["ar"], p, config).tokens for p in prompt_list]
    rows = []
    for name, drafter in methods.items():
        decode(engine, drafter, prompt_list[0], DecodeConfig(max_new_tokens=8))  # warm-up
        draft = verify = 0.0
        rounds = exact = nodes = 0
        for prompt, reference in zip(prompt_list, references):
            result = decode(engine, drafter, prompt, config)
            draft, verify = draft + result.draft_time, verify + result.verify_time
            rounds += len(result.accept_lengths)
            nodes += sum(result.tree_sizes)
            exact += result.tokens == reference
        rows.append({"shape": shape, "dtype": str(dtype), "method": name, "exact": f"{exact}/{prompts}",
                     "draft_ms_per_round": round(1e3 * draft / max(1, rounds), 3),
                     "verify_ms_per_round": round(1e3 * verify / max(1, rounds), 3),
                     "nodes_per_round": round(nodes / max(1, rounds), 2)})
        print(f"{shape:<14} {name:<16} exact {rows[-1]['exact']}  draft {rows[-1]['draft_ms_per_round']:8.2f} ms"
              f"  verify {rows[-1]['verify_ms_per_round']:8.2f} ms  nodes {rows[-1]['nodes_per_round']:6.1f}",
              flush=True)
    del engine, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_drafters", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_drafters: no CUDA device here")
        return 0
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes.split(","):
        rows += time_shape(shape, device)
    # Exactness is required in fp32 only: a bf16 k-token pass may round differently from a
    # one-token step (near ties), so bf16 rows are reported, not judged.
    ok = all(r["exact"].split("/")[0] == r["exact"].split("/")[1] for r in rows if r["dtype"] == "torch.float32")
    print("OK" if ok else "MISMATCHES")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_drafters.json"), "w", encoding="utf-8") as handle:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "ok": ok, "rows": rows}, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
