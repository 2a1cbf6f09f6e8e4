"""`bench tune`: each method's fastest draft budget on this machine, measured; `--budget auto`
(bench run, bench.grid) then runs every method at it.

Why: the budget that pays depends on the machine. A verify pass of k tokens costs about
what one token costs on a GPU up to k ~ 64, but 1.2-2.2x on a 2-core CPU at k = 4-16, and a
drafter's rounds cost more where launches or Python overhead dominate. EAGLE's reference
(`total_token=-1`) picks its tree size at load time from timed target passes and assumed
gains; this times whole rounds, drafting included, for every method.

How: the prompts are the first user turns of the ShareGPT conversations that
self-distillation holds back (bench.training.distill.tuning_prompts): never trained
on, never an evaluation question. Per prompt: AR, then the method at every candidate budget
and at its own defaults, greedy, interleaved (each decoder warmed up first). The candidate
with the best speedup (AR's seconds per token over its own, pooled over the prompts) wins;
a tie goes to the defaults, then to the smaller budget. Every candidate's seconds, τ and
exactness is kept in results/<target>/tune/<device>-<dtype>-<machine>-t<threads>.json, the
file `--budget auto` reads (a record of this machine, not a setting of the project).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.core.errors import BenchError

AUTO = "auto"
CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16)
FORMAT = "spec-bench-tune/1"


def parse_budget(value) -> int | str | None:
    """--budget as the CLIs take it: an int >= 1, `auto`, or None."""
    if value is None or value == AUTO:
        return value
    try:
        budget = int(value)
    except (TypeError, ValueError):
        raise BenchError(f"--budget takes an integer >= 1 or 'auto', not '{value}'") from None
    if budget < 1:
        raise BenchError(f"--budget takes an integer >= 1 or 'auto', not {budget}")
    return budget


def tuning_path(results_dir: str | Path, target) -> Path:
    """This machine's tuning record for `target` (device, dtype, CPU tier, torch threads)."""
    from bench.core.provenance import machine_file_name

    return Path(results_dir) / target.name / "tune" / machine_file_name(target)


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchError(f"unreadable tuning record {path}: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("methods"), dict):
        raise BenchError(f"{path} is not a tuning record ({FORMAT}); delete it and run `bench tune` again")
    return record


def _drafter_sha(decoder) -> str | None:
    info = getattr(decoder, "info", None) or {}
    return info.get("manifest_sha") or info.get("weights_sha1")  # SpS / SpecInfer drafts name their weights


def tuned_budget(results_dir: str | Path, target, method: str) -> tuple[int | None, dict]:
    """(the budget `--budget auto` means for `method` here, None for its own defaults; the
    tuning entry). One-line BenchError when this machine has no tuning of the method or
    one of other target weights."""
    path = tuning_path(results_dir, target)
    record = _read(path)
    hint = f"run `bench tune --method {method}` on this machine first"
    if record is None or method not in record["methods"]:
        raise BenchError(f"--budget auto: no tuning of {method} for {target.name} here ({path}); {hint}")
    if record.get("fingerprint") != target.fingerprint:
        raise BenchError(f"--budget auto: {path} was tuned on other weights of {target.name}; {hint}")
    entry = record["methods"][method]
    return entry["best"], {**entry, "file": path.name}


def check_tuned_drafter(entry: dict, decoder, method: str) -> None:
    """A tuning measured with another drafter does not say what this one's budget is."""
    tuned, now = entry.get("drafter_sha"), _drafter_sha(decoder)
    if tuned != now:
        raise BenchError(f"--budget auto: {entry.get('file')} tuned {method} with drafter {tuned}, "
                         f"this run loads {now}; run `bench tune --method {method}` again")


def _decoders(method: str, target, budgets: tuple[int, ...]) -> tuple[dict, dict]:
    """{candidate: decoder} for the defaults (None) and each budget the method takes, and
    {budget: why} for those it refuses."""
    from bench.registry import build_decoder, resolve_options

    built, refused = {None: build_decoder(method, target, {})}, {}
    for budget in budgets:
        try:
            built[budget] = build_decoder(method, target, resolve_options(method, {}, budget))
        except BenchError as exc:
            refused[budget] = str(exc)
    return built, refused


def tune_method(target, method: str, prompts: list[list[int]], budgets: tuple[int, ...] = CANDIDATES,
                max_new_tokens: int = 96) -> dict:
    """Time AR and `method` at each candidate on `prompts`, interleaved; the tuning entry."""
    from tqdm import tqdm

    from bench.core.decode import DecodeConfig
    from bench.core.sampling import SamplingConfig
    from bench.core.target import chat_prompt
    from bench.registry import build_decoder

    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0),
                          eos_token_ids=tuple(target.eos_token_ids))
    baseline = build_decoder("ar", target)
    candidates, refused = _decoders(method, target, budgets)
    hello = chat_prompt(target.tokenizer, [{"role": "user", "content": "Say hello."}])
    warm = DecodeConfig(max_new_tokens=8, sampling=config.sampling, eos_token_ids=config.eos_token_ids)
    for decoder in [baseline, *candidates.values()]:
        decoder.run_turn(hello, warm)
    totals = {key: {"seconds": 0.0, "tokens": 0, "rounds": 0, "accepted": 0, "exact": 0}
              for key in ["ar", *candidates]}
    for prompt in tqdm(prompts, desc=f"tune {method}", unit="prompt", leave=False):
        reference = baseline.run_turn(prompt, config)
        _add(totals["ar"], reference, reference.tokens)
        for key, decoder in candidates.items():
            _add(totals[key], decoder.run_turn(prompt, config), reference.tokens)
    ar_rate = totals["ar"]["seconds"] / max(1, totals["ar"]["tokens"])
    rows = []
    for key in candidates:
        t = totals[key]
        rate = t["seconds"] / max(1, t["tokens"])
        rows.append({"budget": key, "seconds": round(t["seconds"], 4), "tokens": t["tokens"],
                     "tau": round((t["accepted"] + t["rounds"]) / max(1, t["rounds"]), 3),
                     "speedup": round(ar_rate / rate, 4) if rate > 0 else 0.0,
                     "exact_prompts": t["exact"]})
    best = best_candidate(rows)
    return {"drafter_sha": _drafter_sha(candidates[None]),
            "drafter": getattr(candidates[None], "info", None), "ar_seconds": round(totals["ar"]["seconds"], 4),
            "ar_tokens": totals["ar"]["tokens"], "candidates": rows, "refused": {str(k): v for k, v in refused.items()},
            "best": best["budget"], "best_speedup": best["speedup"]}


