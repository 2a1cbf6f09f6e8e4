"""Does an OpenMP worker that sleeps between parallel regions slow a decode step?

A CPU step enters several parallel regions per layer (each linear layer, the attention).
libgomp's default lets an idle worker sleep after a short spin, and waking it costs time at
the next region; `OMP_WAIT_POLICY=ACTIVE` keeps it spinning (what bench/__init__.py sets
for the harness, as llama.cpp's thread pool spins). This times the target's one-token and
16-token passes (context 512, random tokens) in fresh processes, alternating the two
policies, and keeps the record:

    python -m scripts.omp_wait [--rounds 6] [--threads 2]
    -> results/<target>/profile/omp-wait-<machine>-t<threads>.json

A policy only takes effect before torch loads libgomp, hence one process per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
from bench.core.target import load_target
torch.set_num_threads(int(sys.argv[1]))
engine = load_target(device="cpu", dtype=sys.argv[2]).engine
engine.prefill(torch.randint(0, 40000, (512,), generator=torch.Generator().manual_seed(0)), logits_rows="last")
start = engine.cache.length
out = {}
for k in (1, 16):
    times = []
    for i in range(45):
        tokens = torch.randint(0, 40000, (k,), generator=torch.Generator().manual_seed(i))
        begin = time.perf_counter()
        engine.forward(tokens, logits_rows="all")
        times.append(time.perf_counter() - begin)
        engine.cache.crop(start)
    out[f"t{k}_s"] = sorted(times[5:])[len(times[5:]) // 2]
print(json.dumps(out))
"""

POLICIES = {"default": None, "active": "ACTIVE"}


def measure(policy: str | None, threads: int, dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_WAIT_POLICY"] = policy or ""  # empty: libgomp's default (bench/__init__ keeps a set value)
    env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", CHILD, str(threads), dtype], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from tqdm import tqdm

    from bench.core.provenance import machine_key, provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for _ in tqdm(range(args.rounds), desc="rounds (each policy once, alternating)"):
        for name, policy in POLICIES.items():
            runs[name].append(measure(policy, args.threads, args.dtype))
    summary = {}
    for key in ("t1_s", "t16_s"):
        ratios = [a[key] / d[key] for a, d in zip(runs["active"], runs["default"])]
        summary[key] = {name: {"median": statistics.median(r[key] for r in rows),
                               "min": min(r[key] for r in rows), "max": max(r[key] for r in rows)}
                        for name, rows in runs.items()}
        summary[key]["active_over_default"] = {"median": statistics.median(ratios), "min": min(ratios),
                                               "max": max(ratios)}
    record = {"what": "target pass time, context 512, OMP_WAIT_POLICY unset vs ACTIVE, alternating processes",
              "target": "smollm2-135m", "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds,
              "runs": runs, "summary": summary, "provenance": provenance("cpu")}
    folder = Path(args.results_dir) / "smollm2-135m" / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"omp-wait-{machine_key('cpu')}-t{args.threads}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    for key in ("t1_s", "t16_s"):
        s = summary[key]
        print(f"{key}: default {s['default']['median'] * 1e3:.2f} ms, active {s['active']['median'] * 1e3:.2f} ms, "
              f"active/default {s['active_over_default']['median']:.3f} "
              f"[{s['active_over_default']['min']:.3f}, {s['active_over_default']['max']:.3f}]")
    print(f"kept: {path}")


if __name__ == "__main__":
    main()
