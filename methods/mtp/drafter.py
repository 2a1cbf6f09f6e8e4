"""MTP drafting at decode time: the drafters' KV caches and the draft chain.

sequential: drafting from the root x_s (position s, not yet in the target's KV cache):
step 1 is row s, the pair (h_{s-1}, x_s) at RoPE position s-1 (the feature's position, as
vLLM, SGLang and speculators place it); step k feeds back the previous step's output g
(the module's *normed* output, the same kind of vector as tap L, which is what step 1 was
trained on; so do SGLang's DeepSeek NextN, vLLM's Qwen3-Next and MiMo MTP and speculators,
while vLLM's DeepSeek MTP feeds the pre-norm output) with the embedding of the token just
drafted, at position s+k-2. The drafter's one-layer KV cache holds only context rows 1..s
(each from a true target feature; slot i = row i+1 at position i); the chained rows are
written after them and cropped at the end of every proposal, and the features of the
committed rows of each verify pass are fed at the next proposal (the EAGLE "stable KV"
scheme).

parallel: one proposal = every head at the last position with a known trunk feature
(s-1), so the chain d_1..d_n needs no recursion, and the heads' caches only ever hold
committed rows (no rollback).

Drafts are argmax (q one-hot, exact at any temperature) unless `sample`: then at T > 0
they are drawn from the module's warped q, recorded for the min(1, p/q) rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from bench.core.cpu_kernels import linear as packed_linear
from bench.core.decode import DecodeState, Drafter
from bench.core.draft import Draft
from bench.core.engine import Engine, ForwardOutput
from bench.core.errors import BenchError
from bench.core.sampling import process_logits, sample_from
from bench.core.verify import Verdict
from methods.mtp.model import ParallelMTP, Rope, SequentialMTP
from methods.mtp.store import METHOD

if TYPE_CHECKING:
    from bench.core.target import Target

MAX_DEPTH = 16


class MtpDrafter(Drafter):
    """What both variants share: the lm_head readout, draft choice and feeding committed
    target features; subclasses own the caches."""

    name = METHOD

    def __init__(self, model: nn.Module, engine: Engine, depth: int, sample: bool, dtype: torch.dtype) -> None:
        self.model = model
        self.depth = depth
        self.sample = sample
        self.dtype = dtype
        self.device = engine.device
        self.rope = Rope(engine, dtype, engine.device)
        self.embed = engine.embed
        self.lm_head = engine.lm_head if engine.lm_head.dtype == dtype else engine.lm_head.to(dtype)
        self.unfed: Tensor | None = None  # target features of committed rows not yet in the draft cache

    def _chain_length(self, state: DecodeState) -> int:
        remaining = state.config.max_new_tokens - len(state.generated)
        return min(self.depth, remaining - 1)  # the verify pass adds one token itself

    def _choose(self, normed: Tensor, state: DecodeState, step: int) -> tuple[int, Tensor | None]:
        """Draft token from the output g [d]: argmax (q one-hot), or sampled from warped q."""
        logits = packed_linear(normed, self.lm_head).float()
        cfg = state.config.sampling
        if cfg.greedy or not self.sample:
            return int(logits.argmax()), None
        q = process_logits(logits, cfg).softmax(-1)
        return sample_from(q, state.generator), q

    def _feed(self, out: ForwardOutput, rows: list[int]) -> None:
        new = out.hidden[self.taps[0]][rows].to(self.dtype)
        self.unfed = new if self.unfed is None or not len(self.unfed) else torch.cat([self.unfed, new])

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.unfed = prefill.hidden[self.taps[0]].to(self.dtype)
        self.reset_caches()

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        self._feed(out, rows)

    def reset_caches(self) -> None:
        raise NotImplementedError


class SequentialDrafter(MtpDrafter):
    """One module applied `depth` times; see this file's docstring."""

    def __init__(self, model: SequentialMTP, engine: Engine, depth: int = 4, sample: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, engine, depth, sample, dtype)
        self.taps = (engine.num_layers,)
        self.cache = model.layer.new_cache(dtype, self.device)

    def fork(self) -> Drafter:
        twin = super().fork()
        twin.cache = self.model.layer.new_cache(self.dtype, self.device)
        return twin

    def reset_caches(self) -> None:
        self.cache.length = 0  # slot i holds row i+1 at position i (row 0, the first token, has no feature)

    @torch.inference_mode()
    def ingest(self, state: DecodeState) -> Tensor:
        """Add the context rows the cache lacks, up to the root's row s; returns g_s [d]."""
        s = len(state.tokens) - 1
        first = s - len(self.unfed) + 1  # rows first..s take features at first-1..s-1
        if first != self.cache.length + 1:
            raise RuntimeError(f"mtp draft cache out of step: {self.cache.length} rows, next row {first}")
        tokens = torch.tensor(state.tokens[first: s + 1], device=self.device)
        x = self.model.fuse(self.unfed, self.embed[tokens].to(self.dtype))
        out = self.model.layer.cached(x, torch.arange(first - 1, s, device=self.device), self.cache, self.rope)
        self.unfed = self.unfed[:0]
        return self.model.out(out[-1])

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        g = self.ingest(state)
        depth = self._chain_length(state)
        if depth < 1:
            return Draft.empty()
        s = len(state.tokens) - 1
        context = self.cache.length
        tokens, q_rows = [], []
        for step in range(depth):
            token, q = self._choose(g, state, step)
            tokens.append(token)
            if q is not None:
                q_rows.append(q)
            if step + 1 < depth:  # chain: own output + the drafted token, one position further
                x = self.model.fuse(g[None], self.embed[token][None].to(self.dtype))
                out = self.model.layer.cached(x, torch.tensor([s + step], device=self.device), self.cache, self.rope)
                g = self.model.out(out[0])
        self.cache.crop(context)  # chained rows used the module's own features: drop them
        return Draft.chain(tokens, q=torch.stack(q_rows) if q_rows else None)


