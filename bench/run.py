"""`bench run`: decode a task suite with one method, interleaved with the AR baseline.

For every question, turn by turn: the baseline turn and then the method's turn, so both see
the same machine state. Each side carries its own conversation: turn 2 is asked after that
side's own first answer (as in Spec-Bench). Finished turns are read back from the records and
skipped. A tag's baseline is recorded once, with the first method run under it; a method run
later still gets a baseline of its own moment: the baseline turn is decoded again right before
the method's (same prompt, same seed), unrecorded in the baseline's file, and its timings are
kept in the method's record as `paired_baseline` (bench.metrics.paired pairs with it).
`repeat` k > 1 is another whole interleaved pass, recorded beside the first under the tag
`<tag>.rep<k>` (bench.records), so a speedup can be given with its spread over repeats.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from bench import metrics
from bench.core.decode import DecodeConfig
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from bench.core.target import chat_prompt
from bench.monitor import UtilizationMonitor
from bench.records import BASELINE, RunFile, check_tag, lock_unfinished, prompt_hash, records_path, repeat_tag
from bench.tune import AUTO, check_tuned_drafter, tuned_budget
from tasks import Question, load_task, task_name


@dataclass
class RunSettings:
    method: str
    task: str
    target: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"  # bf16 where the device has native bf16 (AMX, AVX512-BF16, CUDA), else fp32
    limit: int | None = None
    per_category: int | None = None
    categories: tuple[str, ...] = ()
    tag: str | None = None
    data_dir: str | None = None
    results_dir: str = "results"
    baseline: bool = True
    method_options: dict = field(default_factory=dict)
    budget: int | str | None = None  # --budget: draft tokens verified per round (root excluded), or "auto"
    budget_from: str | None = None  # the tuning record an "auto" budget was read from (bench.tune)
    repeat: int = 1  # which pass of the series this is (1-based); k > 1 goes to tag `<tag>.rep<k>`
    batch_size: int = 1  # requests decoding at once (bench.core.decode.decode_batch); 1: one at a time

    @property
    def records_tag(self) -> str | None:
        return repeat_tag(self.tag, self.repeat)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


def turn_seed(seed: int, question_id: str, turn: int) -> int:
    """A per-turn seed, so a resumed run draws the same numbers as an uninterrupted one."""
    digest = hashlib.sha256(f"{seed}:{question_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class Side:
    """One method's record file and decoder."""

    def __init__(self, name: str, decoder, run_file: RunFile) -> None:
        self.name = name
        self.decoder = decoder
        self.records = run_file
        self.ran = False  # whether the last answer() decoded its turn (False: read back)

    def recorded_reply(self, question: Question, turn: int, prompt: list[int]) -> str | None:
        """The turn's reply if the records hold it (after claiming the file), else None."""
        done = self.records.done(question.question_id, turn, prompt_hash(prompt))
        if done is None:
            self.records.claim()  # another run may have recorded it before this one took the file
            done = self.records.done(question.question_id, turn, prompt_hash(prompt))
        return None if done is None else done["text"]

    def answer(self, question: Question, turn: int, messages: list[dict], settings: RunSettings,
               target, config: DecodeConfig, baseline: Side | None,
               pair: Callable[[], dict] | None = None) -> str:
        """Run (or read back) one turn; returns the reply text for the conversation.
        `pair`: called right before the turn runs, it re-times the baseline's turn (kept in
        the record as `paired_baseline`)."""
        prompt = chat_prompt(target.tokenizer, messages)
        self.ran = False
        if (text := self.recorded_reply(question, turn, prompt)) is not None:
            return text
        check_context(target, len(prompt), config.max_new_tokens, question.question_id, turn)
        extra = {"paired_baseline": pair()} if pair is not None else None
        result, utilization = self._decode(prompt, question, turn, settings, target, config)
        self.ran = True
        return self.record(question, turn, prompt, result, utilization, settings, target, baseline, extra)

    def _decode(self, prompt: list[int], question: Question, turn: int, settings: RunSettings, target,
                config: DecodeConfig) -> tuple[object, dict]:
        """One timed turn with its own seed; (its result, the CPU/GPU utilization meanwhile)."""
        with UtilizationMonitor(str(target.engine.device)) as monitor:
            result = self.decoder.run_turn(prompt, config, turn_generator(target, settings, question, turn))
        return result, monitor.summary()

    def retime(self, question: Question, turn: int, messages: list[dict], settings: RunSettings, target,
               config: DecodeConfig) -> dict:
        """Decode a turn this side's records hold again, unrecorded: its timings now (a later
        method's paired baseline), and whether it reproduced the recorded tokens."""
        prompt = chat_prompt(target.tokenizer, messages)
        result, utilization = self._decode(prompt, question, turn, settings, target, config)
        recorded = self.records.done(question.question_id, turn, prompt_hash(prompt))
        return {"ttft": result.ttft, "decode_time": result.decode_time, "draft_time": result.draft_time,
                "verify_time": result.verify_time, "tokens": result.tokens,
                "proposed_lengths": result.proposed_lengths, "accept_lengths": result.accept_lengths,
                "tree_sizes": result.tree_sizes, "utilization": utilization,
                "same_tokens": recorded is not None and recorded["tokens"] == result.tokens}

    def answer_batch(self, items: list[tuple[Question, int, list[dict]]], settings: RunSettings, target,
                     config: DecodeConfig, baseline: Side | None) -> list[str]:
        """Run (or read back) one turn of many conversations, settings.batch_size decoding at
        once; returns the reply texts."""
        replies: list[str | None] = []
        todo: list[tuple[int, list[int]]] = []
        for question, turn, messages in items:
            prompt = chat_prompt(target.tokenizer, messages)
            replies.append(self.recorded_reply(question, turn, prompt))
            if replies[-1] is None:
                check_context(target, len(prompt), config.max_new_tokens, question.question_id, turn)
                todo.append((len(replies) - 1, prompt))
        if todo:
            generators = [turn_generator(target, settings, items[i][0], items[i][1]) for i, _ in todo]
            with UtilizationMonitor(str(target.engine.device)) as monitor:
                results = self.decoder.run_batch([p for _, p in todo], config, settings.batch_size, generators)
            for (i, prompt), result in zip(todo, results):
                question, turn, _ = items[i]
                replies[i] = self.record(question, turn, prompt, result, monitor.summary(), settings, target,
                                         baseline, {"batch_size": settings.batch_size, "load": result.load,
                                                    "queued": result.queued})
        return replies

    def record(self, question: Question, turn: int, prompt: list[int], result, utilization: dict,
               settings: RunSettings, target, baseline: Side | None, extra: dict | None = None) -> str:
        """Append the turn's record (compared with the baseline's); returns its text."""
        text = target.tokenizer.decode(result.tokens, skip_special_tokens=True)
        record = {
            "question_id": question.question_id, "category": question.category, "turn": turn,
            "prompt_len": len(prompt), "prompt_hash": prompt_hash(prompt),
            "tokens": result.tokens, "text": text, "stop_reason": result.stop_reason,
            "ttft": result.ttft, "decode_time": result.decode_time,
            "draft_time": result.draft_time, "verify_time": result.verify_time,
            "rounds": len(result.accept_lengths), "proposed_lengths": result.proposed_lengths,
            "accept_lengths": result.accept_lengths, "tree_sizes": result.tree_sizes,
            "utilization": utilization, "repeat": settings.repeat, **(extra or {}),
        }
        record.update(compare_with_baseline(record, baseline, settings, target, prompt))
        self.records.add_turn(record)
        return text


