"""`bench rounds --method dflash`: the shipped block drafter's greedy chain replayed (methods/dflash/rounds.py)."""

from __future__ import annotations

import torch

from methods.dflash.rounds import heldout_rounds, sequence_rounds


class Replay:
    """`bench rounds --method dflash`: the shipped block drafter's greedy chain replayed from one
    target pass per sequence, on recorded grid turns and on its held-out conversations (the
    feature cache's last ones, which it never trained on)."""

    what = ("DFlash: greedy rounds of its block chain replayed from one target pass, on the drafter's held-out "
            "conversations and on the grid's turns, beside the rounds the loop recorded")

    def __init__(self, target) -> None:
        from methods.dflash import Options, load_model

        self.target = target
        self.model, loaded = load_model(target, "dflash", Options())
        self.info = loaded["info"]
        self.embed = target.engine.embed
        self.lm_head = target.engine.lm_head[self.model.draft_to_target].to(self.model.fc.weight.dtype)
        self.taps = tuple(self.model.config.taps)

    def check(self, settings: dict) -> str | None:
        ran, shipped = (settings.get("drafter") or {}).get("manifest_sha"), self.info.get("manifest_sha")
        return None if ran == shipped else f"manifest {ran}, shipped {shipped}"

    def turn(self, settings: dict, prompt: list[int], record: dict) -> tuple[int, int, int]:
        tokens = torch.tensor(prompt + record["tokens"])
        n = len(tokens)
        hidden = self.target.engine.prefill(tokens, taps=self.taps, logits_rows="none").hidden
        reply = torch.arange(n) >= len(prompt)
        return sequence_rounds(self.model, self.embed, self.lm_head, tokens, [hidden[t] for t in self.taps], reply,
                               reply & (torch.arange(n) < n - 1), settings["max_new_tokens"])

    def heldout(self, conversations: int, reply_tokens: int) -> dict:
        from bench.core.drafters import read_manifest
        from bench.training.features import FeatureData, ensure_features
        from methods.dflash.training import FeatureBatches

        manifest = read_manifest(self.info["drafter"])
        training = manifest.get("training", {})
        settings = training.get("settings", {})
        data = FeatureData(max_tokens=settings.get("feature_tokens", FeatureData.max_tokens),
                           max_len=settings.get("max_len", FeatureData.max_len), seed=training.get("seed", 0),
                           self_distill=settings.get("self_distill", False))
        final = self.target.config.num_hidden_layers
        store = ensure_features(self.target, tuple(sorted(set(self.taps) | {final})), data, progress=False)
        tensors = store.load(self.taps)
        spans = FeatureBatches(tensors, list(self.taps), final, 1, 0).heldout_spans[-conversations:]
        found = heldout_rounds(self.model, self.embed, self.lm_head, tensors, spans, reply_tokens)
        return dict(found, recorded_at_export=manifest.get("heldout"), conversations=len(spans),
                    features=str(store.folder))
