"""The EAGLE draft head: one Llama decoder layer that runs on target features.

EAGLE-1 (2401.15077): input at position t is fc([Emb(x_{t+1}); f_t]) where f_t is the
target's final normed hidden state; the layer's output is a predicted f_{t+1}, and the
target's own lm_head turns it into the distribution of x_{t+2}.

EAGLE-3 (2503.01840): the feature is g_t = fc([h_low; h_mid; h_high]) (three target
layers); attention reads [norm(Emb(x_{t+1})); norm(g_t)] (2d wide); the output goes
through the head's own norm and lm_head, optionally over a reduced draft vocabulary
(`draft_vocab`: draft id -> target id). Later draft steps feed back the layer's own
output instead of g.

Published variants, as config flags that are all off for the heads trained here (so those
compute exactly what they did before the flags existed): more decoder layers after the
first (`num_layers`; plain Llama layers with their own input norm, as speculators' and
vLLM's EAGLE-3), q/k/v and o biases, Qwen3's per-head q/k norms, and for EAGLE-3
`norm_before_residual` (the first layer's residual is the normed feature), `fc_norm` (an
RMSNorm per tap before fc), `norm_before_fc` (one RMSNorm over the concatenated taps) and
`norm_output` (the output is normed by the head's final norm, fed back normed and projected
without a second norm: speculators' "Eagle 3.1").

The same module serves decode time (batch 1, its own KV cache, tree masks) and training
(batched sequences, `forward_train`, or the training-time-test attention of EAGLE-3 in
methods/eagle/training.py). The target's embedding and lm_head are passed in, never stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.cpu_kernels import PackedLinear
from bench.core.cpu_kernels import linear as packed_linear
from bench.core.engine import KVCache, rms_norm, rotate_half


@dataclass
class EagleConfig:
    kind: str  # "eagle1" | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    taps: list[int]  # target layers read (HF hidden_states numbering)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    draft_vocab_size: int | None = None  # eagle3: own lm_head over this many tokens (None = full vocab)
    norm_hidden: bool = True  # eagle1: norm before attention (published EAGLE-1 heads have none)
    extra: dict = field(default_factory=dict)
    # Published variants (all off: the heads trained here).
    num_layers: int = 1  # decoder layers; those after the first are plain Llama layers
    qkv_bias: bool = False  # biases on q/k/v (Qwen2-style, or HF's attention_bias with o_bias)
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3 layers: RMSNorm over head_dim on q and k before RoPE
    norm_before_residual: bool = False  # eagle3: the first layer's residual is norm(g), not g
    fc_norm: bool = False  # eagle3: RMSNorm on each tap before fc
    norm_before_fc: bool = False  # eagle3: one RMSNorm over the concatenated taps before fc
    norm_output: bool = False  # eagle3: output = norm(layer output), fed back and projected as is
    # eagle3, a deviation: lm_head = the target's lm_head rows at draft_to_target, frozen and
    # not stored (the original trains its own rows); keeps the shipped drafters small.
    shared_lm_head: bool = False

    @classmethod
    def for_target(cls, target_config, kind: str, taps: list[int], draft_vocab_size: int | None = None) -> EagleConfig:
        return cls(kind=kind, taps=list(taps), draft_vocab_size=draft_vocab_size, **layer_shape(target_config))

    def to_dict(self) -> dict:
        return asdict(self)


def layer_shape(config) -> dict:
    """A draft layer shaped like the target's (an HF config): sizes, heads, RoPE base, norm eps."""
    heads = config.num_attention_heads
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size, "num_heads": heads,
            "num_kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "vocab_size": config.vocab_size, "rope_theta": rope_theta(config), "rms_norm_eps": config.rms_norm_eps}


def rope_theta(config) -> float:
    """RoPE base of an HF config (newer transformers keep it in rope_parameters)."""
    value = getattr(config, "rope_theta", None)
    if value is None:
        value = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(value)


Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]  # (layer, q, k, v) -> attention output


def _add_attention(module: nn.Module, config: EagleConfig, attn_in: int) -> None:
    """q/k/v/o projections (and Qwen3's q/k norms) of one layer, as attributes of `module`."""
    d, hd = config.hidden_size, config.head_dim
    module.q_proj = PackedLinear(attn_in, config.num_heads * hd, bias=config.qkv_bias)
    module.k_proj = PackedLinear(attn_in, config.num_kv_heads * hd, bias=config.qkv_bias)
    module.v_proj = PackedLinear(attn_in, config.num_kv_heads * hd, bias=config.qkv_bias)
    module.o_proj = PackedLinear(config.num_heads * hd, d, bias=config.o_bias)
    if config.qk_norm:
        module.q_norm = nn.Parameter(torch.ones(hd))
        module.k_norm = nn.Parameter(torch.ones(hd))