def turn_generator(target, settings: RunSettings, question: Question, turn: int) -> torch.Generator:
    """The turn's own generator (a per-turn seed: a resumed or batched run draws the same numbers)."""
    generator = torch.Generator(device=target.engine.device)
    generator.manual_seed(turn_seed(settings.seed, question.question_id, turn))
    return generator


# A k-token verify pass may round differently from a 1-token step. Where the target's logits
# for the two tokens that part at the first divergence are closer than this, the flip is
# floating-point noise.
NEAR_TIE_MARGIN = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.02}


def divergence_margin(target, prompt: list[int], prefix: list[int], ours: int, theirs: int) -> float:
    """How far apart the target's logits for the two parting tokens are after prompt + prefix
    (one extra prefill). Only a gap between these two can be rounding: a token far below the
    top is a real mismatch however close the top two happen to be."""
    logits = target.engine.prefill(torch.tensor(prompt + prefix)).logits[-1].float()
    return abs(float(logits[theirs] - logits[ours]))


def compare_with_baseline(record: dict, baseline: Side | None, settings: RunSettings, target=None,
                          prompt: list[int] | None = None) -> dict:
    """Greedy runs must reproduce the baseline's tokens: note match and first divergence,
    and whether the divergence sits on a near tie (noise) or is a real mismatch."""
    if baseline is None or not settings.sampling.greedy:
        return {"exact_match": None}
    base = baseline.records.done(record["question_id"], record["turn"])
    if base is None or base["prompt_hash"] != record["prompt_hash"]:
        # An earlier turn diverged, so this prompt differs: the comparison says nothing.
        return {"exact_match": None}
    ours, theirs = record["tokens"], base["tokens"]
    divergence = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if divergence is None and len(ours) != len(theirs):
        divergence = min(len(ours), len(theirs))
    result = {"exact_match": divergence is None, "first_divergence": divergence}
    if divergence is not None and target is not None and divergence < min(len(ours), len(theirs)):
        margin = divergence_margin(target, prompt, theirs[:divergence], ours[divergence], theirs[divergence])
        threshold = NEAR_TIE_MARGIN.get(str(target.engine.dtype).removeprefix("torch."), 1e-4)
        result.update(divergence_margin=margin, near_tie=margin < threshold)
    elif divergence is not None:
        result["near_tie"] = False  # one side stopped early: never noise
    return result


