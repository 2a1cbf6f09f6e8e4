"""The EAGLE draft head: one Llama decoder layer that runs on target features.

EAGLE-1 (2401.15077): input at position t is fc([Emb(x_{t+1}); f_t]) where f_t is the
target's final normed hidden state; the layer's output is a predicted f_{t+1}, and the
target's own lm_head turns it into the distribution of x_{t+2}.

EAGLE-3 (2503.01840): the feature is g_t = fc([h_low; h_mid; h_high]) (three target
layers); attention reads [norm(Emb(x_{t+1})); norm(g_t)] (2d wide); the output goes
through the head's own norm and lm_head, optionally over a reduced draft vocabulary
(`draft_vocab`: draft id -> target id). Later draft steps feed back the layer's own
output instead of g.

The same module serves decode time (batch 1, its own KV cache, tree masks) and training
(batched sequences, `forward_train`, or the training-time-test attention of EAGLE-3 in
methods/eagle/training.py). The target's embedding and lm_head are passed in, never stored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        eagle3 = config.kind == "eagle3"
        self.fc = nn.Linear(len(config.taps) * d if eagle3 else 2 * d, d, bias=not eagle3)
        attn_in = 2 * d if eagle3 else d
        self.q_proj = nn.Linear(attn_in, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(attn_in, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(attn_in, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.post_norm = nn.Parameter(torch.ones(d))
        if eagle3:
            self.embed_norm = nn.Parameter(torch.ones(d))
            self.final_norm = nn.Parameter(torch.ones(d))
            self.lm_head = nn.Linear(d, config.draft_vocab_size or config.vocab_size, bias=False)
            # draft id -> target id (identity when the draft vocabulary is the full one)
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size or config.vocab_size))
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
        if self.config.kind == "eagle3":
            return self.fc(torch.cat(taps, dim=-1))
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
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, c.num_heads, c.head_dim).transpose(-2, -3)
        k = self.k_proj(x).view(*shape, c.num_kv_heads, c.head_dim).transpose(-2, -3)
        v = self.v_proj(x).view(*shape, c.num_kv_heads, c.head_dim).transpose(-2, -3)
        cos, sin = self.rope(positions)
        cos, sin = cos.unsqueeze(-3).to(q.dtype), sin.unsqueeze(-3).to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def finish(self, hidden: Tensor, attn: Tensor) -> Tensor:
        """Residual + o_proj, then the MLP block. attn [.., H, n, hd]."""
        c = self.config
        attn = attn.transpose(-2, -3).flatten(-2)
        h = hidden + self.o_proj(attn)
        x = rms_norm(h, self.post_norm, c.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, out: Tensor, target_lm_head: Tensor) -> Tensor:
        """Draft logits: over the target vocabulary (EAGLE-1: the target's lm_head on the
        predicted feature) or over the draft vocabulary (EAGLE-3: own norm and head)."""
        if self.config.kind == "eagle3":
            return self.lm_head(rms_norm(out, self.final_norm, self.config.rms_norm_eps))
        return F.linear(out, target_lm_head)

    # --------------------------------------------------------- decode time
    def new_cache(self) -> KVCache:
        """The head's own KV cache (one layer): context rows first, then any tree rows."""
        weight = self.q_proj.weight
        return KVCache(1, self.config.num_kv_heads, self.config.head_dim, 256, weight.dtype, weight.device)

    @torch.inference_mode()
    def step(self, hidden: Tensor, embeds: Tensor, positions: Tensor, cache: KVCache,
             mask: Tensor | None = None) -> Tensor:
        """Run n rows at `positions`, appending their K/V to `cache`. Each row sees every
        earlier cache row plus, within the block, what `mask` [n, n] allows (causal if None).
        hidden: the residual input [n, d] (fused features, or a previous step's output)."""
        n = hidden.shape[0]
        q, k, v = self.qkv(hidden[None], embeds[None], positions)
        start = cache.length
        cache.append([(k, v)])
        total = cache.length
        block = mask if mask is not None else torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
        full = torch.ones(n, total, dtype=torch.bool, device=hidden.device)
        full[:, start:] = block
        attn = F.scaled_dot_product_attention(q, *cache.view(0), attn_mask=full,
                                              scale=1 / math.sqrt(self.config.head_dim), enable_gqa=True)
        return self.finish(hidden[None], attn)[0]

    # ------------------------------------------------------------ training
    def forward_train(self, hidden: Tensor, embeds: Tensor, positions: Tensor) -> Tensor:
        """Causal pass over batched sequences [B, T, d] (right padding is harmless)."""
        q, k, v = self.qkv(hidden, embeds, positions)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(self.config.head_dim),
                                              enable_gqa=True)
        return self.finish(hidden, attn)
