"""Method registry. Each method module exposes `Options` (a frozen dataclass, parsed by
bench.core.options) and `build(target, options) -> Decoder`.

A Decoder turns a prompt into a TurnResult. Nearly every method is a Drafter run
through bench.core.decode.decode (wrapped by LoopDecoder); `hf` is the outside reference
that calls transformers' own generate.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import methods  # noqa: F401  (importing the package registers its shipped drafters)
from bench.core.errors import BenchError
from bench.core.options import draft_budget, parse_options, recorded


@dataclass(frozen=True)
class MethodInfo:
    name: str
    module: str
    summary: str
    lossless: bool = True
    trained: bool = False  # needs a drafter trained for the target (`bench train`)
    compiles: bool = False  # `bench train --compile` runs its trainer's hot functions through torch.compile
    # "module:Class", the dataclass of its `bench train --option`s: checked before the target loads
    train_options: str | None = None
    # "module:Class", its round replay (`bench rounds`, bench/rounds.py): built from the shipped drafter
    replay: str | None = None


METHODS: dict[str, MethodInfo] = {m.name: m for m in [
    MethodInfo("ar", "methods.ar", "autoregressive baseline: the shared loop with no draft"),
    MethodInfo("hf", "methods.hf", "transformers.generate, the outside reference (greedy/sampling)"),
    MethodInfo("pld", "methods.pld", "prompt lookup decoding: n-gram copy from prompt+output"),
    MethodInfo("suffix", "methods.suffix", "SuffixDecoding: suffix trees over the request and earlier replies"),
    MethodInfo("lookahead", "methods.lookahead", "Lookahead decoding: Jacobi window + n-gram pool (N=5, W=7, G=7)"),
    MethodInfo("sps", "methods.sps", "speculative sampling with a distilled draft LM (bench train --method sps)",
               trained=True, train_options="bench.training.draft_lm:DraftLMSettings",
               replay="methods.sps.rounds:Replay"),
    MethodInfo("specinfer", "methods.specinfer", "SpecInfer token trees from the SpS draft model (top-k or sampled)",
               trained=True),
    MethodInfo("medusa", "methods.medusa", "Medusa-1: K=5 residual heads on the last hidden state, static tree",
               trained=True, train_options="methods.medusa.training:MedusaTraining",
               replay="methods.medusa.rounds:Replay"),
    MethodInfo("mtp", "methods.mtp", "multi-token prediction: DeepSeek-V3 sequential module (or parallel heads)",
               trained=True, train_options="methods.mtp.training:MtpSettings",
               replay="methods.mtp.rounds:Replay"),
    MethodInfo("eagle", "methods.eagle", "EAGLE-1: feature-level AR head, static tree", trained=True,
               train_options="methods.eagle.training:EagleTrainSettings", replay="methods.eagle.rounds:Eagle1Replay"),
    MethodInfo("eagle2", "methods.eagle2", "EAGLE-2: the EAGLE-1 head with a dynamic draft tree", trained=True,
               train_options="methods.eagle.training:EagleTrainSettings"),
    MethodInfo("eagle3", "methods.eagle3", "EAGLE-3: fused low/mid/high features, training-time test, dynamic tree",
               trained=True, train_options="methods.eagle.training:EagleTrainSettings", compiles=True,
               replay="methods.eagle.rounds:Replay"),
    MethodInfo("dflash", "methods.dflash", "DFlash: block-diffusion drafter on fused target features, b-token chain",
               trained=True, train_options="methods.dflash.training:BlockTrainSettings", compiles=True,
               replay="methods.dflash.replay:Replay"),
    MethodInfo("ddtree", "methods.ddtree", "DDTree: best-first tree from one DFlash pass under a node budget",
               trained=True),
    MethodInfo("dspark", "methods.dspark", "DSpark: DFlash backbone + Markov and confidence heads, scheduled verify",
               trained=True, train_options="methods.dflash.training:BlockTrainSettings", compiles=True),
]}


def get_method(name: str) -> MethodInfo:
    if name not in METHODS:
        raise BenchError(f"unknown method '{name}' (choose from {', '.join(METHODS)})")
    return METHODS[name]


def check_training_options(name: str, options: dict) -> None:
    """Unknown `bench train --option` keys as one line, before anything loads."""
    path = get_method(name).train_options
    if path is None:
        return
    module, _, cls = path.partition(":")
    known = {f for f in getattr(importlib.import_module(module), cls).__dataclass_fields__ if f != "extra"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise BenchError(f"unknown {name} training option '{unknown[0]}' (known: {', '.join(sorted(known))})")


def options_class(name: str) -> type:
    """The method's Options dataclass (loads no model)."""
    return importlib.import_module(get_method(name).module).Options


def resolve_options(name: str, options=None, budget: int | None = None):
    """The method's typed Options (its module's frozen dataclass) from `--option` pairs (or
    an Options already) and `--budget`; bad input is one BenchError line. Loads no model, so
    a run checks its options before the target."""
    module = importlib.import_module(get_method(name).module)
    return parse_options(module.Options, options or {}, name, budget)


def recorded_options(name: str, options=None, budget: int | None = None) -> dict:
    """What a run records as its method options: those given or set by the budget, resolved
    (bench.core.options.recorded); a run with default options records {}."""
    module = importlib.import_module(get_method(name).module)
    return recorded(module.Options, options or {}, name, budget)


def recorded_budget(settings: dict) -> int | None:
    """Draft tokens per round of a recorded run: its --budget, else what its recorded
    options amount to (runs from before --budget), else None (adaptive, or not fixed)."""
    if settings.get("budget"):
        return int(settings["budget"])
    if settings.get("method") not in METHODS:
        return None
    try:
        return draft_budget(resolve_options(settings["method"], settings.get("method_options") or {}))
    except BenchError:  # options an older version took
        return None


def build_decoder(name: str, target, options=None):
    """`options`: a dict of `--option` values or the method's Options."""
    info = get_method(name)
    resolved = resolve_options(name, options)
    decoder = importlib.import_module(info.module).build(target, resolved)
    accept = getattr(resolved, "oracle_accept", None)
    if accept is None:
        return decoder
    from bench.core.decode import LoopDecoder
    from bench.core.oracle import OracleDecoder

    if not isinstance(decoder, LoopDecoder):
        raise BenchError(f"{name} does not run through the decode loop: oracle_accept needs one that does")
    return OracleDecoder(decoder, accept, resolved.oracle_seed)