def best_candidate(rows: list[dict]) -> dict:
    """The fastest candidate; on a tie the method's defaults (budget None), then the smaller budget."""
    return max(rows, key=lambda r: (r["speedup"], r["budget"] is None, -(r["budget"] or 0)))


def _add(total: dict, result, reference: list[int]) -> None:
    total["seconds"] += result.decode_time
    total["tokens"] += max(0, len(result.tokens) - 1)  # decode_time runs from the first token on
    total["rounds"] += len(result.accept_lengths)
    total["accepted"] += sum(result.accept_lengths)
    total["exact"] += result.tokens == reference


def tune(target, methods: list[str], prompts: list[list[int]], results_dir: str | Path,
         budgets: tuple[int, ...] = CANDIDATES, max_new_tokens: int = 96, echo=print, retune: bool = False) -> Path:
    """Tune each method and merge its entry into this machine's record; returns the path.
    Idempotent: a method already tuned here with the same drafter and settings is kept
    (`retune` measures it again). A method that cannot run here (no drafter) is reported
    and left out."""
    import torch
    from tqdm import tqdm

    from bench.core.provenance import provenance
    from bench.records import prompt_hash
    from bench.registry import build_decoder

    path = tuning_path(results_dir, target)
    record = _read(path) or {}
    if record and record.get("fingerprint") != target.fingerprint:
        record = {}  # other weights: nothing of the old record applies
    entries = dict(record.get("methods", {}))
    settings = {"budgets": list(budgets), "max_new_tokens": max_new_tokens,
                "prompts": [prompt_hash(p) for p in prompts]}  # as the run records name their prompts
    for method in tqdm(methods, desc="tune", unit="method"):
        try:
            previous = entries.get(method)
            if (not retune and previous and previous.get("settings") == settings
                    and previous.get("drafter_sha") == _drafter_sha(build_decoder(method, target, {}))):
                echo(f"[tune] {method}: already tuned here with this drafter (--retune measures it again)")
                continue
            started = time.perf_counter()
            entry = tune_method(target, method, prompts, budgets, max_new_tokens)
        except BenchError as exc:
            echo(f"[tune] {method}: not tuned: {exc}")
            continue
        entry["settings"] = settings
        entry["minutes"] = round((time.perf_counter() - started) / 60, 2)
        entries[method] = entry
        best = "its defaults" if entry["best"] is None else f"budget {entry['best']}"
        echo(f"[tune] {method}: {best} ({entry['best_speedup']:.2f}x AR on the tuning prompts)")
        record = {"format": FORMAT, "target": target.name, "fingerprint": target.fingerprint,
                  "dtype": str(target.engine.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                  "provenance": provenance(str(target.engine.device)), "methods": entries}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        tmp.replace(path)  # after every method: an interrupted tuning keeps what it measured
    return path


def tuned_overview(tuned, default, stale: set[str] = frozenset()):
    """The tuned series beside the grid's, pooled over tasks (bench report --tuned-tag): per
    method the budget it ran at, τ, speedup and exactness, and the speedup at its defaults.
    `tuned`, `default`: the `overall` tables (bench.report.tables) of the two series; `stale`: methods
    with a task recorded long after the shared baseline (marked *: "not interleaved")."""
    import math

    import pandas as pd

    from bench.records import BASELINE

    if tuned.empty:
        return pd.DataFrame()
    at_defaults = {r.method: r.speedup for r in default.itertuples()} if not default.empty else {}
    rows = []
    for r in tuned[tuned["method"].ne(BASELINE)].sort_values("method").itertuples():
        low, high = r.speedup_ci if isinstance(r.speedup_ci, (tuple, list)) else (math.nan, math.nan)
        before = at_defaults.get(r.method, math.nan)
        ci = ", ".join("-" if pd.isna(v) else f"{v:.2f}" for v in (low, high))
        rows.append({"method": r.method, "budget": "-" if pd.isna(r.budget) else int(r.budget), "turns": int(r.turns),
                     "τ": f"{r.tau:.2f}",
                     "speedup [95% CI]": f"{r.speedup:.2f}x [{ci}]" + (" *" if r.method in stale else ""),
                     "at its defaults": "-" if pd.isna(before) else f"{before:.2f}x",
                     "exact match": "-" if pd.isna(r.match_rate) else f"{100 * r.match_rate:.0f}%"})
    return pd.DataFrame(rows)
