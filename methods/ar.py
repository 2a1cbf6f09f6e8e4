"""The autoregressive baseline: the shared decode loop with a drafter that proposes nothing."""

from __future__ import annotations

from bench.core.decode import Drafter, LoopDecoder


def build(target, options: dict) -> LoopDecoder:
    return LoopDecoder(target, Drafter())
