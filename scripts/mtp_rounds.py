"""Where MTP's held-out prediction and its measured τ part: greedy decode rounds simulated from
teacher-forced drafts (bench.core.training.simulated_rounds) on the held-out replies and on the
grid's own turns, beside the rounds the decode loop recorded for those turns.

For a greedy chain drafter the simulation on a recorded turn replays the loop exactly: every
accepted draft is the target's own token, so the drafter's inputs are the teacher-forced ones
(a difference is numerics: the loop's k-token verify passes against one prefill here). What
remains between the held-out numbers and the grid is then the held-out replies themselves
(ShareGPT prompts) against the grid's prompts, and where rounds start.

    python -m scripts.mtp_rounds --tag grid --task mtbench --task humaneval --task gsm8k --task specbench
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from bench.core.training import first_reply_tokens, heldout_prediction, rounds_prediction


def _turn_features(target, prompt: list[int], reply: list[int]) -> tuple[dict, tuple[int, int, int]]:
    """One recorded turn as a features window: rounds may start once the first reply token (the
    prefill's) is known."""
    tap = target.engine.num_layers
    tokens = torch.tensor(prompt + reply)
    hidden = target.engine.prefill(tokens, taps=(tap,), logits_rows="none").hidden[tap].float()
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    mask[len(prompt): len(tokens) - 1] = True  # row r drafts token r+2: from the second reply token on
    return {"tokens": tokens, "loss_mask": mask, f"h{tap}": hidden}, (0, 0, len(tokens))


def _recorded_turns(records: Path) -> dict[tuple[str, int], dict]:
    from bench.records import read_records

    return {(t["question_id"], t["turn"]): t for t in read_records(records)[1]}


def grid_turns(target, task: str, records: Path):
    """Each recorded turn of `records` with the prompt it was asked (the task's question and the
    turn's earlier recorded replies): (record, prompt tokens)."""
    from bench.core.target import chat_prompt
    from bench.records import prompt_hash
    from tasks import load_task

    turns = _recorded_turns(records)
    questions = {q.question_id: q for q in load_task(task, None)}
    for (question_id, turn), record in sorted(turns.items()):
        messages = []
        for t in range(1, turn + 1):
            messages.append({"role": "user", "content": questions[question_id].turns[t - 1]})
            if t < turn:
                messages.append({"role": "assistant", "content": turns[(question_id, t)]["text"]})
        prompt = chat_prompt(target.tokenizer, messages)
        if prompt_hash(prompt) != record["prompt_hash"]:
            raise click.ClickException(f"{records}: turn {question_id}/{turn} has another prompt than the task's")
        yield record, prompt


def recorded_rounds(record: dict) -> tuple[int, int, int]:
    """(rounds, accepted drafts, rounds whose first draft was accepted) as the loop recorded them."""
    accepted = record["accept_lengths"]
    return len(accepted), sum(accepted), sum(a > 0 for a in accepted)


def task_rounds(target, model, settings, task: str, records: Path, depth: int) -> dict:
    from methods.mtp.training import MtpObjective

    simulated, measured, count = [0, 0, 0], [0, 0, 0], 0
    for record, prompt in grid_turns(target, task, records):
        features, window = _turn_features(target, prompt, record["tokens"])
        counts = MtpObjective(target, model, settings, features).round_counts([window], depth)
        simulated = [a + b for a, b in zip(simulated, counts)]
        measured = [a + b for a, b in zip(measured, recorded_rounds(record))]
        count += 1
    return task_result(records, count, simulated, measured)


def task_result(records: Path, turns: int, simulated, measured, **extra) -> dict:
    """One task's replay beside the loop's recorded rounds, echoed: a rounds record's `tasks` entry."""
    found = dict({"records": str(records), "turns": turns}, **extra, simulated=rounds_prediction(*simulated),
                 measured=rounds_prediction(*measured))
    s, m = found["simulated"], found["measured"]
    click.echo(f"{Path(records).parent.name}: simulated tau {s['rounds_tau']:.3f} (a_1 {s['rounds_a1']:.3f}), "
               f"recorded {m['rounds_tau']:.3f} ({m['rounds_a1']:.3f})")
    return found


def write_record(out: str, name: str, result: dict) -> Path:
    """A rounds record (`out`/`name`.json) with the machine and versions it ran on."""
    from bench.core.provenance import provenance, timestamp

    result.update(provenance=provenance("cpu"), created_at=timestamp())
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def latest_records(target_name: str, task: str, method: str, tag: str) -> Path:
    """The newest revision of a method's records of `tag` for a task."""
    from bench.records import record_files, split_revision

    folder = Path("results", target_name, task)
    found = record_files(folder, f"{method}-{tag}") + record_files(folder, f"{method}-{tag}.r*")
    if not found:
        raise click.ClickException(f"no {method} records of tag '{tag}' for {task}")
    return max(found, key=lambda p: split_revision(p.name[len(method) + 1:-len(".jsonl")])[1])


@click.command()
@click.option("--tag", default="grid", show_default=True, help="the grid series whose mtp records are replayed")
@click.option("--task", "tasks", multiple=True, default=("mtbench",), show_default=True)
@click.option("--reply-tokens", default=128, show_default=True,
              help="also the held-out replies cut to their first N tokens, as the grid's turns are")
@click.option("--out", default="results/smollm2-135m/rounds", show_default=True)
def main(tag: str, tasks: tuple[str, ...], reply_tokens: int, out: str) -> None:
    from bench.core.target import load_target, resolve_dtype
    from bench.core.training.features import ensure_features
    from methods.mtp.store import find_folder, load_model
    from methods.mtp.training import MtpObjective, MtpSettings, windows_of

    torch.set_num_threads(1)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the dtype the features were extracted in
    folder = find_folder(target, "sequential", None)
    model, manifest = load_model(target, folder, "sequential")
    model = model.float()
    settings = MtpSettings.parse(dict(manifest["mtp_settings"]))
    depth = settings.eval_steps
    tap = target.engine.num_layers
    store = ensure_features(target, (tap,), settings.feature_data(None), progress=False)
    features = store.load((tap,))
    offsets = features["offsets"].tolist()
    held = [w for w in windows_of(offsets[len(offsets) - settings.holdout - 1:], 512)
            if bool(features["loss_mask"][w[1] + 1: w[2]].any())]
    settings.eval_rows = 10**9  # every held-out row
    heldout = MtpObjective(target, model, settings, features).evaluate(held)
    cut = dict(features, loss_mask=first_reply_tokens(features["loss_mask"], held[0][1], reply_tokens))
    first = MtpObjective(target, model, settings, cut).evaluate(
        [w for w in held if bool(cut["loss_mask"][w[1] + 1: w[2]].any())])
    result = {"what": "MTP: held-out agreement, decode rounds simulated on the held-out replies and on the grid's "
                      "turns, and the rounds the decode loop recorded for those turns (greedy)",
              "drafter": str(folder), "weights_sha1": manifest.get("weights_sha1"), "depth": depth,
              "heldout": dict(heldout, **heldout_prediction(heldout["acc"])),
              f"heldout_first_{reply_tokens}": dict(first, **heldout_prediction(first["acc"])), "tasks": {}}
    for task in tasks:
        records = latest_records(target.name, task, "mtp", tag)
        result["tasks"][task] = task_rounds(target, model, settings, task, records, depth)
    path = write_record(out, f"mtp-{tag}", result)
    for key in ("heldout", f"heldout_first_{reply_tokens}"):
        held_rounds = result[key]
        click.echo(f"{key}: product of agreements tau {held_rounds['predicted_tau']:.3f}; simulated rounds tau "
                   f"{held_rounds['rounds_tau']:.3f} (a_1 {held_rounds['rounds_a1']:.3f})")
    click.echo(f"-> {path}")


if __name__ == "__main__":
    main()
