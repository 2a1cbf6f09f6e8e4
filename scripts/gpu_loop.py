"""The decode loop on a GPU, with random-weight targets of published shapes (the real
default target's weights cannot travel to a lent GPU machine, and latency does not
depend on weight values).

Three parts, each printed as a table and returned as JSON rows:
- lossless: greedy `pld` and `lookahead` reproduce `ar`'s tokens on CUDA in fp32; a
  divergence is classed as a near tie (top-2 margin under 1e-4) or a real mismatch.
  A sampled (T=1) pld run exercises the Triton verification path inside the loop.
- profile: t_v(k) for chains k=1..64 and top-2 trees, per shape (bench.profile), eager and
  through the static passes (bench.core.static: one CUDA graph per row bucket, the
  default on CUDA), with the two paths' logits compared.
- loop speed: `ar` and `pld` tokens/s through the shared loop, interleaved. Random
  weights make acceptance meaningless; the numbers show the loop's overhead per round
  and what a verification pass costs against a one-token step.

    python -m scripts.gpu_loop [--shapes smollm2-135m,llama-3.2-1b,llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bench.core.costs import format_profile, random_engine, verify_latency
from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.sampling import SamplingConfig
from bench.core.static import enable_static

NEAR_TIE = 1e-4


def repetitive_prompt(vocab: int, seed: int, length: int = 64, copies: int = 3) -> list[int]:
    """Random tokens repeated, so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    block = torch.randint(0, vocab, (length,), generator=generator).tolist()
    return block * copies


def drafters() -> dict[str, Drafter]:
    from methods.lookahead import LookaheadDrafter
    from methods.pld import PromptLookupDrafter

    return {"ar": Drafter(), "pld": PromptLookupDrafter(), "lookahead": LookaheadDrafter()}


def margin_at(engine, prompt: list[int], prefix: list[int]) -> float:
    top2 = engine.prefill(torch.tensor(prompt + prefix)).logits[-1].topk(2).values
    return float(top2[0] - top2[1])


def lossless_check(device: torch.device, prompts: int = 4, max_new_tokens: int = 128) -> list[dict]:
    engine = random_engine("smollm2-135m", device, torch.float32, logit_scale=8.0)
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0))
    rows = []
    methods = drafters()
    for seed in range(prompts):
        prompt = repetitive_prompt(engine.vocab_size, seed)
        reference = decode(engine, methods["ar"], prompt, config).tokens
        for name in ("pld", "lookahead"):
            result = decode(engine, methods[name], prompt, config)
            divergence = next((i for i, (a, b) in enumerate(zip(result.tokens, reference)) if a != b), None)
            row = {"method": name, "prompt": seed, "tokens": len(result.tokens),
                   "exact": divergence is None and len(result.tokens) == len(reference),
                   "tau": 1 + statistics.mean(result.accept_lengths) if result.accept_lengths else 1.0}
            if divergence is not None:
                row["first_divergence"] = divergence
                row["margin"] = margin_at(engine, prompt, reference[:divergence])
                row["near_tie"] = row["margin"] < NEAR_TIE
            rows.append(row)
    sampled = SamplingConfig(1.0)
    for seed in range(prompts):
        generator = torch.Generator(device).manual_seed(seed)
        result = decode(engine, methods["pld"], repetitive_prompt(engine.vocab_size, seed),
                        DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampled), generator)
        rows.append({"method": "pld T=1", "prompt": seed, "tokens": len(result.tokens), "exact": None,
                     "tau": 1 + statistics.mean(result.accept_lengths) if result.accept_lengths else 1.0})
    del engine
    return rows


def loop_speed(engine, prompts: int = 2, max_new_tokens: int = 128, repeats: int = 3) -> list[dict]:
    """Interleaved ar / pld turns; tokens/s as a ratio of sums per repeat."""
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0))
    methods = {name: d for name, d in drafters().items() if name in ("ar", "pld")}
    prompt_list = [repetitive_prompt(engine.vocab_size, 100 + i) for i in range(prompts)]
    decode(engine, methods["ar"], prompt_list[0], DecodeConfig(max_new_tokens=8))  # warm-up
    per_repeat = []
    for _ in range(repeats):
        totals = {name: [0, 0.0, 0, 0] for name in methods}  # tokens, seconds, rounds, accepted
        for prompt in prompt_list:
            for name, drafter in methods.items():
                result = decode(engine, drafter, prompt, config)
                totals[name][0] += len(result.tokens)
                totals[name][1] += result.ttft + result.decode_time
                totals[name][2] += len(result.accept_lengths)
                totals[name][3] += sum(result.accept_lengths)
        per_repeat.append(totals)
    rows = []
    for name in methods:
        tps = [t[name][0] / t[name][1] for t in per_repeat]
        ratios = [(t[name][0] / t[name][1]) / (t["ar"][0] / t["ar"][1]) for t in per_repeat]
        last = per_repeat[-1][name]
        rows.append({"method": name, "tok_s_median": statistics.median(tps), "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "tau": 1 + last[3] / last[2] if last[2] else 1.0,
                     "ms_per_round": 1e3 * per_repeat[-1][name][1] / max(1, last[2])})
    return rows


