"""Hand-built run records for the report tests: numbers chosen so every table entry can be
worked out by hand (see the comments)."""

from __future__ import annotations

import json
from pathlib import Path

TARGET = "tiny"


def turn(question_id: str, number: int = 1, *, category: str = "writing", tokens: int = 10, ttft: float = 0.1,
         decode: float = 0.9, proposed=(0,) * 9, accepted=(0,) * 9, draft: float = 0.0, verify: float = 0.9,
         exact=None, util=None) -> dict:
    return {"type": "turn", "question_id": question_id, "category": category, "turn": number, "prompt_len": 5,
            "prompt_hash": f"h{question_id}{number}", "tokens": list(range(tokens)), "text": "x",
            "stop_reason": "length", "ttft": ttft, "decode_time": decode, "draft_time": draft,
            "verify_time": verify, "rounds": len(accepted), "proposed_lengths": list(proposed),
            "accept_lengths": list(accepted), "tree_sizes": list(proposed), "exact_match": exact,
            "utilization": util or {"kind": "cpu", "util_mean": 50.0}}


def header(method: str, task: str, **settings) -> dict:
    return {"type": "header",
            "settings": {"method": method, "task": task, "target": TARGET, "max_new_tokens": 10,
                         "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}, "method_options": {},
                         **settings},
            "provenance": {"git_sha": "abc123", "device_name": "test cpu", "torch_threads": 1,
                           "started_at": "2026-01-01T00:00:00Z", "packages": {"torch": "x"}}}


def write_run(results: Path, task: str, method: str, tag: str, turns: list[dict], tail: str = "",
              **settings) -> Path:
    path = results / TARGET / task / f"{method}-{tag}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(header(method, task, **settings))] + [json.dumps(t) for t in turns]
    path.write_text("\n".join(lines) + "\n" + tail, encoding="utf-8")
    return path


# A pld turn: 10 tokens = 1 (prefill) + rounds of (3+1) + (2+1) + (1+1); τ = 9/3 = 3.
PLD_ROUNDS = {"proposed": (3, 3, 3), "accepted": (3, 2, 1)}


def write_clean(results: Path, tag: str = "t", util=None) -> None:
    """MT-bench: 2 questions x 2 turns, AR 1.0 s per turn, pld 0.5 s (speedup 2).
    GSM8K: question "1" again (ids collide across suites), AR 2.0 s, pld 0.5 s (speedup 4).
    Pooled: (6.0 s / 50 tokens) / (2.5 s / 50 tokens) = 2.4."""
    mt_keys = [("1", 1, "writing"), ("1", 2, "writing"), ("2", 1, "math"), ("2", 2, "math")]
    write_run(results, "mtbench", "ar", tag, [turn(q, n, category=c, util=util) for q, n, c in mt_keys])
    write_run(results, "mtbench", "pld", tag,
              [turn(q, n, category=c, decode=0.4, draft=0.1, verify=0.3, exact=True, util=util, **PLD_ROUNDS)
               for q, n, c in mt_keys])
    write_run(results, "gsm8k", "ar", tag, [turn("1", category="math", ttft=0.2, decode=1.8, util=util)])
    write_run(results, "gsm8k", "pld", tag, [turn("1", category="math", decode=0.4, draft=0.1, verify=0.3,
                                                  exact=True, util=util, **PLD_ROUNDS)])


def write_profile(results: Path) -> Path:
    path = results / TARGET / "profile" / "cpu-float32.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "chain", "k": k, "median_s": 0.01 * (1 + k / 8), "ratio_to_k1": (1 + k / 8) / 1.125}
            for k in (1, 2, 4, 8, 16)]
    rows += [{"kind": "tree", "k": k, "median_s": 0.01 * (1 + k / 6), "ratio_to_k1": (1 + k / 6) / 1.125}
             for k in (8, 16)]
    drafters = [{"method": "pld", "rounds": 10, "draft_ms_per_round": 0.2, "verify_ms_per_round": 12.0,
                 "nodes_per_round": 3.0, "tau": 2.0}, {"method": "eagle3", "skipped": "no eagle3 drafter"}]
    compute = {"k": 16, "matmul_flops_per_s": 1e11, "floor_s": 0.02, "least_ratio_to_k1": 2.0}  # drawn as a star
    path.write_text(json.dumps({"target": TARGET, "dtype": "float32", "context": 64, "rows": rows, "drafters": drafters,
                                "compute_bound": compute, "provenance": {"device_name": "test cpu"}}),
                    encoding="utf-8")
    return path
