"""Where Medusa's held-out agreement and its grid τ part (as scripts/mtp_rounds does for MTP).

Greedy Medusa rounds replay exactly from one teacher-forced pass of the target
(methods/medusa/rounds.py): a round accepts the longest tree path of the data tokens' ranks.
Replayed on the grid's own turns, with the tree each record names (its size cut from the
drafter's measured accuracies, as the decoder builds it), this must give the τ the loop
recorded; on held-out replies (whole, and cut to their first 128 tokens as the grid's turns
are) it says how much of the gap is where rounds start and how much is a reply's opening.

    python -m scripts.medusa_rounds --tag grid --task mtbench --task humaneval --task gsm8k --task specbench
"""

from __future__ import annotations

import click
import torch

from bench.core.training import GRID_REPLY_TOKENS
from scripts.mtp_rounds import grid_turns, latest_records, recorded_rounds, task_result, write_record


def recorded_tree(header: dict, accuracy, stored_tree) -> list[tuple[int, ...]]:
    """The tree a record's decoder built: sized for its device or given by a count (the
    best-first cut of the measured accuracies), or the drafter's stored tree."""
    from methods.medusa.tree import build_tree

    size, source = header["tree_size"], header.get("tree_source", "")
    if source == "manifest":
        return [tuple(p) for p in stored_tree]
    if not accuracy:
        raise click.ClickException(f"the drafter has no measured accuracies to rebuild a '{source}' tree from")
    return build_tree(accuracy, max(64, size))[:size]


@click.command()
@click.option("--tag", default="grid", show_default=True, help="the grid series whose medusa records are replayed")
@click.option("--task", "tasks", multiple=True, default=("mtbench",), show_default=True)
@click.option("--heldout", default=200, show_default=True, help="the pool's last N conversations")
@click.option("--reply-tokens", default=GRID_REPLY_TOKENS, show_default=True)
@click.option("--out", default="results/smollm2-135m/rounds", show_default=True)
@click.option("--name", default=None, help="the record's name (default medusa-<tag>)")
def main(tag: str, tasks: tuple[str, ...], heldout: int, reply_tokens: int, out: str, name: str | None) -> None:
    from bench.core.drafters import find_drafter, weights_sha1
    from bench.core.target import load_target, resolve_dtype
    from bench.core.training.features import FeatureData, ensure_features
    from bench.records import RunFile
    from methods.medusa.model import load_drafter
    from methods.medusa.rounds import heldout_rounds, sequence_rounds

    torch.set_num_threads(1)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the grid's dtype, the features' too
    folder = find_drafter(target.name, "medusa", None)
    heads, accuracy, stored_tree, info = load_drafter(target, folder)
    heads.eval()
    lm_head = target.engine.lm_head.float()
    tap = target.engine.num_layers
    result = {"what": "Medusa: greedy rounds of the decoder's tree simulated from teacher-forced drafts on held-out "
                      "replies and on the grid's turns, and the rounds the loop recorded for those turns",
              "drafter": str(folder), "weights_sha1": weights_sha1(folder), "trained_steps": info.get("trained_steps"),
              "tasks": {}}
    with torch.no_grad():
        for task in tasks:
            records = latest_records(target.name, task, "medusa", tag)
            paths = recorded_tree(RunFile(records).settings["drafter"], accuracy, stored_tree)
            simulated, measured, turns = [0, 0, 0], [0, 0, 0], 0
            for record, prompt in grid_turns(target, task, records):
                tokens = torch.tensor(prompt + record["tokens"])
                hidden = target.engine.prefill(tokens, taps=(tap,), logits_rows="none").hidden[tap]
                mask = torch.zeros(len(tokens), dtype=torch.bool)
                mask[len(prompt) - 1: len(tokens) - 1] = True  # the prefill's row drafts the second reply token
                counts = sequence_rounds(heads, lm_head, hidden, tokens, mask, paths)
                simulated = [a + b for a, b in zip(simulated, counts)]
                measured = [a + b for a, b in zip(measured, recorded_rounds(record))]
                turns += 1
            result["tasks"][task] = task_result(records, turns, simulated, measured, tree_size=len(paths))
        store = ensure_features(target, (tap,), FeatureData(max_tokens=5_000_000, self_distill=True), progress=False)
        data = store.load((tap,))
        features = {"tokens": data["tokens"], "loss_mask": data["loss_mask"], "h": data[f"h{tap}"]}
        offsets = data["offsets"].tolist()[-1 - heldout:]
        spans = list(zip(offsets[:-1], offsets[1:]))
        trees = {"one_node": [(0,)], "grid": paths} if len(paths) > 1 else {"one_node": [(0,)]}
        for tree, tree_paths in trees.items():
            found = heldout_rounds(heads, lm_head, features, spans, tree_paths, keep=reply_tokens)
            result[f"heldout_{tree}"] = found
            for label, part in (("whole", found), (f"first {reply_tokens}", found[f"first_{reply_tokens}"])):
                click.echo(f"held out, {tree} tree, {label}: head 0 top-1 {part['head0_top1']:.3f}; "
                           f"simulated rounds tau {part['rounds_tau']:.3f} (a_1 {part['rounds_a1']:.3f})")
    result.update(heldout_conversations=heldout, features=str(store.folder))
    click.echo(f"-> {write_record(out, name or f'medusa-{tag}', result)}")


if __name__ == "__main__":
    main()
