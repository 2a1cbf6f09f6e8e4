"""Our implementations against their peers in transformers, side by side (a benchmark, not a test).

Each pair runs on the same prompts, interleaved per prompt (the order alternates between
repeats so neither side always runs on a warmer cache), repeated. Per repeat the speed
ratio is a ratio of sums: (Σ time_peer / Σ tokens_peer) / (Σ time_ours / Σ tokens_ours).
The output JSON keeps every turn's timings, the settings and the provenance.

    python -m scripts.peers --pairs ar-hf --task mtbench --limit 5 --repeats 3
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click
from tqdm import tqdm

from bench.core.decode import DecodeConfig
from bench.core.errors import BenchError
from bench.core.target import chat_prompt
from bench.records import provenance

SPS_GAMMA = 4  # draft tokens per round on both sides of the sps pair


def hf_draft_model(target, folder: Path):
    """The SpS drafter as a transformers model (its layers + the target's embedding and
    lm_head), for `generate(assistant_model=...)`."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from bench.core.drafters import MANIFEST, read_manifest
    from bench.training.draft_lm import config_from_dict

    if not (Path(folder) / MANIFEST).exists():  # a plain HF folder
        return AutoModelForCausalLM.from_pretrained(folder, dtype=target.engine.dtype).eval()
    manifest = read_manifest(folder)
    config = config_from_dict(manifest["architecture"])
    model = AutoModelForCausalLM.from_config(config, dtype=target.engine.dtype)
    state = load_file(str(Path(folder) / manifest.get("weights", "model.safetensors")))
    state["model.embed_tokens.weight"] = target.engine.embed
    state["lm_head.weight"] = target.engine.lm_head
    model.load_state_dict({k: v.to(target.engine.dtype) for k, v in state.items()}, strict=False)
    generation = model.generation_config
    generation.num_assistant_tokens = SPS_GAMMA
    generation.num_assistant_tokens_schedule = "constant"
    generation.assistant_confidence_threshold = 0.0  # ours drafts a fixed gamma too
    return model.to(target.engine.device).eval()


# pair name -> ((our method, options), (peer method, generate kwargs)); the sps pair's
# assistant_model is filled in with the same drafter ours uses.
PAIRS = {
    "ar-hf": (("ar", {}), ("hf", {})),
    # HF's prompt lookup with the original's settings: 3-gram match, 10 tokens.
    "pld-hf": (("pld", {"max_ngram": 3, "num_pred_tokens": 10}),
               ("hf", {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 3})),
    # The draft runs in the target's dtype on both sides (HF's assistant model is fp32).
    "sps-hf": (("sps", {"gamma": SPS_GAMMA, "draft_dtype": "float32"}), ("hf", {"assistant_model": None})),
}


def _decoders(pair: str, target):
    from bench.core.drafters import find_drafter
    from bench.registry import build_decoder

    if pair not in PAIRS:
        raise BenchError(f"unknown pair '{pair}' (choose from {', '.join(PAIRS)})")
    (ours, ours_options), (peer, peer_options) = PAIRS[pair]
    peer_options = dict(peer_options)
    if "assistant_model" in peer_options:
        peer_options["assistant_model"] = hf_draft_model(target, find_drafter(target.name, "sps"))
    # The peer is transformers.generate with its own kwargs, which `bench run --method hf` does not take.
    from methods.hf import HFDecoder

    return build_decoder(ours, target, dict(ours_options)), HFDecoder(target, peer_options)


def compare(pair: str, target, prompts: list[list[int]], config: DecodeConfig, repeats: int) -> dict:
    ours, peer = _decoders(pair, target)
    warm = prompts[0]
    for decoder in (ours, peer):  # one-time costs out of the timings
        decoder.run_turn(warm, DecodeConfig(8, config.sampling, config.eos_token_ids))
    turns = []
    for repeat in range(repeats):
        for index, prompt in enumerate(tqdm(prompts, desc=f"{pair} repeat {repeat + 1}/{repeats}")):
            order = [("ours", ours), ("peer", peer)]
            if (repeat + index) % 2:
                order.reverse()
            for side, decoder in order:
                result = decoder.run_turn(prompt, config)
                turns.append({"repeat": repeat, "prompt": index, "side": side,
                              "tokens": len(result.tokens), "ids": result.tokens,
                              "seconds": result.ttft + result.decode_time,
                              "rounds": len(result.accept_lengths),
                              "accepted": sum(result.accept_lengths)})
    ratios = []
    for repeat in range(repeats):
        sums = {}
        for side in ("ours", "peer"):
            rows = [t for t in turns if t["repeat"] == repeat and t["side"] == side]
            sums[side] = sum(t["seconds"] for t in rows) / max(1, sum(t["tokens"] for t in rows))
        ratios.append(sums["peer"] / sums["ours"])
    ours_ids = {(t["repeat"], t["prompt"]): t["ids"] for t in turns if t["side"] == "ours"}
    same = sum(t["ids"] == ours_ids[(t["repeat"], t["prompt"])] for t in turns if t["side"] == "peer")
    return {
        "pair": pair, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios), "ratios": ratios, "same_tokens": same / (len(turns) // 2),
        "tokens_per_s": {side: sum(t["tokens"] for t in turns if t["side"] == side)
                         / sum(t["seconds"] for t in turns if t["side"] == side) for side in ("ours", "peer")},
        "turns": turns,
    }


@click.command()
@click.option("--pairs", default="ar-hf", show_default=True, help="comma-separated: " + ", ".join(PAIRS))
@click.option("--task", default="mtbench", show_default=True)
@click.option("--limit", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--target", default=None)
@click.option("--device", default=None)
@click.option("--results-dir", default="results", show_default=True)
def main(pairs, task, limit, max_new_tokens, repeats, target, device, results_dir) -> None:
    """Time our methods against transformers' own, interleaved; greedy, first turns."""
    from bench.core.target import load_target
    from tasks import load_task, task_name

    try:
        questions = load_task(task, limit=limit)
        tgt = load_target(target, device)
        prompts = [chat_prompt(tgt.tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]
        config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=tuple(tgt.eos_token_ids))
        out_dir = Path(results_dir) / tgt.name / "peers"
        out_dir.mkdir(parents=True, exist_ok=True)
        for pair in pairs.split(","):
            result = compare(pair, tgt, prompts, config, repeats)
            result.update(settings={"task": task_name(task), "limit": limit, "max_new_tokens": max_new_tokens,
                                    "repeats": repeats, "greedy": True, "target": tgt.name,
                                    "target_fingerprint": tgt.fingerprint},
                          provenance=provenance(str(tgt.engine.device)),
                          finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            path = out_dir / f"{pair}-{task_name(task)}.json"
            path.write_text(json.dumps(result, indent=1))
            tps = result["tokens_per_s"]
            click.echo(f"{pair}: ours {tps['ours']:.1f} tok/s, peer {tps['peer']:.1f} tok/s; "
                       f"ours/peer speed ratio median {result['ratio_median']:.3f} "
                       f"[min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}] over {repeats} repeats; "
                       f"same tokens in {100 * result['same_tokens']:.0f}% of turns -> {path}")
    except BenchError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