class ParallelDrafter(MtpDrafter):
    """Heads 1..depth at the last position with a known trunk feature."""

    def __init__(self, model: ParallelMTP, engine: Engine, tap: int, depth: int = 3, sample: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, engine, depth, sample, dtype)
        self.taps = (tap,)
        self.caches = [head.layer.new_cache(dtype, self.device) for head in model.heads[:depth]]

    def fork(self) -> Drafter:
        twin = super().fork()
        twin.caches = [head.layer.new_cache(self.dtype, self.device) for head in self.model.heads[:len(self.caches)]]
        return twin

    def reset_caches(self) -> None:
        for cache in self.caches:
            cache.length = 0  # slot t holds position t

    @torch.inference_mode()
    def propose(self, state: DecodeState) -> Draft:
        s = len(state.tokens) - 1
        first = s - len(self.unfed)
        positions = torch.arange(first, s, device=self.device)
        outs = []
        for head, cache in zip(self.model.heads, self.caches):
            if first != cache.length:
                raise RuntimeError(f"mtp head cache out of step: {cache.length} rows, next row {first}")
            outs.append(head.out(head.layer.cached(self.unfed, positions, cache, self.rope)[-1]))
        self.unfed = self.unfed[:0]
        depth = self._chain_length(state)
        if depth < 1:
            return Draft.empty()
        tokens, q_rows = [], []
        for step, g in enumerate(outs[:depth]):
            token, q = self._choose(g, state, step)
            tokens.append(token)
            if q is not None:
                q_rows.append(q)
        return Draft.chain(tokens, q=torch.stack(q_rows) if q_rows else None)


def make_drafter(target: Target, model: nn.Module, manifest: dict, depth: int | None = None, sample: bool = False,
                 dtype: torch.dtype = torch.float32) -> MtpDrafter:
    """The drafter for a loaded module (cast to `dtype` on the target's device); `depth`
    defaults to the folder's own proposal length (a speculators config's speculative_tokens),
    else 4 steps (sequential) or every head (parallel)."""
    engine = target.engine
    model = model.to(device=engine.device, dtype=dtype).requires_grad_(False)
    if manifest["variant"] == "sequential":
        depth = min(manifest.get("depth") or 4, MAX_DEPTH) if depth is None else depth
        if not 1 <= depth <= MAX_DEPTH:
            raise BenchError(f"mtp depth must be in 1..{MAX_DEPTH}, got {depth}")
        return SequentialDrafter(model, engine, depth, sample, dtype)
    heads = len(model.heads)
    depth = heads if depth is None else depth
    if not 1 <= depth <= heads:
        raise BenchError(f"mtp parallel depth must be in 1..{heads} (the drafter's heads), got {depth}")
    return ParallelDrafter(model, engine, int(manifest["tap"]), depth, sample, dtype)
