"""Row reductions over a full vocabulary: which aten ops the fused lm_head losses use.

Times, on fp32 logits [rows, vocab] at one thread, each reduction the Medusa and MTP
losses need computed two ways that give the same numbers (the way they were written
first, and bench.training.vocab_rows's), interleaved and repeated, and keeps the
record with the largest difference between the two results:

    python -m scripts.vocab_rows [--rows 128] [--rounds 7] [--calls 5]
    -> results/<target>/profile/vocab-rows-<machine>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.training.vocab_rows import agrees, rowdot, softmax_lse


def pairs(z: torch.Tensor, p: torch.Tensor) -> dict:
    """name -> (first way, vocab_rows's way): callables returning comparable tensors."""
    best = p.argmax(-1)
    return {
        "row dot": (lambda: torch.bmm(p[:, None, :], z[:, :, None])[:, 0, 0], lambda: rowdot(p, z)),
        "log-sum-exp": (lambda: z.logsumexp(-1), lambda: softmax_lse(z)[1]),
        "softmax and log-sum-exp": (lambda: (lambda lse: ((z - lse[:, None]).exp(), lse))(z.logsumexp(-1)),
                                    lambda: softmax_lse(z)),
        "argmax agreement": (lambda: z.argmax(-1) == best, lambda: agrees(z, best)),
    }


def largest_difference(a, b) -> float:
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def main() -> None:
    from tqdm import tqdm

    from bench.core.provenance import machine_key, provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls per timing (their mean)")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(args.rows, args.vocab, generator=generator) * 4
    p = (torch.randn(args.rows, args.vocab, generator=generator) * 4).softmax(-1)
    ways = pairs(z, p)
    times: dict[str, dict[str, list[float]]] = {name: {"first": [], "vocab_rows": []} for name in ways}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for name, (first, fast) in ways.items():
            for label, function in (("first", first), ("vocab_rows", fast)):
                function()
                begin = time.perf_counter()
                for _ in range(args.calls):
                    function()
                times[name][label].append((time.perf_counter() - begin) / args.calls)
    summary = {}
    for name, (first, fast) in ways.items():
        ratios = [f / v for f, v in zip(times[name]["first"], times[name]["vocab_rows"])]
        summary[name] = {"first_ms": 1e3 * statistics.median(times[name]["first"]),
                         "vocab_rows_ms": 1e3 * statistics.median(times[name]["vocab_rows"]),
                         "first_over_vocab_rows": {"median": statistics.median(ratios), "min": min(ratios),
                                                   "max": max(ratios)},
                         "largest_difference": largest_difference(first(), fast())}
    record = {"what": "row reductions of fp32 logits, one thread, the first way vs bench.training.vocab_rows",
              "rows": args.rows, "vocab": args.vocab, "rounds": args.rounds, "calls_per_timing": args.calls,
              "times_s": times,
              "summary": summary, "provenance": provenance("cpu")}
    folder = Path(args.results_dir) / "smollm2-135m" / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vocab-rows-{machine_key('cpu')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    for name, s in summary.items():
        r = s["first_over_vocab_rows"]
        print(f"{name}: {s['first_ms']:.2f} ms -> {s['vocab_rows_ms']:.2f} ms, "
              f"{r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}], largest difference {s['largest_difference']:.2g}")
    print(f"kept: {path}")


if __name__ == "__main__":
    main()
