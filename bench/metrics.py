"""Metrics over turn records (the conventions results/README.md states for its tables).

- τ is pooled: Σ_r (n_r + 1) / #rounds, n_r = accepted draft tokens of round r; the
  token sampled at prefill is not a round. A round cut short by EOS still counts n_r + 1.
- Unconditional acceptance u_i = #(n_r ≥ i) / #(proposed_r ≥ i).
- Conditional acceptance a_i = #(n_r ≥ i) / #(n_r ≥ i-1 and proposed_r ≥ i).
  For trees, i is the depth and proposed_r the deepest draft path.
- Speedup is a ratio of sums over the turns both runs finished:
  (ΣT_base / ΣN_base) / (ΣT_method / ΣN_method), T = TTFT + decode time. Beside it, the
  speedup model τ · t0 / (t_d + t_v) from the measured per-round times.
- Repeats (`bench run --repeats`): a turn pairs with the baseline turn of its own repeat;
  pooled figures pool the repeats, and the speedup of each repeat is kept for its spread.
- Imported turns (bench.specbench) lack some fields (null: bench.records.IMPORTED_UNKNOWN);
  each figure is computed over the turns that have what it needs, and tokens and time fall
  back to the file's `new_tokens` and `wall_time`.
"""

from __future__ import annotations

import random
from collections import Counter


def known(turns: list[dict], *fields: str) -> list[dict]:
    """The turns that recorded every one of `fields` (an imported turn may hold null)."""
    return [t for t in turns if all(t.get(f) is not None for f in fields)]


def new_tokens(turn: dict) -> int:
    return len(turn["tokens"]) if turn["tokens"] is not None else turn["new_tokens"]


def _rounds(turns: list[dict]) -> tuple[list[int], list[int]]:
    """(proposed, accepted) per round, over the turns that recorded both."""
    proposed, accepted = [], []
    for turn in known(turns, "proposed_lengths", "accept_lengths"):
        proposed += turn["proposed_lengths"]
        accepted += turn["accept_lengths"]
    return proposed, accepted


def _accepted(turns: list[dict]) -> list[int]:
    return [a for turn in known(turns, "accept_lengths") for a in turn["accept_lengths"]]


def tau(turns: list[dict]) -> float:
    accepted = _accepted(turns)
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else float("nan")


def tau_ceiling(turns: list[dict]) -> float:
    """The most τ the rounds could have reached, every draft accepted: 1 + the mean of each
    round's deepest draft path. A drafter's quality moves τ only below it."""
    proposed, _ = _rounds(turns)
    return 1 + sum(proposed) / len(proposed) if proposed else float("nan")


def acceptance_unconditional(turns: list[dict]) -> list[float]:
    proposed, accepted = _rounds(turns)
    depth = max(proposed, default=0)
    rates = []
    for i in range(1, depth + 1):
        offered = sum(p >= i for p in proposed)
        rates.append(sum(a >= i for a in accepted) / offered if offered else float("nan"))
    return rates


def acceptance_conditional(turns: list[dict]) -> list[float]:
    proposed, accepted = _rounds(turns)
    depth = max(proposed, default=0)
    rates = []
    for i in range(1, depth + 1):
        reached = sum(a >= i - 1 and p >= i for p, a in zip(proposed, accepted, strict=True))
        rates.append(sum(a >= i for a in accepted) / reached if reached else float("nan"))
    return rates


def accept_histogram(turns: list[dict]) -> dict[int, int]:
    """Counts of τ_r = n_r + 1 over rounds."""
    accepted = _accepted(turns)
    return dict(sorted(Counter(a + 1 for a in accepted).items()))


def draft_efficiency(turns: list[dict]) -> float:
    """Accepted draft tokens per verified draft node."""
    turns = known(turns, "accept_lengths", "tree_sizes")
    accepted = sum(sum(t["accept_lengths"]) for t in turns)
    verified = sum(sum(t["tree_sizes"]) for t in turns)
    return accepted / verified if verified else float("nan")


