"""Spec-Bench interoperability: its answer files to and from our run records, and its speedup.

Spec-Bench (github.com/hemingkx/Spec-Bench) writes one JSON line per question into
`data/<bench>/model_answer/<model_id>.jsonl` (evaluation/eval.py):

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index", "turns": [reply text per turn], "decoding_steps": [per turn],
                  "new_tokens": [per turn], "wall_time": [seconds per turn],
                  "accept_lengths": [tokens committed per step, all turns in a row]}]}

(older method scripts write `idxs` for `decoding_steps`). Its evaluation/speed.py reads
choices[0] of a method's file and of the baseline's ("vanilla") file and reports

    speedup = mean over questions of (Σ new_tokens / Σ wall_time), method file
              / the same mean over the baseline file's questions,
    mean accepted tokens = the mean of every accept_lengths entry;

for the baseline it counts each turn's tokens by re-tokenizing the reply text
(len(input_ids) - 1, one BOS off). Ours (bench.metrics) is a ratio of sums over paired turns,
(ΣT_base / ΣN_base) / (ΣT / ΣN): long answers weigh more in ours, every question weighs the
same in theirs, so the two differ when answers differ in length. Reports give both.

How the fields map (a turn record is bench.records' schema):
- wall_time = ttft + decode_time: their timer wraps a turn's prefill and decoding;
- new_tokens = the turn's token count;
- accept_lengths = n_r + 1 per round (the drafts a round accepted plus the target's own
  token), so their mean accepted tokens is our τ; decoding_steps = rounds per turn, which is
  what splits the question's accept_lengths back into turns on import.
An imported turn holds what the file says and nothing invented: token ids, the TTFT / decode
split, draft and verify times, proposal and tree sizes are not in the file and are null
(bench.records.IMPORTED_UNKNOWN); so is a turn's accept_lengths where the file's step counts
do not split them.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import metrics
from bench.core.errors import BenchError
from bench.core.jsonl import parse_jsonl
from bench.records import (
    BASELINE,
    RunFile,
    check_tag,
    has_records,
    pairing_difference,
    records_path,
    split_repeat,
    turn_problem,
)

FORMAT = "specbench"
FORMATS = (FORMAT,)  # the answer-file formats `bench export` / `bench import` know
# speed.py's "mt_bench" subtask: the questions of these categories.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise BenchError(f"unknown answer-file format '{fmt}' (known: {', '.join(FORMATS)})")


# ---------------------------------------------------------------- the speedup, their way


@dataclass
class Speed:
    """What Spec-Bench's evaluation/speed.py prints for one subtask."""
    tokens_per_s: float
    baseline_tokens_per_s: float
    speedup: float
    mean_accepted: float  # mean of the method file's accept_lengths (our τ)
    questions: int
    baseline_questions: int


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _in_subtask(row: dict, task: str) -> bool:
    if task == "overall":
        return True
    if task == "mt_bench":
        return row.get("category") in MT_BENCH_CATEGORIES
    return row.get("category") == task


def specbench_speed(answers: list[dict], baseline: list[dict], task: str = "overall",
                    count_tokens=None) -> Speed:
    """Spec-Bench's convention on two answer files' rows (evaluation/speed.py, reimplemented):
    per question, choice 0, Σ new_tokens / Σ wall_time; the method's mean over its questions
    over the baseline's mean over its own. `task`: "overall", "mt_bench" or a category, as
    speed.py's subtasks. `count_tokens(text)`: how the baseline's turn tokens are counted;
    speed.py re-tokenizes the text (len(tokenizer(text).input_ids) - 1), which needs the
    target's tokenizer; by default the baseline's own new_tokens are used, as for the method.
    A question with no time (speed.py would divide by zero) is left out."""
    ours = [r["choices"][0] for r in answers if _in_subtask(r, task)]
    theirs = [r["choices"][0] for r in baseline if _in_subtask(r, task)]
    rates = [sum(c["new_tokens"]) / sum(c["wall_time"]) for c in ours if sum(c["wall_time"]) > 0]
    if count_tokens is None:
        base_rates = [sum(c["new_tokens"]) / sum(c["wall_time"]) for c in theirs if sum(c["wall_time"]) > 0]
    else:
        base_rates = [sum(count_tokens(text) for text in c["turns"]) / sum(c["wall_time"])
                      for c in theirs if sum(c["wall_time"]) > 0]
    accepted = [a for c in ours for a in c.get("accept_lengths") or []]
    rate, base_rate = _mean(rates), _mean(base_rates)
    return Speed(rate, base_rate, rate / base_rate if base_rate else math.nan, _mean(accepted),
                 len(ours), len(theirs))


