"""The MTP modules: one decoder layer shaped like the target's, wrapped two ways.

SequentialMTP (DeepSeek-V3's module): fuse (next token, feature) with a linear map (halves in
`fuse_order`), run the layer, apply a final RMSNorm. ParallelMTP (Gloeckle's heads): n
independent (layer, final norm) heads over one trunk feature. See methods/mtp/__init__.py
for what predicts what. Both use the target's embedding and lm_head, passed in and never
stored; parameter names are the drafter file's weight names (methods/mtp/store.py), so they
must not change.

`chained_outputs` is the sequential module's training-time recursion: training runs it
`ttt_steps` times (EAGLE-3's training-time test): step-k row j attends to the step-1
keys of rows <= j-k+1 and to its own chain (rows j-k+2..j of steps 2..k), exactly the
keys it sees at decode time (methods/mtp/drafter.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.cpu_kernels import linear as packed_linear
from bench.core.engine import Engine, KVCache, rms_norm, rotate_half

VARIANTS = ("sequential", "parallel")
# The halves of the fused input [a; b] of the sequential module's projection:
# "embedding_first" = [RMSNorm(Emb(x_{t+1})); RMSNorm(h_t)], DeepSeek-V3's eh_proj order (also
# Qwen3-Next's mtp.fc and speculators' input_proj), the default; "hidden_first" = the halves
# swapped, the order of Xiaomi MiMo's MTP layers and of our drafters trained before the
# default changed (a drafter.json without "fuse_order" is one of those).
FUSE_ORDERS = ("embedding_first", "hidden_first")
LEGACY_FUSE_ORDER = "hidden_first"


class Rope:
    """The target's rotary embedding (its inverse frequencies and scaling), any dtype."""

    def __init__(self, engine: Engine, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = engine.inv_freq.float().to(device)
        self.scaling = float(engine.rope_scaling)
        self.dtype = dtype

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer shaped like the target's (checked against it when loading)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    vocab_size: int

    @classmethod
    def of(cls, engine: Engine) -> LayerShape:
        layer = engine.layers[-1]
        return cls(hidden_size=engine.hidden_size, num_heads=engine.num_heads, num_kv_heads=engine.num_kv_heads,
                   head_dim=engine.head_dim, intermediate_size=layer["down"].shape[1], rms_norm_eps=engine.eps,
                   qkv_bias=layer["qkv_bias"] is not None, qk_norm=layer["q_norm"] is not None,
                   vocab_size=engine.vocab_size)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer (attention with RoPE + SwiGLU MLP); parameter names follow
    bench.core.engine's fused layout, so a target layer copies in directly."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        d, hd = shape.hidden_size, shape.head_dim
        self.shape = shape
        qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * hd
        self.in_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Parameter(torch.randn(qkv_rows, d) * 0.02)
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_rows)) if shape.qkv_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd)) if shape.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd)) if shape.qk_norm else None
        self.o = nn.Parameter(torch.randn(d, shape.num_heads * hd) * 0.02)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Parameter(torch.randn(2 * shape.intermediate_size, d) * 0.02)
        self.down = nn.Parameter(torch.randn(d, shape.intermediate_size) * 0.02)

    def copy_from(self, engine_layer: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(engine_layer[name])

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [1, n, d] -> q [1, heads, n, hd], k and v [1, kv_heads, n, hd], RoPE applied."""
        s = self.shape
        n = x.shape[1]
        qkv = packed_linear(rms_norm(x, self.in_norm, s.rms_norm_eps), self.qkv, self.qkv_bias)
        q, k, v = qkv.split((s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                             s.num_kv_heads * s.head_dim), dim=-1)
        q = q.view(1, n, s.num_heads, s.head_dim).transpose(1, 2)
        k = k.view(1, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(1, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, s.rms_norm_eps), rms_norm(k, self.k_norm, s.rms_norm_eps)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """Residual attention output, then the MLP block: x [1, n, d], attn [1, heads, n, hd]."""
        attn = attn.transpose(1, 2).reshape(1, x.shape[1], -1)
        x = x + packed_linear(attn, self.o)
        gate, up = packed_linear(rms_norm(x, self.post_norm, self.shape.rms_norm_eps), self.gate_up).chunk(2, dim=-1)
        return x + packed_linear(F.silu(gate) * up, self.down)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.shape.head_dim ** -0.5, enable_gqa=True)

    def causal(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Training: the whole window at once, x [1, n, d]."""
        q, k, v = self.project(x, cos, sin)
        return self.finish(x, self.attend(q, k, v, causal=True))

    def cached(self, x: Tensor, positions: Tensor, cache: KVCache, rope: Rope) -> Tensor:
        """Decoding: n new rows x [n, d] after the cache's rows, which they all see."""
        n, start = x.shape[0], cache.length
        total = start + n
        cache.reserve(total)
        cos, sin = rope(positions)
        q, k, v = self.project(x[None], cos, sin)
        cache.k[0, :, :, start:total] = k
        cache.v[0, :, :, start:total] = v
        mask = None
        if n > 1:
            mask = torch.ones(n, total, dtype=torch.bool, device=x.device)
            mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        attn = self.attend(q, cache.k[0, :, :, :total], cache.v[0, :, :, :total], mask)
        cache.length = total
        return self.finish(x[None], attn)[0]

    def new_cache(self, dtype: torch.dtype, device: torch.device, capacity: int = 1024) -> KVCache:
        return KVCache(1, self.shape.num_kv_heads, self.shape.head_dim, capacity, dtype, device)


class SequentialMTP(nn.Module):
    """DeepSeek-V3-style module: fuse (next token, feature) -> one layer -> final norm.

    Parameter names map to DeepSeek-V3's `model.layers.{L}.*`: norm_e = enorm, norm_h = hnorm,
    proj = eh_proj, layer = the decoder layer, final_norm = shared_head.norm (the layouts in
    methods/mtp/layouts.py name the others)."""

    def __init__(self, shape: LayerShape, fuse_order: str = FUSE_ORDERS[0]) -> None:
        super().__init__()
        if fuse_order not in FUSE_ORDERS:
            raise ValueError(f"fuse_order must be one of {FUSE_ORDERS}, got {fuse_order!r}")
        d = shape.hidden_size
        self.shape = shape
        self.fuse_order = fuse_order
        self.norm_h = nn.Parameter(torch.ones(d))
        self.norm_e = nn.Parameter(torch.ones(d))
        self.proj = nn.Parameter(torch.empty(d, 2 * d))
        nn.init.kaiming_uniform_(self.proj, a=math.sqrt(5))  # nn.Linear's default
        self.layer = DecoderLayer(shape)
        self.final_norm = nn.Parameter(torch.ones(d))

    def fuse(self, feature: Tensor, embedding: Tensor) -> Tensor:
        """proj([RMSNorm(embedding); RMSNorm(feature)]), halves in `fuse_order`."""
        eps = self.shape.rms_norm_eps
        e, h = rms_norm(embedding, self.norm_e, eps), rms_norm(feature, self.norm_h, eps)
        return packed_linear(torch.cat([e, h] if self.fuse_order == "embedding_first" else [h, e], -1), self.proj)

    def out(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.final_norm, self.shape.rms_norm_eps)


class ParallelHead(nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.layer = DecoderLayer(shape)
        self.final_norm = nn.Parameter(torch.ones(shape.hidden_size))

    def out(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.final_norm, self.layer.shape.rms_norm_eps)


class ParallelMTP(nn.Module):
    """Gloeckle-style heads: head k (1-based) at position t predicts x_{t+1+k}."""

    def __init__(self, shape: LayerShape, num_heads: int) -> None:
        super().__init__()
        self.shape = shape
        self.heads = nn.ModuleList(ParallelHead(shape) for _ in range(num_heads))


def new_model(variant: str, shape: LayerShape, heads: int = 3, fuse_order: str = FUSE_ORDERS[0]) -> nn.Module:
    """An untrained module of `variant` (one of VARIANTS; anything else is parallel)."""
    if variant == "sequential":
        return SequentialMTP(shape, fuse_order)
    return ParallelMTP(shape, heads)


def ttt_mask(rows: int, step: int, device: torch.device | None = None) -> Tensor:
    """Visibility of step-`step` (0-based) queries over the keys of steps 0..step, laid out
    [step-0 keys | step-1 keys | ...]: row r sees step-0 rows <= r-step (the context a
    chain rooted at row r-step has) and, for i = 1..step, step-i row r-step+i (its chain)."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(rows, device=device)[None]
    return torch.cat([c <= r - step] + [c == r - step + i for i in range(1, step + 1)], dim=1)


def chained_outputs(model: SequentialMTP, features: Tensor, embeddings: Tensor, cos: Tensor, sin: Tensor,
                    steps: int) -> Tensor:
    """Training-time recursion over one window. Row r takes (features[r], embeddings[r]) at
    step 0 and (step k-1's output at row r-1, embeddings[r]) at step k. Returns the normed
    outputs [steps, rows, d]; step k row r is valid for r >= k."""
    rows = features.shape[0]
    keys, values, outs = [], [], []
    inputs = features
    for step in range(steps):
        if step:  # row 0 has no previous row: a placeholder, never valid, never seen by valid rows
            inputs = torch.cat([outs[-1][:1], outs[-1][:-1]])
        x = model.fuse(inputs, embeddings)[None]
        q, k, v = model.layer.project(x, cos, sin)
        keys.append(k)
        values.append(v)
        if step == 0:
            attn = model.layer.attend(q, k, v, causal=True)
        else:
            mask = ttt_mask(rows, step, x.device)
            attn = model.layer.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        outs.append(model.out(model.layer.finish(x, attn)[0]))
    return torch.stack(outs)

