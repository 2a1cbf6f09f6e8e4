"""Where DFlash's held-out prediction and its measured τ part: greedy rounds of the block
drafter's chain replayed from one target pass per sequence (methods/dflash/rounds.py), on the
drafter's held-out conversations (the feature cache's last ones, which it never trained on) and
on the grid's own turns, beside the rounds the decode loop recorded for those turns.

Replaying a recorded turn should give the loop's rounds (up to numerics: the loop's features
come from k-token verify passes, here from one prefill). What separates the held-out prediction
(the product of per-slot agreements) from the grid is then where rounds start, a reply's opening
and the grid's questions, as for MTP, Medusa and SpS (their records are retired from the tree:
results/ARCHIVE.md).

    python -m scripts.block_rounds --tag grid-amx --task mtbench --task humaneval --task gsm8k --task specbench
"""

from __future__ import annotations

import click
import torch

from scripts.mtp_rounds import grid_turns, latest_records, recorded_rounds, task_result, write_record


@click.command()
@click.option("--tag", default="grid", show_default=True, help="the grid series whose dflash records are replayed")
@click.option("--task", "tasks", multiple=True, default=("mtbench",), show_default=True)
@click.option("--reply-tokens", default=128, show_default=True,
              help="also the held-out replies cut to their first N tokens, as the grid's turns are")
@click.option("--heldout", "heldout_count", default=200, show_default=True,
              help="held-out conversations replayed (the cache's last ones)")
@click.option("--out", default="results/smollm2-135m/rounds", show_default=True)
def main(tag: str, tasks: tuple[str, ...], reply_tokens: int, heldout_count: int, out: str) -> None:
    from bench.core.drafters import read_manifest
    from bench.core.target import load_target, resolve_dtype
    from bench.core.training.features import FeatureData, ensure_features
    from bench.records import RunFile
    from methods.dflash import Options, load_model
    from methods.dflash.rounds import heldout_rounds, sequence_rounds
    from methods.dflash.training import FeatureBatches

    torch.set_num_threads(1)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the grid's dtype
    model, loaded = load_model(target, "dflash", Options())
    info = loaded["info"]
    embed = target.engine.embed
    lm_head = target.engine.lm_head[model.draft_to_target].to(model.fc.weight.dtype)
    taps = tuple(model.config.taps)
    result = {"what": "DFlash: greedy rounds of its block chain replayed from one target pass, on the drafter's "
                      "held-out conversations and on the grid's turns, and the rounds the loop recorded",
              "drafter": info, "tasks": {}}
    with torch.no_grad():
        for task in tasks:
            records = latest_records(target.name, task, "dflash", tag)
            run = RunFile(records).settings
            if run.get("drafter", {}).get("manifest_sha") != info.get("manifest_sha"):
                raise click.ClickException(f"{records} ran another DFlash drafter than the one found here")
            simulated, measured, turns = [0, 0, 0], [0, 0, 0], 0
            for record, prompt in grid_turns(target, task, records):
                tokens = torch.tensor(prompt + record["tokens"])
                n = len(tokens)
                hidden = target.engine.prefill(tokens, taps=taps, logits_rows="none").hidden
                reply = torch.arange(n) >= len(prompt)
                counts = sequence_rounds(model, embed, lm_head, tokens, [hidden[t] for t in taps], reply,
                                         reply & (torch.arange(n) < n - 1), run["max_new_tokens"])
                simulated = [a + b for a, b in zip(simulated, counts)]
                measured = [a + b for a, b in zip(measured, recorded_rounds(record))]
                turns += 1
            result["tasks"][task] = task_result(records, turns, simulated, measured)
        manifest = read_manifest(info["drafter"])
        training = manifest.get("training", {})
        settings = training.get("settings", {})
        data = FeatureData(max_tokens=settings.get("feature_tokens", FeatureData.max_tokens),
                           max_len=settings.get("max_len", FeatureData.max_len), seed=training.get("seed", 0),
                           self_distill=settings.get("self_distill", False))
        final = target.config.num_hidden_layers
        store = ensure_features(target, tuple(sorted(set(taps) | {final})), data, progress=False)
        tensors = store.load(taps)
        spans = FeatureBatches(tensors, list(taps), final, 1, 0).heldout_spans[-heldout_count:]
        held = heldout_rounds(model, embed, lm_head, tensors, spans, reply_tokens)
    result.update(heldout_recorded=manifest.get("heldout"), heldout=held, conversations=len(spans),
                  features=str(store.folder))
    for name, found in (("whole replies", held), (f"first {reply_tokens} tokens", held[f"first_{reply_tokens}"])):
        click.echo(f"held out, {name}: first-draft top-1 {found['first_draft_top1']:.3f}; simulated rounds tau "
                   f"{found['rounds_tau']:.3f} (a_1 {found['rounds_a1']:.3f})")
    click.echo(f"-> {write_record(out, f'dflash-{tag}', result)}")


if __name__ == "__main__":
    main()