def _mean_question_rate(turns: list[dict]) -> float:
    per_question: dict[str, list[float]] = {}  # question -> [tokens, seconds] over its turns
    for turn in turns:
        sums = per_question.setdefault(turn["question_id"], [0, 0.0])
        sums[0] += metrics.new_tokens(turn)
        sums[1] += metrics.total_time(turn)
    return _mean([tokens / seconds for tokens, seconds in per_question.values() if seconds > 0])


def speedup_specbench(method: list[dict], base: list[dict]) -> float:
    """Spec-Bench's speedup on our turn records, for the reports beside ours: the ratio of
    mean per-question tok/s. Over the turns both runs finished, as our speedup, so both means
    cover the same questions; several passes give the mean of the passes' ratios (what
    speed.py's --mean-report gives over runs)."""
    method, base = metrics.paired(method, base)
    ratios = []
    for repeat in sorted({t.get("repeat", 1) for t in method}):
        pairs = [(m, b) for m, b in zip(method, base, strict=True) if m.get("repeat", 1) == repeat]
        ours, theirs = _mean_question_rate([m for m, _ in pairs]), _mean_question_rate([b for _, b in pairs])
        ratios.append(ours / theirs if theirs else math.nan)
    return _mean(ratios)


# ---------------------------------------------------------------- writing files


