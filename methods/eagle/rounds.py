"""A shipped EAGLE head's held-out agreement beside its replayed decode rounds.

The head's unrolled pass (EAGLE-3's TTT pass; EAGLE-1 fed its own predicted features) drafts at
every row what a top-1 chain as deep as its steps drafts there in the decode loop
(methods/eagle/training.rank_accuracy; tests/test_eagle.py checks it round by round for both
kinds), so greedy rounds of that chain replay exactly from one pass over the head's held-out
conversations. The grid drafts a tree, which accepts more than the chain: the chain's replay
says how much of the gap between the product of per-step agreements and the grid is where
rounds start and a reply's opening. Held-out conversations only: no `turn`.
"""

from __future__ import annotations

import torch

from bench.training import heldout_prediction


class Replay:
    method = "eagle3"
    what = ("greedy rounds of a top-1 chain as deep as the head's unrolled steps, replayed from its unrolled pass "
            "on held-out conversations, beside the product of per-step agreements")

    def __init__(self, target) -> None:
        from bench.core.drafters import find_drafter, read_manifest, weights_sha1
        from methods.eagle import load_head

        self.target = target
        folder = find_drafter(target.name, self.method, None)
        self.manifest = read_manifest(folder)
        kind = "eagle3" if self.method == "eagle3" else "eagle1"
        options = type("Options", (), {"drafter": str(folder), "dtype": "float32"})
        self.head, _ = load_head(target, self.method, options, kind)
        self.info = {"drafter": str(folder), "weights_sha1": weights_sha1(folder),
                     "trained_steps": self.manifest["training"].get("steps")}

    def heldout(self, conversations: int, reply_tokens: int) -> dict:
        from bench.training.features import FeatureData, ensure_features
        from methods.eagle.training import EagleObjective, EagleTrainSettings, FeatureBatches, rank_accuracy

        settings = EagleTrainSettings(**self.manifest["training"]["settings"])
        engine = self.target.engine
        taps = tuple(sorted(set(self.head.config.taps) | {engine.num_layers}))
        data = FeatureData(max_tokens=settings.feature_tokens, max_len=settings.max_len,
                           seed=self.manifest["training"].get("seed", 0), self_distill=settings.self_distill)
        store = ensure_features(self.target, taps, data, progress=False)
        batches = FeatureBatches(store.load(taps), list(self.head.config.taps), engine.num_layers, 1, 0)
        objective = EagleObjective(self.head, engine.embed.float(), engine.lm_head.float(), engine.num_layers,
                                   settings)
        with torch.no_grad():
            accuracy, replay = rank_accuracy(objective, batches, limit=conversations, keep=reply_tokens)
        top1 = [accuracy[f"step{s}"][0] for s in range(len(accuracy))]
        return dict(heldout_prediction(top1), **replay, rank_accuracy=accuracy,
                    conversations=min(conversations, len(batches.heldout_spans)), features=str(store.folder))


class Eagle1Replay(Replay):
    """EAGLE-1's head (the one EAGLE-2 drafts with)."""

    method = "eagle"
