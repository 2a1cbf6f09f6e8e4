"""A run's acceptance profile in the layout NVIDIA's specdec_bench writes (SPEED-Bench's tool,
Model-Optimizer `examples/specdec_bench`, its `acceptance_rate.json`), so the tools that read
those files (AIPerf's category x metric matrix among them) read ours.

Its keys, as that tool writes them: `Request_AL` (each request's mean tokens per step, its
turns pooled), `Category_AL` (the mean of those per category), `Average_AL` (their mean over
requests), `Acceptance_Length_Histogram` (steps by tokens emitted: accepted drafts + 1),
`Conditional_Acceptance_Rate` (P(L >= k) / P(L >= the previous length seen)) and
`Joint_Acceptance_Rate` (P(L >= k), the marginal). Ours adds `Per_Category` (the histogram,
conditional and joint rates of each category), `Checks` (the identities below, each with the
two sides) and `Source` (the record file, method, task, settings). A file is one JSON list
holding one such object, as specdec_bench appends them.

The identities, which `check` verifies on any profile: the histogram counts every step; the
joint rate starts at 1 and never rises; each conditional rate is the ratio of consecutive
joint rates; the step-weighted mean tokens per step (our τ) equals the sum of the joint rates
over 1..K+1 (gaps in the histogram counted as lengths nobody reached).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from bench.core.errors import BenchError
from bench.records import RunFile

TOLERANCE = 1e-9


def rates(histogram: dict[int, int]) -> tuple[dict[int, float], dict[int, float]]:
    """(conditional, joint) per length, over the lengths the histogram holds, as specdec_bench
    computes them."""
    total = sum(histogram.values())
    conditional, joint = {}, {}
    remaining, previous, running = total, 1.0, 1.0
    for length in sorted(histogram):
        share = remaining / total
        conditional[length] = share / previous
        running *= conditional[length]
        joint[length] = running
        previous = share
        remaining -= histogram[length]
    return conditional, joint


def _lengths(turns: list[dict]) -> list[int]:
    return [accepted + 1 for turn in turns for accepted in (turn.get("accept_lengths") or [])]


def profile(path: Path) -> dict:
    """The profile of the run recorded in `path` (every turn that recorded its rounds)."""
    run = RunFile(Path(path))
    if not run.headers:
        raise BenchError(f"{path}: not a run record file (no header)")
    turns = [t for t in run.turns if t.get("accept_lengths") is not None]
    if not turns:
        raise BenchError(f"{path}: no turn recorded its rounds (an imported run without them, or none finished)")
    by_request: dict[str, list[int]] = defaultdict(list)
    category: dict[str, str] = {}
    for turn in turns:
        by_request[str(turn["question_id"])] += _lengths([turn])
        category[str(turn["question_id"])] = turn.get("category") or "default"
    request_al = {q: sum(v) / len(v) for q, v in by_request.items() if v}
    per_category: dict[str, list[str]] = defaultdict(list)
    for question in request_al:
        per_category[category[question]].append(question)
    histogram = Counter(_lengths(turns))
    conditional, joint = rates(histogram)
    categories = {}
    for name, questions in sorted(per_category.items()):
        counts = Counter(length for q in questions for length in by_request[q])
        cond, jnt = rates(counts)
        categories[name] = {"Acceptance_Length_Histogram": _keys(counts), "Conditional_Acceptance_Rate": _keys(cond),
                            "Joint_Acceptance_Rate": _keys(jnt),
                            "Category_AL": sum(request_al[q] for q in questions) / len(questions)}
    out = {"Request_AL": request_al,
           "Category_AL": {name: c["Category_AL"] for name, c in categories.items()},
           "Average_AL": sum(request_al.values()) / len(request_al),
           "Acceptance_Length_Histogram": _keys(histogram),
           "Conditional_Acceptance_Rate": _keys(conditional),
           "Joint_Acceptance_Rate": _keys(joint),
           "Per_Category": categories,
           "Source": {"record_file": str(run.path), "method": run.method, "task": run.task, "tag": run.tag,
                      "settings": run.settings, "turns": len(turns)}}
    out["Checks"] = checks(out)
    return out


def _keys(values: dict[int, float]) -> dict[str, float]:
    return {str(k): values[k] for k in sorted(values)}  # JSON object keys, as json.dump writes int keys


def checks(profile: dict) -> dict[str, dict]:
    """Each identity with its two sides and whether it holds."""
    histogram = {int(k): v for k, v in profile["Acceptance_Length_Histogram"].items()}
    joint = {int(k): v for k, v in profile["Joint_Acceptance_Rate"].items()}
    conditional = {int(k): v for k, v in profile["Conditional_Acceptance_Rate"].items()}
    steps = sum(histogram.values())
    mean = sum(k * v for k, v in histogram.items()) / steps
    lengths = sorted(joint)
    # P(L >= k) for every k in 1..max: a length absent from the histogram keeps the next one's rate
    filled = [next(joint[m] for m in lengths if m >= k) for k in range(1, max(lengths) + 1)]
    ratio = all(abs(conditional[b] - joint[b] / joint[a]) <= 1e-6 for a, b in zip(lengths, lengths[1:]))
    out = {
        "histogram_counts_every_step": {"steps": steps, "histogram_total": sum(histogram.values()),
                                        "holds": steps == sum(histogram.values()) and steps > 0},
        "joint_starts_at_one": {"joint_first": joint[lengths[0]], "holds": abs(joint[lengths[0]] - 1) <= 1e-6},
        "joint_never_rises": {"holds": all(joint[b] <= joint[a] + TOLERANCE for a, b in zip(lengths, lengths[1:]))},
        "conditional_is_the_ratio_of_joints": {"holds": ratio},
        "mean_tokens_per_step_is_the_sum_of_joints": {"mean": mean, "sum_of_joint": sum(filled),
                                                      "holds": abs(mean - sum(filled)) <= 1e-6 * mean},
    }
    return out


def problems(profile: dict) -> list[str]:
    """The identities that fail on `profile` (recomputed, not read from its Checks)."""
    return [name for name, check in checks(profile).items() if not check["holds"]]