def _write_whole(files: dict[Path, str]) -> None:
    """Every file whole or none changed: each text goes to a temp file beside its path, and
    only once all are written are they renamed into place."""
    temps: dict[Path, Path] = {}
    where = next(iter(files))
    try:
        for path, text in files.items():
            where = path
            path.parent.mkdir(parents=True, exist_ok=True)
            temps[path] = path.with_name(f".{path.name}.tmp")
            with open(temps[path], "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        for path, tmp in temps.items():
            where = path
            os.replace(tmp, path)
    except OSError as exc:
        raise BenchError(f"cannot write {where}: {exc.strerror or exc}") from None
    finally:
        for tmp in temps.values():
            try:  # what is left to clean up never masks the error above
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


# ---------------------------------------------------------------- export


@dataclass
class Export:
    files: list[Path]
    questions: int
    turns: int
    left_out: int  # turns of either run without their pair, or after a missing turn
    speed: Speed | None  # Spec-Bench's numbers on the written files (None: a baseline run alone)
    problems: list = field(default_factory=list)  # lines the record files left out (bench.records)


def _model_id(run: RunFile) -> str:
    """Spec-Bench names a file after the model and method (`vicuna-7b-v1.3-eagle-float16-temperature-0.0`)."""
    settings = run.settings
    dtype = settings.get("dtype")
    temperature = (settings.get("sampling") or {}).get("temperature")
    return "-".join(str(p) for p in (run.target, run.method, run.tag or None, dtype,
                                     None if temperature is None else f"temperature-{float(temperature)}") if p)


def _epoch(run: RunFile) -> float:
    """The run's start (its first header) as Spec-Bench's tstamp, seconds since the epoch."""
    started = (run.headers[0].get("provenance") or {}).get("started_at") if run.headers else None
    try:
        return float(calendar.timegm(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return time.time()


def _their_id(question_id: str) -> int | str:
    """Spec-Bench's question files number their questions; ours keep ids as strings."""
    return int(question_id) if re.fullmatch(r"0|[1-9]\d*", question_id) else question_id


def _answers(run: RunFile, questions: dict[str, list[dict]]) -> list[dict]:
    model_id, tstamp = _model_id(run), _epoch(run)
    rows = []
    for question_id, turns in questions.items():
        choice = {"index": 0, "turns": [t["text"] for t in turns],
                  "decoding_steps": [len(t["accept_lengths"] or []) for t in turns],
                  "new_tokens": [metrics.new_tokens(t) for t in turns],
                  "wall_time": [metrics.total_time(t) for t in turns],
                  "accept_lengths": [n + 1 for t in turns for n in t["accept_lengths"] or []]}
        if any(t["accept_lengths"] is None for t in turns):  # an imported turn that could not split them
            del choice["decoding_steps"], choice["accept_lengths"]
        digest = hashlib.sha256(f"{model_id}/{question_id}/{run.repeat}".encode()).hexdigest()[:22]
        rows.append({"question_id": _their_id(question_id), "category": turns[0].get("category", ""),
                     "answer_id": digest, "model_id": model_id, "choices": [choice], "tstamp": tstamp})
    return rows


def _questions(turns: list[dict], keep: set[tuple[str, int]]) -> dict[str, list[dict]]:
    """Question -> its turns 1, 2, ... in `keep`, up to the first one missing (Spec-Bench's
    `turns` are positional), in the order the run asked them."""
    by_question: dict[str, dict[int, dict]] = {}
    for turn in turns:
        if (turn["question_id"], turn["turn"]) in keep:
            by_question.setdefault(turn["question_id"], {})[turn["turn"]] = turn
    questions = {}
    for question_id, numbered in by_question.items():
        run = []
        while len(run) + 1 in numbered:
            run.append(numbered[len(run) + 1])
        if run:
            questions[question_id] = run
    return questions


def _read_run(path: Path) -> RunFile:
    run = RunFile(path)
    if any(p.kind == "unreadable" for p in run.problems):
        raise BenchError(f"cannot read records {path}: {run.problems[0].detail}")
    if not run.turns:
        raise BenchError(f"{path} holds no finished turn: nothing to export")
    return run


def export_run(path: Path, out: Path, baseline_out: Path | None = None, force: bool = False) -> Export:
    """Write a run's answers (and, for a method, its AR baseline's beside: `baseline_out`,
    default `<out stem>-baseline.jsonl`) as Spec-Bench answer files. Only the turns both runs
    finished are written, so speed.py on the pair averages over the same questions as our
    speedup."""
    run = _read_run(Path(path))
    out = Path(out)
    if run.method == BASELINE:
        questions = _questions(run.turns, run.keys)
        files, base = {out: _jsonl(_answers(run, questions))}, None
    else:
        base_file = run.path.with_name(f"{BASELINE}-{run.tag}.jsonl" if run.tag else f"{BASELINE}.jsonl")
        if not has_records(base_file):
            raise BenchError(f"no baseline {base_file.name} beside {run.path}: Spec-Bench's speedup needs the "
                             "baseline's answers")
        base = _read_run(base_file)
        why = pairing_difference(run.settings, base.settings)
        if why and "imported_from" not in run.settings:
            raise BenchError(f"{run.path} was recorded with {why}: Spec-Bench's speedup over it would compare "
                             "other settings")
        questions = _questions(run.turns, run.keys & base.keys)
        base_questions = {q: [base.done(q, t["turn"]) for t in turns] for q, turns in questions.items()}
        baseline_out = Path(baseline_out) if baseline_out else out.with_name(f"{out.stem}-baseline{out.suffix}")
        if baseline_out.resolve() == out.resolve():
            raise BenchError(f"the baseline's answers would overwrite the method's: give another --baseline-out "
                             f"than {out}")
        files = {out: _jsonl(_answers(run, questions)), baseline_out: _jsonl(_answers(base, base_questions))}
    written = sum(len(turns) for turns in questions.values())
    if not written:
        raise BenchError(f"{run.path}: no turn that its baseline also finished: nothing to export")
    existing = [str(p) for p in files if p.exists()]
    if existing and not force:
        raise BenchError(f"{', '.join(existing)} exists: give --force to replace it")
    _write_whole(files)
    speed = None
    if base is not None:  # what speed.py makes of the files just written
        rows = [read_answers(p) for p in files]
        speed = specbench_speed(rows[0].rows, rows[1].rows)
    left_out = len(run.turns) - written + (len(base.turns) - written if base is not None else 0)
    return Export(list(files), len(questions), written, left_out, speed,
                  run.problems + (base.problems if base is not None else []))


# ---------------------------------------------------------------- reading their files


@dataclass
class Answers:
    rows: list[dict]
    sha256: str
    model_id: str | None


def _ints(value: object, least: int) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= least
                                           for v in value)


def _seconds(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           and math.isfinite(v) and v >= 0 for v in value)


MAX_TURN_TOKENS = 1_000_000  # beyond any model's context: a count past it is a damaged file


def _answer_problem(row: dict) -> str | None:
    """Why `row` is not a Spec-Bench answer that speed.py could read, or None."""
    qid = row.get("question_id")
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or qid == "":
        return "no question_id (an integer or a string)"
    if "category" in row and not isinstance(row["category"], str):
        return "category is not a string"
    choices = row.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no choices (a list of objects)"
    choice = choices[0]
    turns = choice.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return "choices[0].turns is not a non-empty list of strings"
    for key, ok, what in (("new_tokens", lambda v: _ints(v, 0), "integers >= 0"),
                          ("wall_time", _seconds, "seconds (finite numbers >= 0)")):
        if key not in choice:
            return f"choices[0] has no {key}"
        if not ok(choice[key]) or len(choice[key]) != len(turns):
            return f"choices[0].{key} is not {len(turns)} {what}, one per turn"
    for tokens, seconds in zip(choice["new_tokens"], choice["wall_time"]):
        if tokens > MAX_TURN_TOKENS:
            return f"choices[0].new_tokens holds {tokens}, more than any turn decodes ({MAX_TURN_TOKENS})"
        if tokens and not seconds > 0:
            return f"choices[0].wall_time is {seconds} for a turn of {tokens} tokens (a time must be > 0)"
    if "accept_lengths" in choice and not _ints(choice["accept_lengths"], 1):
        return "choices[0].accept_lengths is not a list of integers >= 1 (tokens per step)"
    for key in ("decoding_steps", "idxs"):
        if key in choice and (not _ints(choice[key], 0) or len(choice[key]) != len(turns)):
            return f"choices[0].{key} is not {len(turns)} integers >= 0, one per turn"
    return None


def read_answers(path: Path) -> Answers:
    """A Spec-Bench answer file, checked whole: any line that is not a JSON object, lacks a
    field speed.py reads, or repeats a question is one error naming the line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror or exc}") from None
    lines = parse_jsonl(raw)
    if lines.skipped:
        number, why = lines.skipped[0]
        more = f" (and {len(lines.skipped) - 1} more lines)" if len(lines.skipped) > 1 else ""
        raise BenchError(f"{path}:{number}: {why}{more}; not a Spec-Bench answer file")
    seen: dict[str, int] = {}
    for number, row in lines.rows:
        why = _answer_problem(row)
        if why:
            raise BenchError(f"{path}:{number}: {why}; not a Spec-Bench answer file")
        qid = str(row["question_id"])
        if qid in seen:
            raise BenchError(f"{path}:{number}: question {qid} again (first on line {seen[qid]})")
        seen[qid] = number
    if not lines.rows:
        raise BenchError(f"{path}: no answers in it")
    models = sorted({row["model_id"] for _, row in lines.rows if isinstance(row.get("model_id"), str)})
    if len(models) > 1:
        raise BenchError(f"{path} holds answers of several models ({', '.join(models)}); import one model's file")
    return Answers([row for _, row in lines.rows], hashlib.sha256(raw).hexdigest(), models[0] if models else None)


# ---------------------------------------------------------------- import


@dataclass
class Import:
    path: Path
    questions: int
    turns: int
    unsplit: int  # questions whose accept_lengths could not be split into turns (null there)
    extra_choices: int  # questions with more than one choice: choice 0 is taken, as speed.py does


def _split_steps(choice: dict) -> list[list[int] | None]:
    """The question's accept_lengths per turn: whole for one turn; split by the per-turn step
    counts where those add up to exactly the steps listed; otherwise unknown (None)."""
    accepted, turns = choice.get("accept_lengths"), len(choice["turns"])
    if accepted is None:
        return [None] * turns
    if turns == 1:
        return [accepted]
    steps = choice.get("decoding_steps", choice.get("idxs"))
    if steps is None or sum(steps) != len(accepted):
        return [None] * turns
    bounds = [sum(steps[:i]) for i in range(turns + 1)]
    return [accepted[bounds[i]:bounds[i + 1]] for i in range(turns)]


def _turns(row: dict) -> list[dict]:
    choice = row["choices"][0]
    records = []
    for number, (text, steps) in enumerate(zip(choice["turns"], _split_steps(choice), strict=True), start=1):
        record = {"type": "turn", "question_id": str(row["question_id"]), "turn": number,
                  "imported_from": FORMAT, "prompt_hash": None, "tokens": None,
                  "new_tokens": choice["new_tokens"][number - 1], "text": text,
                  "ttft": None, "decode_time": None, "wall_time": choice["wall_time"][number - 1],
                  "draft_time": None, "verify_time": None, "proposed_lengths": None,
                  "accept_lengths": None if steps is None else [a - 1 for a in steps], "tree_sizes": None}
        if "category" in row:
            record["category"] = row["category"]
        if steps is not None:
            record["rounds"] = len(steps)
        records.append(record)
    return records


def _check_name(kind: str, name: str) -> None:
    if not name or name.startswith(".") or any(c in name for c in "/\\\0") or name != name.strip():
        raise BenchError(f"{kind} '{name}' cannot be part of a file path (no '/', no leading '.', not empty)")


def import_answers(source: Path, results_dir: Path, target: str, task: str, method: str,
                   tag: str | None = None) -> Import:
    """Read a Spec-Bench answer file into a new record file results/<target>/<task>/<method>[-<tag>].jsonl
    (whole or not at all; an existing file is never touched). Its header says where the
    records came from (`imported_from`, the source's sha256); import the baseline's
    ("vanilla") file as method `ar` under the same tag for the reports' speedups."""
    for kind, name in (("target", target), ("task", task), ("method", method)):
        _check_name(kind, name)
    if tag is not None:  # `<series>.rep<k>` is allowed here: Spec-Bench's run_<k> folders are repeats
        series, repeat = split_repeat(tag)
        check_tag(series if series or repeat == 1 else None)
    answers = read_answers(Path(source))
    dest = records_path(Path(results_dir), target, task, method, tag)
    if has_records(dest):
        raise BenchError(f"{dest} already exists; import under another --tag (records are never overwritten)")
    turns = [turn for row in answers.rows for turn in _turns(row)]
    unsplit = sum(1 for row in answers.rows if "accept_lengths" in row["choices"][0]
                  and _split_steps(row["choices"][0])[0] is None)
    for turn in turns:  # every turn must read back: a failure here is a bug, not the file
        why = turn_problem(turn)
        if why:
            raise BenchError(f"internal: an imported turn fails the record schema ({why})")
    settings = {"method": method, "task": task, "target": target, "imported_from": FORMAT,
                "model_id": answers.model_id}
    header = {"type": "header", "settings": settings, "imported_from": FORMAT, "source": str(source),
              "source_sha256": answers.sha256,
              "provenance": {"imported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    _write_whole({dest: _jsonl([header, *turns])})
    return Import(dest, len(answers.rows), len(turns), unsplit, sum(len(r["choices"]) > 1 for r in answers.rows))
