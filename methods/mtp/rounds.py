"""MTP rounds replayed from teacher-forced drafts (bench.training.simulated_rounds).

For a greedy chain drafter the simulation on a recorded turn replays the loop exactly: every
accepted draft is the target's own token, so the drafter's inputs are the teacher-forced ones
(a difference is numerics: the loop's k-token verify passes against one prefill here).
"""

from __future__ import annotations

import torch

from bench.training import first_reply_tokens, heldout_prediction


def turn_features(target, prompt: list[int], reply: list[int]) -> tuple[dict, tuple[int, int, int]]:
    """One recorded turn as a features window: rounds may start once the first reply token (the
    prefill's) is known."""
    tap = target.engine.num_layers
    tokens = torch.tensor(prompt + reply)
    hidden = target.engine.prefill(tokens, taps=(tap,), logits_rows="none").hidden[tap].float()
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    mask[len(prompt): len(tokens) - 1] = True  # row r drafts token r+2: from the second reply token on
    return {"tokens": tokens, "loss_mask": mask, f"h{tap}": hidden}, (0, 0, len(tokens))


class Replay:
    """`bench rounds --method mtp`: the shipped sequential module's chain, on recorded grid
    turns and on its held-out conversations (whole and cut to their first tokens)."""

    what = ("MTP: held-out agreement, decode rounds simulated on the held-out replies and on the grid's turns, "
            "beside the rounds the decode loop recorded for those turns (greedy)")

    def __init__(self, target) -> None:
        from methods.mtp.store import find_folder, load_model
        from methods.mtp.training import MtpSettings

        self.target = target
        folder = find_folder(target, "sequential", None)
        model, manifest = load_model(target, folder, "sequential")
        self.model = model.float()
        self.settings = MtpSettings.parse(dict(manifest["mtp_settings"]))
        self.depth = self.settings.eval_steps
        self.info = {"drafter": str(folder), "weights_sha1": manifest.get("weights_sha1"), "depth": self.depth}

    def check(self, settings: dict) -> str | None:
        ran = (settings.get("drafter") or {}).get("weights_sha1")
        return None if ran in (None, self.info["weights_sha1"]) else f"weights {ran}"

    def turn(self, settings: dict, prompt: list[int], record: dict) -> tuple[int, int, int]:
        from methods.mtp.training import MtpObjective

        features, window = turn_features(self.target, prompt, record["tokens"])
        return MtpObjective(self.target, self.model, self.settings, features).round_counts([window], self.depth)

    def heldout(self, conversations: int, reply_tokens: int) -> dict:
        from bench.training.features import ensure_features
        from methods.mtp.training import MtpObjective, windows_of

        tap = self.target.engine.num_layers
        store = ensure_features(self.target, (tap,), self.settings.feature_data(None), progress=False)
        features = store.load((tap,))
        offsets = features["offsets"].tolist()
        held_offsets = offsets[len(offsets) - min(conversations, self.settings.holdout) - 1:]
        held = [w for w in windows_of(held_offsets, 512) if bool(features["loss_mask"][w[1] + 1: w[2]].any())]
        self.settings.eval_rows = 10**9  # every held-out row
        whole = MtpObjective(self.target, self.model, self.settings, features).evaluate(held)
        cut = dict(features, loss_mask=first_reply_tokens(features["loss_mask"], held[0][1], reply_tokens))
        first = MtpObjective(self.target, self.model, self.settings, cut).evaluate(
            [w for w in held if bool(cut["loss_mask"][w[1] + 1: w[2]].any())])
        return dict(whole, **heldout_prediction(whole["acc"]),
                    **{f"first_{reply_tokens}": dict(first, **heldout_prediction(first["acc"]))},
                    conversations=len(held_offsets) - 1, features=str(store.folder))
