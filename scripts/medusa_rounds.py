"""Where Medusa's held-out agreement and its grid τ part (as scripts/mtp_rounds does for MTP).

Where the grid's Medusa tree is one node (the auto-sized tree of weak heads), head 0's top-1, it
is a chain one deep, so its greedy rounds replay exactly from teacher-forced drafts; a task whose
turns drafted deeper trees is named and not replayed, and the held-out numbers still come. Head 0 at row t reads
the target's final state h_t and drafts token t+2; a round starting at row t (token t+1, its
bonus, known) accepts that draft when it is the target's token, and the next round starts two
rows on, else one (bench.core.training.simulated_rounds). Replayed on the grid's own turns this
must give the τ the loop recorded; on held-out replies (whole, and cut to their first 128
tokens as the grid's turns are) it says how much of the gap is where rounds start and how much
is a reply's opening.

    python -m scripts.medusa_rounds --tag grid --task mtbench --task humaneval --task gsm8k --task specbench
"""

from __future__ import annotations

import click
import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.training import first_reply_tokens, rounds_prediction, simulated_rounds
from scripts.mtp_rounds import grid_turns, latest_records, recorded_rounds, task_result, write_record


def head_zero_hits(heads, lm_head: Tensor, hidden: Tensor, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row t: head 0 drafted token t+2 right while it is still a reply token, and whether
    row t is such a pair at all (hidden [n, d] the target's final states, mask[t] whether token
    t+1 is a reply token)."""
    n = len(tokens)
    drafts = F.linear(heads.blocks[0](hidden[: n - 2].float()), lm_head).argmax(-1)
    pairs = torch.zeros(n, dtype=torch.bool)
    pairs[: n - 2] = mask[: n - 2] & mask[1: n - 1]
    hit = torch.zeros(n, dtype=torch.bool)
    hit[: n - 2] = (drafts == tokens[2:]) & mask[1: n - 1]
    return hit, pairs


def sequence_rounds(heads, lm_head: Tensor, hidden: Tensor, tokens: Tensor, mask: Tensor) -> tuple[int, int, int]:
    """Rounds of a one-node Medusa tree over one sequence (rows where mask holds may start one)."""
    hit, _ = head_zero_hits(heads, lm_head, hidden, tokens, mask)
    return simulated_rounds([hit.tolist()], mask.tolist())


def _add(total: list[int], counts: tuple[int, int, int]) -> list[int]:
    return [a + b for a, b in zip(total, counts)]


def heldout_rounds(heads, lm_head: Tensor, features: dict, conversations: int, keep: int | None) -> dict:
    """Rounds on the pool's last `conversations` (none of which a drafter trained on a smaller
    prefix of the pool saw), each reply cut to its first `keep` tokens where given."""
    offsets = features["offsets"].tolist()
    mask = features["loss_mask"].bool()
    start = offsets[len(offsets) - 1 - conversations]
    if keep is not None:
        mask = first_reply_tokens(mask, start, keep)
    total, rows, hits = [0, 0, 0], 0, 0
    with torch.no_grad():
        for a, b in zip(offsets[-1 - conversations: -1], offsets[-conversations:]):
            tokens, window = features["tokens"][a:b].long(), mask[a:b]
            hit, pairs = head_zero_hits(heads, lm_head, features["h"][a:b], tokens, window)
            total = _add(total, simulated_rounds([hit.tolist()], window.tolist()))
            rows, hits = rows + int(pairs.sum()), hits + int((hit & pairs).sum())
    return dict(rounds_prediction(*total), rows=rows, head0_top1=round(hits / max(1, rows), 4),
                predicted_tau=round(1 + hits / max(1, rows), 4))


@click.command()
@click.option("--tag", default="grid", show_default=True, help="the grid series whose medusa records are replayed")
@click.option("--task", "tasks", multiple=True, default=("mtbench",), show_default=True)
@click.option("--heldout", default=200, show_default=True, help="the pool's last N conversations")
@click.option("--reply-tokens", default=128, show_default=True)
@click.option("--out", default="results/smollm2-135m/rounds", show_default=True)
@click.option("--name", default=None, help="the record's name (default medusa-<tag>)")
def main(tag: str, tasks: tuple[str, ...], heldout: int, reply_tokens: int, out: str, name: str | None) -> None:
    from bench.core.drafters import find_drafter, weights_sha1
    from bench.core.target import load_target, resolve_dtype
    from bench.core.training.features import FeatureData, ensure_features
    from methods.medusa.model import load_drafter

    torch.set_num_threads(1)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the grid's dtype, the features' too
    folder = find_drafter(target.name, "medusa", None)
    heads, _, _, info = load_drafter(target, folder)
    heads.eval()
    lm_head = target.engine.lm_head.float()
    tap = target.engine.num_layers
    result = {"what": "Medusa (one-node tree: head 0's top-1): greedy rounds simulated from teacher-forced drafts on "
                      "held-out replies and on the grid's turns, and the rounds the loop recorded for those turns",
              "drafter": str(folder), "weights_sha1": weights_sha1(folder), "trained_steps": info.get("trained_steps"),
              "tasks": {}}
    with torch.no_grad():
        for task in tasks:
            records = latest_records(target.name, task, "medusa", tag)
            turns_of = list(grid_turns(target, task, records))
            deeper = sum(max(record.get("proposed_lengths") or [0]) > 1 for record, _ in turns_of)
            if deeper:  # the held-out numbers below still hold
                result["tasks"][task] = {"records": str(records), "replayed": False,
                                         "why": f"{deeper} turns drafted trees of more than one node; the "
                                                "replay is exact for a one-node tree only"}
                click.echo(f"{task}: not replayed ({result['tasks'][task]['why']})")
                continue
            simulated, measured, turns = [0, 0, 0], [0, 0, 0], 0
            for record, prompt in turns_of:
                tokens = torch.tensor(prompt + record["tokens"])
                hidden = target.engine.prefill(tokens, taps=(tap,), logits_rows="none").hidden[tap]
                mask = torch.zeros(len(tokens), dtype=torch.bool)
                mask[len(prompt) - 1: len(tokens) - 1] = True  # the prefill's row drafts the second reply token
                simulated = _add(simulated, sequence_rounds(heads, lm_head, hidden, tokens, mask))
                measured = _add(measured, recorded_rounds(record))
                turns += 1
            result["tasks"][task] = task_result(records, turns, simulated, measured)
        store = ensure_features(target, (tap,), FeatureData(max_tokens=5_000_000, self_distill=True), progress=False)
        data = store.load((tap,))
        features = {"tokens": data["tokens"], "loss_mask": data["loss_mask"], "offsets": data["offsets"],
                    "h": data[f"h{tap}"]}
        for key, keep in (("heldout", None), (f"heldout_first_{reply_tokens}", reply_tokens)):
            result[key] = heldout_rounds(heads, lm_head, features, heldout, keep)
            click.echo(f"{key}: head 0 top-1 {result[key]['head0_top1']:.3f} (tau {result[key]['predicted_tau']:.3f}); "
                       f"simulated rounds tau {result[key]['rounds_tau']:.3f} (a_1 {result[key]['rounds_a1']:.3f})")
    result.update(heldout_conversations=heldout, features=str(store.folder))
    click.echo(f"-> {write_record(out, name or f'medusa-{tag}', result)}")


if __name__ == "__main__":
    main()