def total_time(turn: dict) -> float:
    if turn["ttft"] is None or turn["decode_time"] is None:
        return turn["wall_time"]  # an imported turn: its file's whole time of the turn
    return turn["ttft"] + turn["decode_time"]


def tokens_per_second(turns: list[dict]) -> float:
    seconds = sum(total_time(t) for t in turns)
    return sum(new_tokens(t) for t in turns) / seconds if seconds else float("nan")


def mean_ttft(turns: list[dict]) -> float:
    turns = known(turns, "ttft")
    return sum(t["ttft"] for t in turns) / len(turns) if turns else float("nan")


def tpot(turns: list[dict]) -> float:
    """Time per output token after the first, pooled over turns."""
    turns = known(turns, "decode_time")
    steps = sum(new_tokens(t) - 1 for t in turns)
    return sum(t["decode_time"] for t in turns) / steps if steps else float("nan")


def draft_time_per_round(turns: list[dict]) -> float:
    turns = known(turns, "draft_time", "accept_lengths")
    rounds = sum(len(t["accept_lengths"]) for t in turns)
    return sum(t["draft_time"] for t in turns) / rounds if rounds else float("nan")


def _pair_key(turn: dict) -> tuple[str, int, int]:
    return str(turn["question_id"]), turn["turn"], turn.get("repeat", 1)


def _own_baseline(turn: dict) -> dict:
    """The baseline turn a method turn carries (re-timed right before it, bench.run), as a turn."""
    return {**turn["paired_baseline"], "question_id": turn["question_id"], "turn": turn["turn"],
            "repeat": turn.get("repeat", 1), "category": turn.get("category", "")}


def paired(method: list[dict], base: list[dict]) -> tuple[list[dict], list[dict]]:
    """Turns both runs finished (the same question, turn and repeat), in the same order. A
    method turn that carries its own baseline turn (`paired_baseline`: the baseline decoded
    again right before it, because the recorded one is from an earlier moment) pairs with
    that one."""
    base_by_key = {_pair_key(t): t for t in base}
    pairs = [(t, _own_baseline(t) if t.get("paired_baseline") else base_by_key[_pair_key(t)])
             for t in method if t.get("paired_baseline") or _pair_key(t) in base_by_key]
    return [m for m, _ in pairs], [b for _, b in pairs]


def _ratio_of_sums(method: list[dict], base: list[dict]) -> float:
    base_rate = sum(total_time(t) for t in base) / max(1, sum(new_tokens(t) for t in base))
    rate = sum(total_time(t) for t in method) / max(1, sum(new_tokens(t) for t in method))
    return base_rate / rate if rate else float("nan")


def speedup(method: list[dict], base: list[dict]) -> float:
    method, base = paired(method, base)
    return _ratio_of_sums(method, base) if method else float("nan")


def speedup_per_repeat(method: list[dict], base: list[dict]) -> list[float]:
    """The speedup of each repeat on its own (one value for a single pass)."""
    repeats = sorted({t.get("repeat", 1) for t in method})
    return [speedup([t for t in method if t.get("repeat", 1) == r], base) for r in repeats]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the finite values; nan when there are none."""
    finite = sorted(v for v in values if v == v)
    if not finite:
        return float("nan"), float("nan"), float("nan")
    middle = len(finite) // 2
    median = finite[middle] if len(finite) % 2 else (finite[middle - 1] + finite[middle]) / 2
    return median, finite[0], finite[-1]


def speedup_interval(method: list[dict], base: list[dict], samples: int = 1000,
                     seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the speedup, resampling paired turns."""
    method, base = paired(method, base)
    if len(method) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    values = []
    for _ in range(samples):
        idx = [rng.randrange(len(method)) for _ in method]
        values.append(_ratio_of_sums([method[i] for i in idx], [base[i] for i in idx]))
    values.sort()
    return values[int(0.025 * samples)], values[int(0.975 * samples) - 1]


