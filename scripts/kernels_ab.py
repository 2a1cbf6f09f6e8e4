"""Does a change to the CPU bf16 kernels keep their bits, and how much faster are the passes?

Builds bench/core/kernels/cpu_bf16.cpp as it is at a base revision beside the checkout's own,
for this CPU's best tier, then
1. runs both on the same random inputs (linear, attention with chain and scattered masks, the
   layer halves; 1 to 33 rows; NaN, signed zeros, tiny and large values) and counts the
   outputs whose bits differ: a change meant to keep the arithmetic must count none, so the
   bf16 records made before it still compare exactly;
2. times the target's k-token passes (context 512) with the engine calling one build or the
   other, alternating pass by pass, and keeps the record:

    python -m scripts.kernels_ab --base HEAD [--threads 2] [--rounds 30] [--ks 1,4,8,16]
    -> results/<target>/profile/kernels-ab-<base>-<machine>-t<threads>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCE = Path("bench/core/kernels/cpu_bf16.cpp")


def build_base(revision: str, tier: str):
    """The kernels as they are at `revision`, built for `tier` under a name of their own."""
    from bench.core import cpu_kernels

    text = subprocess.run(["git", "show", f"{revision}:{SOURCE}"], capture_output=True, text=True, check=True).stdout
    source = Path(tempfile.mkdtemp(prefix="kernels-ab-")) / "cpu_bf16_base.cpp"
    source.write_text(text)
    return cpu_kernels.build(source, tier, prefix="spec_bench_cpu_bf16_base")


def _inputs(generator: torch.Generator, rows: int, scale: float) -> dict:
    """Random bf16 operands of a SmolLM2-shaped layer (d 576, 9 heads over 3 K/V heads of 64)."""
    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).bfloat16()

    x = randn(rows, 576, std=scale)
    x[0, :4] = torch.tensor([float("nan"), 0.0, -0.0, 1e-38])
    return {"x": x, "norm": randn(576), "qkv": randn(960, 576, std=0.05), "cos": randn(rows, 64),
            "sin": randn(rows, 64), "o": randn(576, 576, std=0.05), "gate_up": randn(3072, 576, std=0.05),
            "down": randn(576, 1536, std=0.05), "attn": randn(rows, 576, std=scale)}


def _outputs(kernels, a: dict, span: int, chain: bool, generator: torch.Generator) -> list[torch.Tensor]:
    rows = a["x"].shape[0]
    q, k, v = kernels.layer_inputs(a["x"], a["norm"], kernels.pack(a["qkv"]), 960, None, a["cos"], a["sin"], 9, 3,
                                   1e-5)
    keys = torch.cat([torch.randn(3, span, 64, generator=generator).bfloat16(), k], dim=1)
    values = torch.cat([torch.randn(3, span, 64, generator=generator).bfloat16(), v], dim=1)
    visible = torch.ones(rows, span + rows, dtype=torch.bool)
    visible[:, span:] = torch.ones(rows, rows, dtype=torch.bool).tril() if chain else \
        torch.rand(rows, rows, generator=generator) < 0.5
    if not chain:
        visible[:, 3] = False
    attention = kernels.attention(q, keys, values, visible, 0.125)
    out = kernels.layer_outputs(a["x"], a["attn"], kernels.pack(a["o"]), a["norm"], kernels.pack(a["gate_up"]), 3072,
                                kernels.pack(a["down"]), 1e-5)
    return [kernels.pack(a["down"]), kernels.linear(a["x"], kernels.pack(a["gate_up"]), 3072), q, k, v, attention, out]


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (a NaN equals a NaN with the same bits)."""
    return values.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[values.dtype])


