"""How much faster is a training step than at another revision, or under another environment?

Runs `bench train` for N steps (then stops it) for the current checkout and for a base (a git revision,
checked out in a temporary worktree, and/or environment variables such as MALLOC_CONF), in
fresh processes, alternating, and keeps the record: every step's seconds, the median ratio
with its spread over rounds, and the first steps' losses of both (the same seed and data:
they differ only by rounding when the change keeps the arithmetic):

    python -m scripts.train_ab --method medusa --base 1e8349a [--rounds 2] [--steps 6] \\
        [--base-env MALLOC_CONF=dirty_decay_ms:10000] [--current-arg=--compile] [--cpu 0] -- --option num_heads=5 ...
    -> results/<target>/profile/train-ab-<method>-<label>-<machine>.json

Only the steps are timed (each run's start is not); a run is stopped once its log holds N
steps, before any export.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(checkout: Path, env: dict, args: list[str], steps: int, out: Path, cpu: str | None) -> list[dict]:
    """`bench train` until its log holds `steps` steps, then stopped (no export, no evaluation)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "bench.cli", "train", *args, "--max-steps", str(10 * steps), "--out", str(out),
               "--threads", "1", "--checkpoint-minutes", "1000"]
    if cpu is not None:
        command = ["taskset", "-c", cpu, *command]
    log = out / "log.jsonl"
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        while process.poll() is None and (not log.exists() or len(log.read_text().splitlines()) < steps):
            time.sleep(0.5)
        if process.poll() is not None:
            errors.seek(0)
            raise SystemExit(f"bench train stopped in {checkout}: {errors.read().strip().splitlines()[-1:]}")
        process.terminate()
        process.wait()
    return [json.loads(line) for line in log.read_text().splitlines()[:steps]]


def step_seconds(rows: list[dict]) -> list[float]:
    """Seconds of each step after the first (which also warms the allocator and caches)."""
    elapsed = [r["elapsed_s"] for r in rows]
    return [b - a for a, b in zip(elapsed, elapsed[1:])]


def main() -> None:
    from tqdm import tqdm

    from bench.core.provenance import machine_key, provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", required=True)
    parser.add_argument("--base", default="HEAD", help="git revision of the base (default: this checkout's HEAD)")
    parser.add_argument("--base-env", action="append", default=[], help="KEY=VALUE set for the base runs only")
    parser.add_argument("--current-arg", action="append", default=[],
                        help="a `bench train` argument for this checkout's runs only, e.g. --current-arg=--compile")
    parser.add_argument("--label", default=None, help="name of the comparison in the record's file name")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps logged per run (the first is not timed)")
    parser.add_argument("--cpu", default=None, help="taskset CPU list for every run")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("train_args", nargs="*", help="after --: more `bench train` options")
    args = parser.parse_args()
    root = Path.cwd()
    base_sha = subprocess.run(["git", "rev-parse", args.base], capture_output=True, text=True,
                              check=True).stdout.strip()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base_env = dict(env, **dict(item.split("=", 1) for item in args.base_env))
    train_args = ["--method", args.method, *args.train_args]
    runs: dict[str, list[list[dict]]] = {"base": [], "current": []}
    with tempfile.TemporaryDirectory() as scratch:
        base_checkout = root
        if args.base != "HEAD":
            base_checkout = Path(scratch) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base_checkout), base_sha], check=True,
                           capture_output=True)
            # the same interpreter and packages, and the same distilled data: its resolved folder is part
            # of the feature cache's key, so the base reads the features already extracted
            for shared in (".venv", "methods/distilled"):
                shutil.rmtree(base_checkout / shared, ignore_errors=True)
                (base_checkout / shared).symlink_to(root / shared)
        try:
            for _ in tqdm(range(args.rounds), desc="rounds (base, then current)"):
                out = Path(scratch) / "out"
                runs["base"].append(run(base_checkout, base_env, train_args, args.steps, out, args.cpu))
                runs["current"].append(run(root, env, train_args + args.current_arg, args.steps, out, args.cpu))
        finally:
            if base_checkout != root:
                subprocess.run(["git", "worktree", "remove", "--force", str(base_checkout)], capture_output=True)
    medians = {name: [statistics.median(step_seconds(rows)) for rows in rounds] for name, rounds in runs.items()}
    ratios = [b / c for b, c in zip(medians["base"], medians["current"])]
    first_losses = {name: [r["loss"] for r in rounds[0][:3]] for name, rounds in runs.items()}
    record = {"what": f"`bench train --method {args.method}` step seconds, base vs this checkout, alternating "
                      "fresh processes (each step after the first)",
              "method": args.method, "train_args": train_args, "base": {"revision": base_sha, "env": args.base_env},
              "current_args": args.current_arg,
              "rounds": args.rounds,
              "step_seconds": {name: [step_seconds(rows) for rows in rounds] for name, rounds in runs.items()},
              "median_step_s": medians, "base_over_current": {"median": statistics.median(ratios),
                                                               "min": min(ratios), "max": max(ratios)},
              "first_losses": first_losses, "provenance": provenance("cpu")}
    label = args.label or ("env" if args.base == "HEAD" else base_sha[:7])
    folder = Path(args.results_dir) / "smollm2-135m" / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"train-ab-{args.method}-{label}-{machine_key('cpu')}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    r = record["base_over_current"]
    print(f"{args.method}: base {statistics.median(medians['base']):.2f} s/step, current "
          f"{statistics.median(medians['current']):.2f} s/step, base/current {r['median']:.2f} "
          f"[{r['min']:.2f}, {r['max']:.2f}]; first losses {first_losses}")
    print(f"kept: {path}")


if __name__ == "__main__":
    main()
