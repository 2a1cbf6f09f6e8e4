"""A shipped EAGLE head's held-out agreement beside its replayed decode rounds.

The head's unrolled pass (EAGLE-3's TTT pass; EAGLE-1 fed its own predicted features) drafts at
every row what a top-1 chain as deep as its steps drafts there in the decode loop
(methods/eagle/training.rank_accuracy; tests/test_eagle.py checks it round by round for both
kinds), so greedy rounds of that chain replay exactly from one pass over the head's
held-out conversations (the feature cache's last ones, which it never trained on), whole and
cut to each reply's first 128 tokens as the grid's turns are. The grid drafts a tree, which
accepts more than the chain; the chain's replay says how much of the gap between the product of
per-step agreements and the grid is where rounds start and a reply's opening, as for MTP,
Medusa, SpS and DFlash (their records are retired from the tree: results/ARCHIVE.md).

    python -m scripts.eagle_rounds --method eagle3 --heldout 200
"""

from __future__ import annotations

import dataclasses

import click
import torch

from bench.core.training import GRID_REPLY_TOKENS
from scripts.mtp_rounds import write_record


@click.command()
@click.option("--method", type=click.Choice(["eagle3", "eagle"]), default="eagle3", show_default=True,
              help="the shipped head replayed (eagle: EAGLE-1's, which EAGLE-2 drafts with)")
@click.option("--heldout", "heldout_count", default=200, show_default=True,
              help="held-out conversations replayed (the first of the cache's held-out ones)")
@click.option("--reply-tokens", default=GRID_REPLY_TOKENS, show_default=True)
@click.option("--steps", type=int, default=None, help="chain depth unrolled (default: the head's ttt_steps)")
@click.option("--out", default="results/smollm2-135m/rounds", show_default=True)
@click.option("--name", default=None, help="the record's name (default <method>-heldout)")
def main(method: str, heldout_count: int, reply_tokens: int, steps: int | None, out: str, name: str | None) -> None:
    from bench.core.drafters import find_drafter, read_manifest, weights_sha1
    from bench.core.target import load_target, resolve_dtype
    from bench.core.training import heldout_prediction
    from bench.core.training.features import FeatureData, ensure_features
    from methods.eagle import load_head
    from methods.eagle.training import EagleObjective, EagleTrainSettings, FeatureBatches, rank_accuracy

    torch.set_num_threads(1)
    target = load_target(None, "cpu", resolve_dtype("auto", "cpu"))  # the features' dtype
    folder, kind = find_drafter(target.name, method, None), "eagle3" if method == "eagle3" else "eagle1"
    manifest = read_manifest(folder)
    settings = EagleTrainSettings(**manifest["training"]["settings"])
    settings = dataclasses.replace(settings, ttt_steps=steps or settings.ttt_steps)
    head, _ = load_head(target, method, type("Options", (), {"drafter": str(folder), "dtype": "float32"}), kind)
    engine = target.engine
    taps = tuple(sorted(set(head.config.taps) | {engine.num_layers}))
    data = FeatureData(max_tokens=settings.feature_tokens, max_len=settings.max_len,
                       seed=manifest["training"].get("seed", 0), self_distill=settings.self_distill)
    store = ensure_features(target, taps, data, progress=False)
    batches = FeatureBatches(store.load(taps), list(head.config.taps), engine.num_layers, 1, 0)
    objective = EagleObjective(head, engine.embed.float(), engine.lm_head.float(), engine.num_layers, settings)
    with torch.no_grad():
        accuracy, replay = rank_accuracy(objective, batches, limit=heldout_count, keep=reply_tokens)
    top1 = [accuracy[f"step{s}"][0] for s in range(len(accuracy))]
    product = heldout_prediction(top1)
    cut = replay[f"first_{reply_tokens}"]
    click.echo(f"held out ({min(heldout_count, len(batches.heldout_spans))} conversations): top-1 by step "
               f"{' / '.join(f'{a:.3f}' for a in top1)}, product tau {product['predicted_tau']:.3f}; "
               f"replayed {replay['rounds_chain']}: tau {replay['rounds_tau']:.3f} (a_1 {replay['rounds_a1']:.3f}); "
               f"first {reply_tokens} tokens: tau {cut['rounds_tau']:.3f} (a_1 {cut['rounds_a1']:.3f})")
    result = {"what": f"{method}: greedy rounds of a top-1 chain as deep as the head's unrolled steps, replayed from "
                      "its unrolled pass on held-out conversations, beside the product of per-step agreements",
              "drafter": str(folder), "weights_sha1": weights_sha1(folder),
              "trained_steps": manifest["training"].get("steps"), "features": str(store.folder),
              "heldout_conversations": min(heldout_count, len(batches.heldout_spans)),
              "heldout": dict(product, **replay), "heldout_rank_accuracy": accuracy}
    click.echo(f"-> {write_record(out, name or f'{method}-heldout', result)}")


if __name__ == "__main__":
    main()