def compare_bits(base, current, cases: int = 24) -> dict:
    """How many of the outputs differ in any bit between the two builds, over `cases` inputs."""
    differing, total = 0, 0
    for case in range(cases):
        rows, scale = (1, 3, 16, 17, 33)[case % 5], (1e-2, 1.0, 30.0)[case % 3]
        span, chain = (40, 512, 300)[case % 3], case % 2 == 0
        results = []
        for kernels in (base, current):
            generator = torch.Generator().manual_seed(case)
            results.append(_outputs(kernels, _inputs(generator, rows, scale), span, chain, generator))
        for ours, theirs in zip(*results):
            total += 1
            differing += not torch.equal(_bits(ours), _bits(theirs))
    return {"outputs_compared": total, "outputs_differing": differing}


def time_passes(base, current, ks: list[int], rounds: int) -> dict:
    """Median seconds of k-token passes after 512 tokens, the engine on one build or the other,
    alternating pass by pass (the packed weights are shared: both builds read one layout)."""
    from bench.core.target import load_target

    engine = load_target(device="cpu", dtype="bfloat16").engine
    if engine.kernels is None:
        raise SystemExit("the engine does not run on the CPU kernels here (no tier, or SPEC_BENCH_CPU_KERNELS=0)")
    generator = torch.Generator().manual_seed(0)
    engine.prefill(torch.randint(0, 40000, (512,), generator=generator), logits_rows="none")
    out = {}
    with torch.inference_mode():
        for k in ks:
            tokens = torch.randint(0, 40000, (k,), generator=generator)
            seconds = {"base": [], "current": []}
            for _ in range(rounds + 2):
                for name, kernels in (("base", base), ("current", current)):
                    engine.kernels = kernels
                    begin = time.perf_counter()
                    engine.forward(tokens)
                    seconds[name].append(time.perf_counter() - begin)
                    engine.crop(512)
            seconds = {name: values[2:] for name, values in seconds.items()}  # the first two warm up
            ratios = [b / c for b, c in zip(seconds["base"], seconds["current"])]
            out[str(k)] = {"base_ms": 1e3 * statistics.median(seconds["base"]),
                           "current_ms": 1e3 * statistics.median(seconds["current"]),
                           "base_over_current": {"median": statistics.median(ratios),
                                                 "q1": statistics.quantiles(ratios, n=4)[0],
                                                 "q3": statistics.quantiles(ratios, n=4)[2]}}
    engine.kernels = current
    return out


def main() -> None:
    from bench.core import cpu_kernels
    from bench.core.provenance import machine_key, provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="git revision whose kernels to compare against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--ks", default="1,4,8,16")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tier = cpu_kernels.cpu_tier()
    current = cpu_kernels.kernels()
    if tier is None or current is None:
        raise SystemExit("no CPU kernel tier builds on this machine")
    base_sha = subprocess.run(["git", "rev-parse", args.base], capture_output=True, text=True,
                              check=True).stdout.strip()
    base = build_base(base_sha, tier)
    probe = torch.randn(100, 70).bfloat16()
    if not torch.equal(base.pack(probe), current.pack(probe)):
        raise SystemExit(f"the packed weight layout changed since {args.base}: the passes cannot share weights")
    bits = compare_bits(base, current)
    print(f"{bits['outputs_differing']} of {bits['outputs_compared']} outputs differ in their bits from {args.base}")
    passes = time_passes(base, current, [int(k) for k in args.ks.split(",")], args.rounds)
    for k, row in passes.items():
        ratio = row["base_over_current"]
        print(f"k={k:>3}: base {row['base_ms']:.2f} ms, current {row['current_ms']:.2f} ms, "
              f"base/current {ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]")
    record = {"what": "the CPU bf16 kernels at a base revision vs this checkout: output bits and k-token pass times "
                      "(context 512, alternating pass by pass)",
              "target": "smollm2-135m", "tier": tier, "base": {"revision": base_sha}, "threads": args.threads,
              "rounds": args.rounds, "bits": bits, "passes": passes, "provenance": provenance("cpu")}
    folder = Path(args.results_dir) / "smollm2-135m" / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kernels-ab-{base_sha[:7]}-{machine_key('cpu')}-t{args.threads}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