def warm_up(sides: list[Side], target, config: DecodeConfig) -> None:
    """One short unrecorded turn per decoder, so one-time costs (allocation, kernel
    selection, lazy imports) stay out of the first recorded turn's timings."""
    prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": "Say hello."}])
    short = DecodeConfig(max_new_tokens=8, sampling=config.sampling, eos_token_ids=config.eos_token_ids)
    for side in sides:
        side.decoder.run_turn(prompt, short, torch.Generator(device=target.engine.device))


def record_settings(settings: RunSettings, method: str, target, decoder) -> dict:
    """What determines a run's outputs and timings; resumed runs must match it. The method's
    options are recorded resolved (typed, --budget mapped): those given or set by the budget
    (a default run records {}); the budget itself only when one was given."""
    from bench.registry import recorded_budget, recorded_options

    own = method == settings.method
    recorded = {
        "method": method, "task": task_name(settings.task), "target": target.name,
        "target_fingerprint": target.fingerprint, "max_new_tokens": settings.max_new_tokens,
        "sampling": settings.sampling.to_dict(), "seed": settings.seed,
        "device": target.engine.device.type, "dtype": settings.dtype,
        "method_options": recorded_options(method, settings.method_options, settings.budget) if own else {},
        **({"budget": settings.budget} if own and settings.budget is not None else {}),
        **({"budget_from": settings.budget_from} if own and settings.budget_from else {}),
        **({"batch_size": settings.batch_size} if settings.batch_size > 1 else {}),
        "lossless": decoder.lossless,
        # Which trained drafter produced the records (methods that load one expose `info`).
        **({"drafter": decoder.info} if getattr(decoder, "info", None) else {}),
    }
    return {**recorded, "draft_budget": recorded_budget(recorded)}  # for readers: not part of the identity


def check_context(target, prompt_len: int, max_new_tokens: int, question_id: str, turn: int) -> None:
    """Refuse a turn whose prompt and new tokens do not fit the target's context."""
    context = getattr(target.config, "max_position_embeddings", None)
    if context and prompt_len + max_new_tokens > context:
        raise BenchError(f"question {question_id} turn {turn}: its prompt ({prompt_len} tokens) and --max-new-tokens "
                         f"({max_new_tokens}) exceed the target's context of {context} tokens; leave the question out "
                         "(--category, --limit) or lower --max-new-tokens")


def check_sampling(sampling: SamplingConfig) -> None:
    """NaN passes every range check (comparisons with it are false): refuse it here."""
    for name, value in (("--temperature", sampling.temperature), ("--top-p", sampling.top_p)):
        if not math.isfinite(value):
            raise BenchError(f"{name} must be a finite number, not {value}")


