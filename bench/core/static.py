"""The target's verify pass as a fixed-shape function of persistent buffers, replayed from
one CUDA graph per row bucket.

A pass after the prefill is padded to a VERIFY_BUCKETS row count (bench.core.engine). For
each bucket the pass is written so that nothing in it depends on a host value: the rows'
tokens, RoPE positions, cache slots, which rows are real, and their visibility over the
cache's whole capacity all sit in device buffers; K/V are written with index_copy at the
slot indices and attention reads the full capacity under the mask. So the same kernels
run every time, and on CUDA the pass is captured once per bucket (torch.cuda.CUDAGraph)
and replayed: one graph launch instead of ~1,000 kernel launches per forward.

Attention keeps grouped queries without expanding K/V and without the math kernel: the
query heads that share a K/V head are folded into the query rows ([1, kv_heads,
group * n, d] against [1, kv_heads, capacity, d], the mask repeated per group), which the
memory-efficient SDPA kernel takes with an arbitrary mask.

`enable_static(engine)` turns it on (bench.core.target.load_target does on CUDA). On the
CPU the same functions run eagerly (the tests enable it there): equal
argmax to the dynamic path, padding and stale slots unreachable. Capture itself needs a GPU
(`make gpu-check`). A graph is bound to the cache tensors it was captured on: the engine
recaptures when the cache is reallocated (a larger turn), so runs size it once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.engine import PAD_TOKEN, VERIFY_BUCKETS, Engine, ForwardOutput, rms_norm


def enable_static(engine: Engine, on: bool = True) -> Engine:
    """Route `engine`'s passes after the prefill through StaticPasses (padded to buckets)."""
    engine.static_passes = StaticPasses() if on else None
    if on and not engine.buckets:
        engine.buckets = VERIFY_BUCKETS
    return engine


def static_forward(engine: Engine, tokens: Tensor, positions: Tensor, slots: Tensor, real: Tensor,
                   visible: Tensor, taps: tuple[int, ...]) -> tuple[Tensor, dict[int, Tensor]]:
    """The layers over a bucket of rows, from device buffers only: tokens, positions, slots
    [m] (long), real [m] (bool: padding rows write zero K/V), visible [m, capacity] (bool).
    Returns logits [m, vocab] (fp32) and the tapped states [m, d]."""
    k_cache, v_cache = engine.cache.k, engine.cache.v
    m, group = tokens.shape[0], engine.num_heads // engine.num_kv_heads
    cos, sin = engine._rope_cos[positions][None, None], engine._rope_sin[positions][None, None]
    mask = visible.repeat(group, 1)[None, None]  # rows of one K/V head's query group, group-major
    keep = real[None, None, :, None]

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_cache[i].index_copy_(2, slots, torch.where(keep, k, 0).to(k_cache.dtype))
        v_cache[i].index_copy_(2, slots, torch.where(keep, v, 0).to(v_cache.dtype))
        folded = q.reshape(1, engine.num_kv_heads, group * m, engine.head_dim)
        out = F.scaled_dot_product_attention(folded, k_cache[i].to(q.dtype), v_cache[i].to(q.dtype),
                                             attn_mask=mask, scale=engine.scale)
        return out.view(1, engine.num_heads, m, engine.head_dim)

    x, hidden = engine.decoder_layers(F.embedding(tokens, engine.embed)[None], cos, sin, attend, taps)
    x = rms_norm(x, engine.final_norm, engine.eps)
    hidden = {t: h[0] for t, h in hidden.items()}
    if engine.num_layers in taps:
        hidden[engine.num_layers] = x[0]
    return engine.linear(x, engine.lm_head)[0].float(), hidden


class StaticPass:
    """One bucket's pass: its input buffers and, on CUDA, its captured graph."""

    def __init__(self, engine: Engine, rows: int, taps: tuple[int, ...]) -> None:
        self.engine, self.rows, self.taps = engine, rows, taps
        self.cache = (engine.cache.k, engine.cache.v)  # the tensors a graph is bound to
        device, capacity = engine.device, engine.cache.capacity
        self.tokens = torch.full((rows,), PAD_TOKEN, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.arange(rows, dtype=torch.long, device=device)
        self.real = torch.zeros(rows, dtype=torch.bool, device=device)
        self.visible = torch.eye(rows, capacity, dtype=torch.bool, device=device)
        self.graph = None  # captured on the first call, once the buffers hold a real pass

    def bound_to(self, engine: Engine) -> bool:
        return self.cache[0] is engine.cache.k and self.cache[1] is engine.cache.v

    def _run(self) -> tuple[Tensor, dict[int, Tensor]]:
        return static_forward(self.engine, self.tokens, self.positions, self.slots, self.real, self.visible,
                              self.taps)

    def _capture(self) -> None:
        # Warm-up on a side stream (allocator pools, lazy kernel choices), then capture. The
        # buffers already hold the first real pass, so the warm-up writes that pass's own
        # K/V into its own free slots (the replay that follows writes them again).
        stream = torch.cuda.Stream(self.engine.device)
        stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(self.engine.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = self._run()

    def __call__(self, tokens: Tensor, positions: Tensor, start: int, visible: Tensor) -> tuple[Tensor, dict]:
        """tokens, positions [n] (n <= rows), the block's slots start.., visible [n, start + n]."""
        n = tokens.shape[0]
        device = self.engine.device
        self.tokens.fill_(PAD_TOKEN)
        self.tokens[:n].copy_(tokens, non_blocking=True)
        self.positions.copy_(positions[-1:].to(device).expand(self.rows), non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        torch.arange(start, start + self.rows, out=self.slots)
        self.real.zero_()[:n] = True
        self.visible.zero_()
        self.visible[:n, :visible.shape[1]].copy_(visible, non_blocking=True)
        pad = torch.arange(n, self.rows, device=device)
        self.visible[pad, pad + start] = True  # padding rows see only themselves
        if self.engine.device.type != "cuda":
            return self._run()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.output


class StaticPasses:
    """An engine's StaticPass per (bucket, taps), made on first use and again when the
    cache they were bound to has been replaced."""

    def __init__(self) -> None:
        self.passes: dict[tuple[int, tuple[int, ...]], StaticPass] = {}

    def __call__(self, engine: Engine, tokens: Tensor, positions: Tensor, visible: Tensor, rows: int,
                 taps: tuple[int, ...], logits_rows: str | Tensor) -> ForwardOutput:
        n, start = tokens.shape[0], engine.cache.length
        engine.cache.reserve(start + rows)
        engine.rope(positions)  # grows the tables past the context limit (checked on the CPU only)
        key = (rows, tuple(sorted(set(taps))))
        runner = self.passes.get(key)
        if runner is None or not runner.bound_to(engine):
            runner = self.passes[key] = StaticPass(engine, rows, key[1])
        logits, hidden = runner(tokens, positions, start, visible)
        engine.cache.length = start + n
        # Copies: a replayed graph writes its next outputs into the same memory.
        hidden = {t: h[:n].clone() for t, h in hidden.items() if t in taps}
        if isinstance(logits_rows, str):
            picked = {"all": slice(0, n), "last": slice(n - 1, n), "none": slice(0, 0)}[logits_rows]
        else:
            picked = logits_rows.to(engine.device)
        return ForwardOutput(logits=logits[:n][picked].clone(), hidden=hidden)
