"""`bench train` on a GPU: every trained method's training loop for a few steps with
--device cuda, then a greedy decode on the same device with the drafter it exported,
checked token for token against AR.

The default target's weights cannot travel to a lent GPU machine, so the target is a
random-weight engine of its shape with its real tokenizer (a folder of config and
tokenizer files) and a small ShareGPT-format JSON file. Acceptance is meaningless with
random weights; this checks that the pipeline runs on CUDA and stays lossless there.

    python -m scripts.gpu_train_check --assets .gpu_assets [--device cuda] [--steps 4]

`--prepare DIR` (on a machine with the default target cached) writes the assets folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

METHODS = ("eagle", "eagle3", "medusa", "mtp", "dflash", "dspark")
BLOCK = {"draft_vocab": 4096, "block_size": 8, "anchors": 8}
OPTIONS = {"eagle": {}, "eagle3": {"draft_vocab": 4096, "ttt_steps": 2}, "medusa": {}, "mtp": {}, "dflash": BLOCK,
           "dspark": BLOCK}
ALSO_DECODE = {"dflash": ("ddtree",)}  # methods that decode with another method's drafter


def prepare(dest: Path, conversations: int = 200) -> None:
    """Tokenizer/config files of the default target and a ShareGPT subset (no weights)."""
    from bench.core.target import load_target
    from bench.training.data import read_sharegpt

    target = load_target(device="cpu")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        if (target.path / name).exists():
            shutil.copy(target.path / name, dest / name)
    rows = [{"id": str(i), "conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                             for m in messages]}
            for i, messages in enumerate(read_sharegpt()[:conversations])]
    (dest / "sharegpt.json").write_text(json.dumps(rows))


def random_target(assets: Path, device: str):
    from transformers import AutoTokenizer

    from bench.core.costs import random_engine
    from bench.core.target import Target

    engine = random_engine("smollm2-135m", device, torch.float32, logit_scale=8.0)
    return Target(name="smollm2-135m-random", path=assets, fingerprint="random-weights", engine=engine,
                  tokenizer=AutoTokenizer.from_pretrained(assets), config=engine.config)


def check_method(method: str, target, assets: Path, work: Path, steps: int, device: str) -> dict:
    import bench.registry as registry
    from bench.core.decode import DecodeConfig, Drafter, decode
    from bench.core.sampling import SamplingConfig
    from bench.core.target import chat_prompt
    from bench.training import TrainSettings

    settings = TrainSettings(out_dir=work / method, max_steps=steps, batch_size=2, lr=1e-3, warmup_steps=1,
                             device=device, progress=False, checkpoint_every_s=1e9,
                             data_path=assets / "sharegpt.json", options={"feature_tokens": 6000, **OPTIONS[method]})
    started = time.perf_counter()
    summary = importlib_module(method).train(target, settings)
    train_s = time.perf_counter() - started
    config = DecodeConfig(max_new_tokens=32, sampling=SamplingConfig(0.0))
    prompts = ["Write a haiku about the sea.", "What is 12 times 7?", "Name three prime numbers."]
    references = []
    for text in prompts:
        prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": text}])
        references.append((prompt, decode(target.engine, Drafter(), prompt, config).tokens))
    last = summary.get("last") or {}
    row = {"method": method, "steps": summary["steps"], "train_s": round(train_s, 1),
           "loss": round(float(last.get("loss", float("nan"))), 4)}
    for name in (method,) + ALSO_DECODE.get(method, ()):
        decoder = registry.build_decoder(name, target, {"drafter": summary["drafter"]})
        exact, draft_s, verify_s, rounds = 0, 0.0, 0.0, 0
        for prompt, reference in references:
            result = decoder.run_turn(prompt, config)
            exact += result.tokens == reference
            draft_s, verify_s = draft_s + result.draft_time, verify_s + result.verify_time
            rounds += len(result.accept_lengths)
        key = "" if name == method else f"{name}_"
        row.update({f"{key}exact": f"{exact}/{len(prompts)}",
                    f"{key}draft_ms_per_round": round(1e3 * draft_s / max(1, rounds), 2),
                    f"{key}verify_ms_per_round": round(1e3 * verify_s / max(1, rounds), 2)})
    return row


def importlib_module(method: str):
    import importlib

    from bench.registry import get_method

    return importlib.import_module(get_method(method).module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_train_check", description=__doc__.split("\n")[0])
    parser.add_argument("--assets", type=Path, default=Path(".gpu_assets"))
    parser.add_argument("--prepare", action="store_true", help="write the assets folder and stop")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.assets)
        print(f"assets in {args.assets}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_train_check: no CUDA device here")
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu-train-"))
    os.environ["BENCH_CACHE"] = str(work / "cache")  # features and drafters of the random target stay here
    target = random_target(args.assets, args.device)
    rows = []
    for method in args.methods.split(","):
        try:
            rows.append(check_method(method, target, args.assets, work, args.steps, args.device))
        except Exception as exc:  # report every method, then fail
            rows.append({"method": method, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)
    ok = all("error" not in r and all(v.split("/")[0] == v.split("/")[1] for k, v in r.items() if k.endswith("exact"))
             for r in rows)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_train_check.json").write_text(json.dumps({"ok": ok, "rows": rows}, indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