def check_device(device: str | None) -> None:
    """A bad --device is bad input: say so in one line instead of a torch traceback."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise BenchError(f"unknown device '{device}' (use cpu, cuda or cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):
        raise BenchError(f"unsupported device '{device}' (use cpu, cuda or cuda:N)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise BenchError(f"device '{device}' requested but CUDA is not available here (use --device cpu)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise BenchError(f"device '{device}' does not exist ({torch.cuda.device_count()} CUDA devices)")


def run(settings: RunSettings, repeats: int = 1) -> dict:
    """Run a task (`repeats` whole passes, from `settings.repeat` on); returns the summary rows
    (method and baseline) pooled over the passes, each turn paired within its own pass."""
    from bench.core.target import default_device, resolve_dtype

    check_device(settings.device)
    # Records keep the dtype that ran, so a series means the same arithmetic on every machine.
    settings = replace(settings, dtype=resolve_dtype(settings.dtype, settings.device or default_device()))
    turns: dict[str, list[dict]] = {}
    paths: dict[str, list[str]] = {}
    for repeat in range(settings.repeat, settings.repeat + repeats):
        for name, (side_turns, path) in _run_pass(replace(settings, repeat=repeat)).items():
            turns.setdefault(name, []).extend({**t, "repeat": repeat} for t in side_turns)
            paths.setdefault(name, []).append(path)
    base_turns = turns.get(BASELINE) if settings.method != BASELINE else None
    summary = {settings.method: metrics.summarize(turns[settings.method], base_turns)}
    if base_turns is not None:
        summary[BASELINE] = metrics.summarize(base_turns)
    summary["_paths"] = {name: ", ".join(found) for name, found in paths.items()}
    return summary


def _run_pass(settings: RunSettings) -> dict[str, tuple[list[dict], str]]:
    """One interleaved pass over the task: {side: (its finished turns, its record file)}."""
    from bench.core.target import parse_dtype, resolve_target
    from bench.registry import resolve_options

    # Fail fast on a typo, a bad option or budget, before loading anything.
    resolve_options(settings.method, settings.method_options, 1 if settings.budget == AUTO else settings.budget)
    check_device(settings.device)
    check_sampling(settings.sampling)
    check_tag(settings.tag)
    parse_dtype(settings.dtype)
    questions = load_task(settings.task, settings.data_dir, settings.limit, settings.categories,
                          settings.per_category)
    if not questions:
        raise BenchError(f"task '{settings.task}' selected no questions")
    results_dir, task = Path(settings.results_dir), task_name(settings.task)
    keys = {(q.question_id, t) for q in questions for t in range(1, len(q.turns) + 1)}
    # A second writer is refused now, before the model loads; a finished file stays free to read.
    for name in {settings.method, *([BASELINE] if settings.baseline else [])}:
        lock_unfinished(records_path(results_dir, resolve_target(settings.target)[0], task, name,
                                     settings.records_tag), keys)
    return decode_pass(settings, questions)


Sink = Callable[[str, list[dict]], None]  # (side, lines a record file would have appended)


def decode_pass(settings: RunSettings, questions: list[Question], sink: Sink | None = None,
                recorded: dict[str, bytes] | None = None) -> dict[str, tuple[list[dict], str]]:
    """Load the target and decode, interleaved, every turn of `questions` that the records
    lack; returns {side: (its finished turns, its record file)}. The records are the files
    under settings.results_dir; with a `sink` (bench.grid_ray's workers, which see no results
    folder) they are `recorded[side]`, the files' contents as read by whoever holds them, and
    new lines go to the sink instead."""
    from bench.core.target import load_target
    from bench.registry import build_decoder, resolve_options

    target = load_target(settings.target, settings.device, settings.dtype)
    if sink is None:
        from bench.profile import seed_profile_cache

        seeded = seed_profile_cache(settings.results_dir, target)
        if seeded is not None:
            print(f"[bench] t_v(k) for auto-sized drafts: this machine's kept profile, copied to {seeded}",
                  file=sys.stderr)
    tuned = None
    if settings.budget == AUTO:
        budget, tuned = tuned_budget(settings.results_dir, target, settings.method)
        settings = replace(settings, budget=budget, budget_from=tuned["file"])
    config = DecodeConfig(max_new_tokens=settings.max_new_tokens, sampling=settings.sampling,
                          eos_token_ids=tuple(target.eos_token_ids))
    results_dir, task = Path(settings.results_dir), task_name(settings.task)
    keys = {(q.question_id, t) for q in questions for t in range(1, len(q.turns) + 1)}

    def open_side(name: str, decoder) -> Side:
        path = records_path(results_dir, target.name, task, name, settings.records_tag)
        return Side(name, decoder, RunFile(path, record_settings(settings, name, target, decoder),
                                           str(target.engine.device), sink=partial(sink, name) if sink else None,
                                           content=(recorded or {}).get(name, b"")))

    options = resolve_options(settings.method, settings.method_options, settings.budget)
    method_decoder = build_decoder(settings.method, target, options)
    if tuned is not None:
        check_tuned_drafter(tuned, method_decoder, settings.method)
    method_side = open_side(settings.method, method_decoder)
    baseline_side = None
    if settings.baseline and settings.method != BASELINE:
        baseline_side = open_side(BASELINE, build_decoder(BASELINE, target))
    sides = [s for s in (baseline_side, method_side) if s is not None]
    for side in sides:
        if settings.batch_size > 1 and not hasattr(side.decoder, "run_batch"):
            raise BenchError(f"method '{side.name}' cannot decode batched (it does not run through the shared "
                             "decode loop); run it with --batch-size 1")
    for question in questions:  # every first turn that will run fits the context (later turns: Side.answer)
        if any(side.records.done(question.question_id, 1) is None for side in sides):
            prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": question.turns[0]}])
            check_context(target, len(prompt), config.max_new_tokens, question.question_id, 1)
    if any(side.records.done(*key) is None for side in sides for key in keys):
        warm_up(sides, target, config)  # nothing to time when every turn is read back
    total_turns = sum(len(q.turns) for q in questions)
    label = f"{settings.method} on {task}" + (f" (repeat {settings.repeat})" if settings.repeat > 1 else "")
    with tqdm(total=total_turns, desc=label, unit="turn") as progress:
        if settings.batch_size > 1:  # turn k of every conversation at once (turn k's prompt holds reply k-1)
            # (batched runs pair with the recorded baseline: a batch is not re-timed turn by turn)
            conversations = {(side.name, q.question_id): [] for side in sides for q in questions}
            for turn in range(1, max(len(q.turns) for q in questions) + 1):
                asked = [q for q in questions if len(q.turns) >= turn]
                for side in sides:
                    items = []
                    for question in asked:
                        messages = conversations[side.name, question.question_id]
                        messages.append({"role": "user", "content": question.turns[turn - 1]})
                        items.append((question, turn, messages))
                    replies = side.answer_batch(items, settings, target, config,
                                                baseline_side if side is method_side else None)
                    for (_, _, messages), reply in zip(items, replies):
                        messages.append({"role": "assistant", "content": reply})
                progress.update(len(asked))
        else:
            for question in questions:
                conversations = {side.name: [] for side in sides}
                for turn, user_text in enumerate(question.turns, start=1):
                    for side in sides:
                        messages = conversations[side.name]
                        messages.append({"role": "user", "content": user_text})
                        pair = None
                        if side is method_side and baseline_side is not None and not baseline_side.ran:
                            # the baseline turn was read back (recorded earlier): time it again now,
                            # on its prompt (its conversation without the reply it just appended)
                            pair = partial(baseline_side.retime, question, turn, conversations[BASELINE][:-1],
                                           settings, target, config)
                        reply = side.answer(question, turn, messages, settings, target, config,
                                            baseline_side if side is method_side else None, pair)
                        messages.append({"role": "assistant", "content": reply})
                    progress.update(1)
    return {side.name: ([t for t in side.records.turns if (t["question_id"], t["turn"]) in keys],
                        str(side.records.path)) for side in sides}


def format_summary(summary: dict, positions: int = 6) -> str:
    """A compact table for the terminal."""
    header = (f"{'method':<10} {'turns':>5} {'tokens':>7} {'tau':>5} {'tok/s':>7} {'TTFT ms':>8} "
              f"{'TPOT ms':>8} {'speedup (95% CI)':>20} {'model':>6} {'match':>6}  accept a_i (conditional)")
    lines = [header, "-" * len(header)]
    spreads = []
    for name, row in summary.items():
        if name.startswith("_"):
            continue
        speed = model = ""
        if "speedup" in row:
            low, high = row["speedup_ci"]
            speed = f"{row['speedup']:.2f}x [{low:.2f},{high:.2f}]"
            model = f"{row['speedup_model']:.2f}x"
            if len(row["speedup_repeats"]) > 1:
                median, least, most = metrics.spread(row["speedup_repeats"])
                spreads.append(f"{name}: speedup per repeat " + ", ".join(f"{v:.2f}x" for v in row["speedup_repeats"])
                               + f" (median {median:.2f}x, min {least:.2f}x, max {most:.2f}x)")
        match = "" if row["match_rate"] != row["match_rate"] else f"{100 * row['match_rate']:.0f}%"
        accept = " ".join(f"{a:.2f}" for a in row["accept_cond"][:positions])
        lines.append(f"{name:<10} {row['turns']:>5} {row['new_tokens']:>7} {row['tau']:>5.2f} "
                     f"{row['tokens_per_s']:>7.1f} {1000 * row['ttft_s']:>8.1f} {1000 * row['tpot_s']:>8.1f} "
                     f"{speed:>20} {model:>6} {match:>6}  {accept}")
    lines += spreads
    for name, path in summary.get("_paths", {}).items():
        lines.append(f"records ({name}): {path}")
    return "\n".join(lines)
