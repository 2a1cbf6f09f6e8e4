"""Method registry. Each method module exposes `build(target, options) -> Decoder`.

A Decoder turns a prompt into a TurnResult. Nearly every method is a Drafter run
through bench.core.decode.decode (wrapped by LoopDecoder); `hf` is the outside reference
that calls transformers' own generate.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import methods  # noqa: F401  (importing the package registers its shipped drafters)
from bench.core.errors import BenchError


@dataclass(frozen=True)
class MethodInfo:
    name: str
    module: str
    summary: str
    lossless: bool = True
    trained: bool = False  # needs a drafter trained for the target (`bench train`)


METHODS: dict[str, MethodInfo] = {m.name: m for m in [
    MethodInfo("ar", "methods.ar", "autoregressive baseline: the shared loop with no draft"),
    MethodInfo("hf", "methods.hf", "transformers.generate, the outside reference (greedy/sampling)"),
    MethodInfo("pld", "methods.pld", "prompt lookup decoding: n-gram copy from prompt+output"),
    MethodInfo("lookahead", "methods.lookahead", "Lookahead decoding: Jacobi window + n-gram pool (N=5, W=7, G=7)"),
    MethodInfo("sps", "methods.sps", "speculative sampling with a distilled draft LM (bench train --method sps)",
               trained=True),
    MethodInfo("specinfer", "methods.specinfer", "SpecInfer token trees from the SpS draft model (top-k or sampled)",
               trained=True),
    MethodInfo("medusa", "methods.medusa", "Medusa-1: K=5 residual heads on the last hidden state, static tree",
               trained=True),
    MethodInfo("mtp", "methods.mtp", "multi-token prediction: DeepSeek-V3 sequential module (or parallel heads)",
               trained=True),
    MethodInfo("eagle", "methods.eagle", "EAGLE-1: feature-level AR head, static tree", trained=True),
    MethodInfo("eagle2", "methods.eagle2", "EAGLE-2: the EAGLE-1 head with a dynamic draft tree", trained=True),
    MethodInfo("eagle3", "methods.eagle3", "EAGLE-3: fused low/mid/high features, training-time test, dynamic tree",
               trained=True),
    MethodInfo("dflash", "methods.dflash", "DFlash: block-diffusion drafter on fused target features, b-token chain",
               trained=True),
    MethodInfo("ddtree", "methods.ddtree", "DDTree: best-first tree from one DFlash pass under a node budget",
               trained=True),
    MethodInfo("dspark", "methods.dspark", "DSpark: DFlash backbone + Markov and confidence heads, scheduled verify",
               trained=True),
]}


def get_method(name: str) -> MethodInfo:
    if name not in METHODS:
        raise BenchError(f"unknown method '{name}' (choose from {', '.join(METHODS)})")
    return METHODS[name]


def build_decoder(name: str, target, options: dict | None = None):
    info = get_method(name)
    return importlib.import_module(info.module).build(target, options or {})
