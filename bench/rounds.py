"""`bench rounds --method M`: where a drafter's held-out prediction and its measured τ part.

Greedy decode rounds are replayed from teacher-forced passes (bench.training.simulated_rounds)
by the method's replay hook (registry: MethodInfo.replay), on the grid's own recorded turns beside
the rounds the decode loop recorded for them, and on the drafter's held-out conversations (whole
replies, and cut to their first tokens as the grid's turns are). On a recorded turn the replay
should give the loop's rounds (up to numerics); what separates the held-out prediction from the
grid is then where rounds start, a reply's opening and the grid's questions.

A hook is a class built as `Replay(target)` from the shipped drafter, with
  what: str                     one line for the record
  info: dict                    which drafter it replays
  heldout(conversations, reply_tokens) -> dict
and, where the method's rounds replay on recorded turns,
  check(settings) -> str | None why a record file ran another drafter (None: the same one)
  turn(settings, prompt, record) -> (rounds, accepted drafts, rounds whose first draft was accepted)
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

from bench.core.errors import BenchError
from bench.training import rounds_prediction


def recorded_rounds(record: dict) -> tuple[int, int, int]:
    """(rounds, accepted drafts, rounds whose first draft was accepted) as the loop recorded them."""
    accepted = record["accept_lengths"]
    return len(accepted), sum(accepted), sum(a > 0 for a in accepted)


def grid_turns(target, task: str, records: Path) -> Iterator[tuple[dict, list[int]]]:
    """Each recorded turn of `records` with the prompt it was asked (the task's question and the
    turn's earlier recorded replies): (record, prompt tokens)."""
    from bench.core.target import chat_prompt
    from bench.records import prompt_hash, read_records
    from tasks import load_task

    turns = {(t["question_id"], t["turn"]): t for t in read_records(records)[1]}
    questions = {q.question_id: q for q in load_task(task, None)}
    for (question_id, turn), record in sorted(turns.items()):
        messages = []
        for t in range(1, turn + 1):
            messages.append({"role": "user", "content": questions[question_id].turns[t - 1]})
            if t < turn:
                messages.append({"role": "assistant", "content": turns[(question_id, t)]["text"]})
        prompt = chat_prompt(target.tokenizer, messages)
        if prompt_hash(prompt) != record["prompt_hash"]:
            raise BenchError(f"{records}: turn {question_id}/{turn} has another prompt than the task's")
        yield record, prompt


def latest_records(results_dir: Path, target_name: str, task: str, method: str, tag: str) -> Path:
    """The newest revision of a method's records of `tag` for a task."""
    from bench.records import record_files, split_revision

    folder = Path(results_dir) / target_name / task
    found = record_files(folder, f"{method}-{tag}") + record_files(folder, f"{method}-{tag}.r*")
    if not found:
        raise BenchError(f"no {method} records of tag '{tag}' for {task} under {results_dir}")
    return max(found, key=lambda p: split_revision(p.name[len(method) + 1:].split(".jsonl")[0])[1])


def task_result(records: Path, turns: int, simulated, measured) -> dict:
    """One task's replay beside the loop's recorded rounds: a rounds record's `tasks` entry."""
    return {"records": str(records), "turns": turns, "simulated": rounds_prediction(*simulated),
            "measured": rounds_prediction(*measured)}


def write_record(out: Path, name: str, result: dict) -> Path:
    """A rounds record (`out`/`name`.json) with the machine and versions it ran on."""
    from bench.core.provenance import provenance, timestamp

    result.update(provenance=provenance("cpu"), created_at=timestamp())
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def replay_hook(method: str):
    from bench.registry import get_method

    info = get_method(method)
    if not info.replay:
        raise BenchError(f"{method} has no round replay (methods with one: {', '.join(replayable())})")
    module, _, name = info.replay.partition(":")
    return getattr(importlib.import_module(module), name)


def replayable() -> list[str]:
    from bench.registry import METHODS

    return [m.name for m in METHODS.values() if m.replay]


def replay_rounds(method: str, tag: str, tasks: tuple[str, ...], conversations: int, reply_tokens: int,
                  results_dir: Path, echo=print) -> dict:
    """The replay of `method`'s shipped drafter on `tasks`' records of `tag` and on its held-out
    conversations: what `bench rounds` records."""
    import torch

    from bench.core.target import load_target, resolve_dtype
    from bench.records import RunFile

    replay_class = replay_hook(method)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the grid's dtype, the features' too
    replay = replay_class(target)
    result = {"method": method, "what": replay.what, "drafter": replay.info, "tag": tag, "tasks": {}}
    if tasks and not hasattr(replay, "turn"):
        raise BenchError(f"{method}'s replay covers its held-out conversations only (its grid drafts trees): "
                         "leave out --task")
    with torch.no_grad():
        for task in tasks:
            records = latest_records(results_dir, target.name, task, method, tag)
            settings = RunFile(records).settings
            why = replay.check(settings)
            if why:
                raise BenchError(f"{records} ran another drafter than the shipped one: {why}")
            simulated, measured, turns = [0, 0, 0], [0, 0, 0], 0
            for record, prompt in grid_turns(target, task, records):
                simulated = [a + b for a, b in zip(simulated, replay.turn(settings, prompt, record))]
                measured = [a + b for a, b in zip(measured, recorded_rounds(record))]
                turns += 1
            found = result["tasks"][task] = task_result(records, turns, simulated, measured)
            s, m = found["simulated"], found["measured"]
            echo(f"{task}: replayed tau {s['rounds_tau']:.3f} (a_1 {s['rounds_a1']:.3f}), "
                 f"recorded {m['rounds_tau']:.3f} ({m['rounds_a1']:.3f}) over {turns} turns")
        result["heldout"] = replay.heldout(conversations, reply_tokens) if conversations else {}
    for cut, found in (("whole replies", result["heldout"]),
                       (f"first {reply_tokens} tokens", result["heldout"].get(f"first_{reply_tokens}", {}))):
        if "rounds_tau" in found:
            echo(f"held out, {cut}: replayed tau {found['rounds_tau']:.3f} (a_1 {found['rounds_a1']:.3f})")
    return result