def host_syncs_per_round(engine, max_new_tokens: int = 64) -> dict[str, float]:
    """Synchronizing CUDA calls (torch.cuda.set_sync_debug_mode warns on each) per decode
    round, for ar and pld on a repetitive prompt; the prefill's own are left out."""
    import warnings

    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0))
    prompt = repetitive_prompt(engine.vocab_size, 7)
    counts = {}
    for name, drafter in drafters().items():
        decode(engine, drafter, prompt, config)  # warm: graphs captured, kernels chosen
        with warnings.catch_warnings(record=True) as short_log:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            short = decode(engine, drafter, prompt, DecodeConfig(max_new_tokens=1, sampling=SamplingConfig(0.0)))
            torch.cuda.set_sync_debug_mode("default")
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            result = decode(engine, drafter, prompt, config)
            torch.cuda.set_sync_debug_mode("default")
        rounds = len(result.accept_lengths) - len(short.accept_lengths)
        counts[name] = (len(log) - len(short_log)) / max(1, rounds)
    return counts


def static_agreement(engine, context: int = 300) -> dict:
    """Chains of 1-64 rows after `context` tokens, eager against static (captured on CUDA):
    largest logit difference and whether every row's argmax agrees."""
    generator = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, engine.vocab_size, (context,), generator=generator)
    worst, same = 0.0, True
    for k in (1, 3, 8, 16, 33, 64):
        tokens = torch.randint(0, engine.vocab_size, (k,), generator=generator).to(engine.device)
        logits = []
        for static in (False, True):
            enable_static(engine, static)
            engine.prefill(prefix, logits_rows="none", capacity=1024)
            logits.append(engine.forward(tokens).logits.float())
        worst = max(worst, float((logits[0] - logits[1]).abs().max()))
        same &= bool(torch.equal(logits[0].argmax(-1), logits[1].argmax(-1)))
    enable_static(engine, engine.device.type == "cuda")
    return {"max_abs_logit_diff": worst, "argmax_equal": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_loop", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_loop: no CUDA device here")
        return 0
    device = torch.device(args.device)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "shapes": {}}
    started = time.perf_counter()
    rows = lossless_check(device)
    report["lossless"] = rows
    print(f"{'method':<10} {'prompt':>6} {'tokens':>6} {'exact':>6} {'tau':>6} divergence")
    for row in rows:
        extra = "" if "first_divergence" not in row else (
            f"at {row['first_divergence']}, margin {row['margin']:.2e} ({'near tie' if row['near_tie'] else 'REAL'})")
        print(f"{row['method']:<10} {row['prompt']:>6} {row['tokens']:>6} {row['exact']!s:>6} "
              f"{row['tau']:>6.2f} {extra}")
    real = [r for r in rows if r["exact"] is False and not r.get("near_tie")]
    verdict = "OK" if not real else f"{len(real)} REAL MISMATCHES"
    print(f"lossless on CUDA: {verdict} ({time.perf_counter() - started:.0f} s)", flush=True)
    for shape in args.shapes.split(","):
        dtype = torch.float32 if shape == "smollm2-135m" else torch.bfloat16
        engine = random_engine(shape, device, dtype, logit_scale=8.0)
        agreement = static_agreement(engine)
        enable_static(engine, False)  # eager passes first, then the captured graphs (the CUDA default)
        eager = verify_latency(engine, tree_sizes=(16, 32, 64))
        enable_static(engine, device.type == "cuda")
        profile = verify_latency(engine, tree_sizes=(16, 32, 64))
        speed = loop_speed(engine)
        syncs = host_syncs_per_round(engine) if device.type == "cuda" else {}
        report["shapes"][shape] = {"dtype": str(dtype), "profile": profile, "eager_profile": eager,
                                   "static_agreement": agreement, "loop": speed, "host_syncs_per_round": syncs}
        print(f"host syncs per round: {syncs}")
        print(f"\n== {shape} ({dtype}), static passes against eager: {agreement}")
        print(f"t_v(k) at context {profile['context']}, eager:")
        print(format_profile(eager))
        print("static (one CUDA graph per bucket):")
        print(format_profile(profile))
        for row in speed:
            print(f"{row['method']:<4} {row['tok_s_median']:8.1f} tok/s  ratio to ar {row['ratio_median']:.3f} "
                  f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]  tau {row['tau']:.2f}  "
                  f"{row['ms_per_round']:.2f} ms/round")
        print(f"({time.perf_counter() - started:.0f} s)", flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["ok"] = not real
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_loop.json"), "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    return 0 if not real else 1


if __name__ == "__main__":
    sys.exit(main())