def modelled_speedup(method: list[dict], base: list[dict]) -> float:
    """The speedup model τ · t0 / (t_d + t_v) from the measured parts:
    t0 = the baseline's decode time per round (one target step), t_d and t_v = the
    method's mean draft and verification time per round. Next to the measured speedup it
    tells whether a shortfall is acceptance (τ) or cost (t_d, t_v)."""
    method, base = paired(method, base)
    method, base = (known(turns, "accept_lengths", "draft_time", "verify_time") for turns in (method, base))
    base_rounds = sum(len(t["accept_lengths"]) for t in base)
    rounds = sum(len(t["accept_lengths"]) for t in method)
    if not base_rounds or not rounds:
        return float("nan")
    t0 = sum(t.get("verify_time", 0.0) + t.get("draft_time", 0.0) for t in base) / base_rounds
    per_round = sum(t.get("verify_time", 0.0) + t.get("draft_time", 0.0) for t in method) / rounds
    return tau(method) * t0 / per_round if per_round and t0 else float("nan")


def match_rate(turns: list[dict]) -> float:
    """Share of turns whose tokens equal the baseline's (greedy runs only), as stored."""
    checked = [t["exact_match"] for t in turns if t.get("exact_match") is not None]
    return sum(checked) / len(checked) if checked else float("nan")


def exact_matches(method: list[dict], base: list[dict]) -> list[dict]:
    """The greedy turns (those that stored an exact_match flag) checked again: each turn's
    token ids against its baseline turn's (the recorded baseline of the same question, turn
    and repeat; else the baseline re-timed beside it). The stored flag is only a cache: a
    turn whose flag and tokens disagree reads as its tokens say, and is counted in
    `flag_disagrees`. A turn whose tokens or baseline are unknown keeps its flag."""
    base_by_key = {_pair_key(t): t for t in base}
    out = []
    for turn in method:
        stored = turn.get("exact_match")
        if stored is None:
            continue
        reference = base_by_key.get(_pair_key(turn)) or turn.get("paired_baseline")
        tokens = turn.get("tokens")
        known_tokens = reference is not None and tokens is not None and reference.get("tokens") is not None
        exact = tokens == reference["tokens"] if known_tokens else stored
        out.append({"exact": exact, "stored": stored, "near_tie": bool(turn.get("near_tie")) and not exact})
    return out


def summarize(method: list[dict], base: list[dict] | None = None) -> dict:
    row = {
        "turns": len(method),
        "repeats": len({t.get("repeat", 1) for t in method}),
        "new_tokens": sum(new_tokens(t) for t in method),
        "tau": tau(method),
        "tau_ceiling": tau_ceiling(method),
        "accept_uncond": acceptance_unconditional(method),
        "accept_cond": acceptance_conditional(method),
        "accept_hist": accept_histogram(method),
        "draft_efficiency": draft_efficiency(method),
        "tokens_per_s": tokens_per_second(method),
        "ttft_s": mean_ttft(method),
        "tpot_s": tpot(method),
        "draft_s_per_round": draft_time_per_round(method),
        "match_rate": match_rate(method),
        "near_ties": sum(t.get("exact_match") is False and bool(t.get("near_tie")) for t in method),
        "mismatches": sum(t.get("exact_match") is False and not t.get("near_tie") for t in method),
    }
    if base is not None:  # derived from the token ids, not the stored flags
        checked = exact_matches(method, base)
        if checked:
            row["match_rate"] = sum(c["exact"] for c in checked) / len(checked)
            row["near_ties"] = sum(c["near_tie"] for c in checked)
            row["mismatches"] = sum(not c["exact"] and not c["near_tie"] for c in checked)
            row["flag_disagrees"] = sum(c["exact"] != c["stored"] for c in checked)
    if base is not None:
        # the AR rate each speedup is against (its paired turns): tok/s / this = the speedup
        row["base_tokens_per_s"] = tokens_per_second(paired(method, base)[1])
        row["speedup"] = speedup(method, base)
        row["speedup_ci"] = speedup_interval(method, base)
        row["speedup_repeats"] = speedup_per_repeat(method, base)
        row["speedup_model"] = modelled_speedup(method, base)
    return row