def _add_mlp(module: nn.Module, config: EagleConfig) -> None:
    d = config.hidden_size
    module.gate_proj = PackedLinear(d, config.intermediate_size, bias=False)
    module.up_proj = PackedLinear(d, config.intermediate_size, bias=False)
    module.down_proj = PackedLinear(config.intermediate_size, d, bias=False)


def _project(module: nn.Module, config: EagleConfig, x: Tensor, cos: Tensor,
             sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [.., H, n, hd], k and v [.., Hkv, n, hd] of `module`'s projections, RoPE applied."""
    shape = x.shape[:-1]
    q = module.q_proj(x).view(*shape, config.num_heads, config.head_dim)
    k = module.k_proj(x).view(*shape, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, module.q_norm, config.rms_norm_eps)
        k = rms_norm(k, module.k_norm, config.rms_norm_eps)
    q, k = q.transpose(-2, -3), k.transpose(-2, -3)
    v = module.v_proj(x).view(*shape, config.num_kv_heads, config.head_dim).transpose(-2, -3)
    cos, sin = cos.unsqueeze(-3).to(q.dtype), sin.unsqueeze(-3).to(q.dtype)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


def _mlp_block(module: nn.Module, h: Tensor, post_norm: Tensor, eps: float) -> Tensor:
    x = rms_norm(h, post_norm, eps)
    return h + module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))


