"""The autoregressive baseline: the shared decode loop with a drafter that proposes nothing."""

from __future__ import annotations

from dataclasses import dataclass

from bench.core.decode import Drafter, LoopDecoder
from bench.core.options import parse_options


@dataclass(frozen=True)
class Options:
    """None: any key is an error, and so is --budget (the baseline drafts nothing)."""


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    parse_options(Options, options, "ar")
    return LoopDecoder(target, Drafter())
