"""Where the SpS draft's held-out agreement and its grid τ part (as scripts/mtp_rounds does for MTP).

SpS drafts a greedy chain of `gamma` tokens with its own small LM. In a greedy round every
accepted draft is the target's token, so the draft reads the teacher-forced prefix: a round
whose last known token is t+1 drafts token t+2+k from the draft's logits at row t+1+k, and the
rounds of a turn replay from one teacher-forced pass of the draft
(bench.core.training.simulated_rounds). On the grid's own turns the replay must give the τ the
loop recorded; on the draft's held-out conversations (whole replies, and their first 128 tokens
as the grid's turns are) it says how much of the gap to the held-out prediction is where rounds
start and how much is a reply's opening.

    python -m scripts.sps_rounds --tag grid --task mtbench --task humaneval --task gsm8k --task specbench
"""

from __future__ import annotations

import click
import torch
from torch import Tensor

from bench.core.training import first_reply_tokens, next_token_rounds, rounds_prediction
from bench.records import RunFile
from scripts.mtp_rounds import grid_turns, latest_records, recorded_rounds, task_result, write_record


def draft_right(draft_argmax: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    """right[r]: the draft's top-1 after token r is token r+1, a reply token (mask[r] whether
    token r+1 is a reply token)."""
    right = torch.zeros(len(tokens), dtype=torch.bool)
    right[:-1] = (draft_argmax[:-1] == tokens[1:]) & mask[:-1]
    return right


def sequence_rounds(draft, tokens: Tensor, mask: Tensor, gamma: int,
                    starts: Tensor | None = None) -> tuple[tuple[int, int, int], int, int]:
    """(rounds, accepted, first accepted) over one sequence (bench.core.training.next_token_rounds),
    the rows whose next token is a reply token, and at how many the draft's top-1 is right."""
    right = draft_right(draft.prefill(tokens, logits_rows="all").logits.argmax(-1), tokens, mask)
    counts = next_token_rounds(right.tolist(), mask.tolist(), gamma, None if starts is None else starts.tolist())
    return counts, int(mask.sum()), int(right.sum())


def turn_rows(prompt_len: int, length: int, stop_reason: str | None) -> tuple[Tensor, Tensor]:
    """(mask, starts) of a recorded turn. The prefill gives the first reply token; the loop
    drafts at most up to the token before max_new_tokens (the last is always a round's bonus),
    so a turn cut by its length neither drafts its last token nor starts a round after it. A
    turn that ended at EOS may have accepted drafts past its EOS, which its record cuts off:
    there the replay can undercount the last round."""
    end = length - 1 if stop_reason == "length" else length
    mask, starts = torch.zeros(length, dtype=torch.bool), torch.zeros(length, dtype=torch.bool)
    mask[prompt_len - 1: end - 1] = True
    starts[prompt_len - 1: length - 2] = True
    return mask, starts


def _add(total: list[int], counts: tuple[int, int, int]) -> list[int]:
    return [a + b for a, b in zip(total, counts)]


def heldout_rounds(draft, data: dict, conversations: int, gamma: int, keep: int | None) -> dict:
    """Rounds over the draft's held-out conversations (the first `conversations` of the cache),
    each reply cut to its first `keep` tokens where given."""
    offsets = data["offsets"].tolist()[: conversations + 1]
    mask = data["loss_mask"][: offsets[-1]].bool()
    if keep is not None:
        mask = first_reply_tokens(mask, 0, keep)
    total, rows, right = [0, 0, 0], 0, 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        counts, n, r = sequence_rounds(draft, data["tokens"][a:b].long(), mask[a:b], gamma)
        total, rows, right = _add(total, counts), rows + n, right + r
    return dict(rounds_prediction(*total), rows=rows, top1_position0=round(right / max(1, rows), 4))


@click.command()
@click.option("--tag", default="grid", show_default=True, help="the grid series whose sps records are replayed")
@click.option("--task", "tasks", multiple=True, default=("mtbench",), show_default=True)
@click.option("--reply-tokens", default=128, show_default=True)
@click.option("--out", default="results/smollm2-135m/rounds", show_default=True)
def main(tag: str, tasks: tuple[str, ...], reply_tokens: int, out: str) -> None:
    from bench.core.drafters import find_drafter, read_manifest
    from bench.core.target import load_target, parse_dtype, resolve_dtype
    from bench.core.training.draft_lm import DraftLMSettings
    from bench.core.training.features import FeatureData, ensure_features
    from methods.sps import load_draft_engine

    torch.set_num_threads(1)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the grid's dtype
    folder = find_drafter(target.name, "sps", None)
    manifest = read_manifest(folder)
    result = {"what": "SpS: greedy rounds of the draft's gamma-token chain simulated from teacher-forced drafts on "
                      "the draft's held-out conversations and on the grid's turns, and the rounds the loop recorded",
              "drafter": str(folder), "heldout_recorded": manifest.get("heldout"), "tasks": {}}
    with torch.no_grad():
        for task in tasks:
            records = latest_records(target.name, task, "sps", tag)
            header = RunFile(records).settings["drafter"]
            gamma = header["gamma"]
            draft, info = load_draft_engine(target, folder, parse_dtype(header["draft_dtype"]))
            if info["weights_sha1"] != header["weights_sha1"]:
                raise click.ClickException(f"{records} ran another SpS draft ({header['weights_sha1']})")
            simulated, measured, turns = [0, 0, 0], [0, 0, 0], 0
            for record, prompt in grid_turns(target, task, records):
                tokens = torch.tensor(prompt + record["tokens"])
                mask, starts = turn_rows(len(prompt), len(tokens), record.get("stop_reason"))
                counts, _, _ = sequence_rounds(draft, tokens, mask, gamma, starts)
                simulated, measured = _add(simulated, counts), _add(measured, recorded_rounds(record))
                turns += 1
            result["tasks"][task] = task_result(records, turns, simulated, measured, gamma=gamma)
        settings = DraftLMSettings(**manifest.get("draft_settings", {}))
        tap = target.engine.num_layers
        store = ensure_features(target, (tap,), FeatureData(max_tokens=settings.feature_tokens or 5_000_000,
                                                            self_distill=True), progress=False)
        data = store.load((tap,))
        for key, keep in (("heldout", None), (f"heldout_first_{reply_tokens}", reply_tokens)):
            result[key] = heldout_rounds(draft, data, settings.heldout, gamma, keep)
            click.echo(f"{key}: position-0 top-1 {result[key]['top1_position0']:.3f}; "
                       f"simulated rounds tau {result[key]['rounds_tau']:.3f} (a_1 {result[key]['rounds_a1']:.3f})")
    result.update(features=str(store.folder))
    click.echo(f"-> {write_record(out, f'sps-{tag}', result)}")


if __name__ == "__main__":
    main()