class PlainLayer(nn.Module):
    """A decoder layer after the first: input norm, d-wide attention, MLP (a Llama layer)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.input_norm = nn.Parameter(torch.ones(d))
        _add_attention(self, config, d)
        self.post_norm = nn.Parameter(torch.ones(d))
        _add_mlp(self, config)

    def qkv(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _project(self, self.config, rms_norm(h, self.input_norm, self.config.rms_norm_eps), cos, sin)

    def finish(self, h: Tensor, attn: Tensor) -> Tensor:
        h = h + self.o_proj(attn.transpose(-2, -3).flatten(-2))
        return _mlp_block(self, h, self.post_norm, self.config.rms_norm_eps)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        eagle3 = config.kind == "eagle3"
        self.fc = PackedLinear(len(config.taps) * d if eagle3 else 2 * d, d, bias=not eagle3)
        _add_attention(self, config, 2 * d if eagle3 else d)
        _add_mlp(self, config)
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.post_norm = nn.Parameter(torch.ones(d))
        if eagle3:
            self.embed_norm = nn.Parameter(torch.ones(d))
            self.final_norm = nn.Parameter(torch.ones(d))
            self.lm_head = PackedLinear(d, config.draft_vocab_size or config.vocab_size, bias=False)
            # draft id -> target id (identity when the draft vocabulary is the full one)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size or config.vocab_size))
            if config.fc_norm:
                self.fc_norm = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in config.taps)
            if config.norm_before_fc:
                self.fc_input_norm = nn.Parameter(torch.ones(len(config.taps) * d))
        elif config.norm_output or config.fc_norm or config.norm_before_fc or config.norm_before_residual:
            raise ValueError("norm_output, fc_norm, norm_before_fc and norm_before_residual are EAGLE-3 flags")
        if config.num_layers > 1:
            self.extra_layers = nn.ModuleList(PlainLayer(config) for _ in range(config.num_layers - 1))
        # Not a buffer: module.to(bfloat16) must not round the RoPE frequencies.
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # ------------------------------------------------------------ pieces
    def fuse(self, taps: list[Tensor], embeds: Tensor) -> Tensor:
        """The layer's residual input at step 0: fc([Emb; f]) (EAGLE-1) or fc(taps) (EAGLE-3)."""
        c = self.config
        if c.kind == "eagle3":
            if c.fc_norm:
                taps = [rms_norm(t, w, c.rms_norm_eps) for t, w in zip(taps, self.fc_norm)]
            x = torch.cat(taps, dim=-1)
            if c.norm_before_fc:
                x = rms_norm(x, self.fc_input_norm, c.rms_norm_eps)
            return self.fc(x)
        return self.fc(torch.cat([embeds, taps[0]], dim=-1))

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def qkv(self, hidden: Tensor, embeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [.., H, n, hd], k and v [.., Hkv, n, hd] with RoPE. hidden/embeds [.., n, d]."""
        c = self.config
        eps = c.rms_norm_eps
        if c.kind == "eagle3":
            x = torch.cat([rms_norm(embeds, self.embed_norm, eps), rms_norm(hidden, self.hidden_norm, eps)], dim=-1)
        elif c.norm_hidden:
            x = rms_norm(hidden, self.hidden_norm, eps)
        else:
            x = hidden
        cos, sin = self.rope(positions)
        return _project(self, c, x, cos, sin)

    def finish(self, hidden: Tensor, attn: Tensor) -> Tensor:
        """The first layer after attention: residual + o_proj, then the MLP block.
        attn [.., H, n, hd]; the residual is `hidden` (norm(hidden) with norm_before_residual)."""
        c = self.config
        attn = attn.transpose(-2, -3).flatten(-2)
        residual = rms_norm(hidden, self.hidden_norm, c.rms_norm_eps) if c.norm_before_residual else hidden
        h = residual + self.o_proj(attn)
        return _mlp_block(self, h, self.post_norm, c.rms_norm_eps)

    def run_layers(self, hidden: Tensor, embeds: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Every decoder layer on n rows; `attend(layer, q, k, v)` returns that layer's
        attention output (causal, cached or tree-masked: the caller's choice). The result is
        what the next draft step is fed and what `logits` projects."""
        q, k, v = self.qkv(hidden, embeds, positions)
        out = self.finish(hidden, attend(0, q, k, v))
        if self.config.num_layers > 1:
            cos, sin = self.rope(positions)
            for index, layer in enumerate(self.extra_layers, start=1):
                q, k, v = layer.qkv(out, cos, sin)
                out = layer.finish(out, attend(index, q, k, v))
        if self.config.norm_output:
            out = rms_norm(out, self.final_norm, self.config.rms_norm_eps)
        return out

    def logits(self, out: Tensor, target_lm_head: Tensor) -> Tensor:
        """Draft logits: over the target vocabulary (EAGLE-1: the target's lm_head on the
        predicted feature) or over the draft vocabulary (EAGLE-3: own norm and head)."""
        if self.config.kind == "eagle3":
            if self.config.norm_output:  # run_layers has normed it already
                return self.lm_head(out)
            return self.lm_head(rms_norm(out, self.final_norm, self.config.rms_norm_eps))
        return packed_linear(out, target_lm_head)

    # --------------------------------------------------------- decode time
    def new_cache(self) -> KVCache:
        """The head's own KV cache (a slot per layer): context rows first, then any tree rows."""
        weight = self.q_proj.weight
        return KVCache(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, 256, weight.dtype,
                       weight.device)

    @torch.inference_mode()
    def step(self, hidden: Tensor, embeds: Tensor, positions: Tensor, cache: KVCache,
             mask: Tensor | None = None, visible: Tensor | None = None, scale: float | None = None) -> Tensor:
        """Run n rows at `positions`, appending their K/V to `cache` (every layer). Each row
        sees every earlier cache row plus, within the block, what `mask` [n, n] allows
        (causal if None); or exactly the cache rows `visible` [n, cache rows + n] marks.
        hidden: the residual input [n, d] (fused features, or a previous step's output)."""
        n = hidden.shape[0]
        start = cache.length
        if visible is None:
            block = mask if mask is not None else torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
            visible = torch.ones(n, start + n, dtype=torch.bool, device=hidden.device)
            visible[:, start:] = block
        scale = 1 / math.sqrt(self.config.head_dim) if scale is None else scale
        cache.reserve(start + n)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # The rows go after the filled slots of this layer; the length moves once all are in.
            cache.k[layer, :, :, start: start + n] = k
            cache.v[layer, :, :, start: start + n] = v
            keys, values = cache.k[layer, :, :, : start + n], cache.v[layer, :, :, : start + n]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)

        out = self.run_layers(hidden[None], embeds[None], positions, attend)[0]
        cache.length = start + n
        return out

    # ------------------------------------------------------------ training
    def forward_train(self, hidden: Tensor, embeds: Tensor, positions: Tensor) -> Tensor:
        """Causal pass over batched sequences [B, T, d] (right padding is harmless)."""
        scale = 1 / math.sqrt(self.config.head_dim)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        return self.run_layers(hidden, embeds, positions, attend)
