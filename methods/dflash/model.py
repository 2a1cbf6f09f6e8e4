"""The block drafter shared by DFlash, DDTree and DSpark.

Backbone (DFlash, Chen et al. 2602.06036): N non-causal decoder layers that denoise a
block [anchor, MASK x (b-1)] in one pass. The context is the target's hidden states at
the committed tokens, tapped from several layers, fused by fc + RMSNorm, and injected
as extra keys/values into every draft layer (each layer's own k/v projections of the
fused context); queries come from the block only. The block attends to the whole
context and to itself in both directions.

Index convention (DeepSpec's, not z-lab/dflash's; methods/README.md): the anchor is the
last committed token (the root, whose features the target has not computed yet); slot i of
the block sits at position anchor+i and predicts the token at anchor+i+1. So b slots give
b drafts, the anchor slot included.

DSpark (Cheng et al. 2607.05147) adds two light heads on the same backbone:
- Markov head: logits_i = U_i + W2 W1[x_{i-1}] (x_{-1} = the anchor), a rank-r bigram
  correction applied position by position, so a sampled draft's q is exact;
- confidence head: c_i = sigmoid(w . [h_i; W1[x_{i-1}]]), the predicted chance that slot
  i survives verification given that the slots before it did.

The target's embedding and lm_head are shared, never stored: the drafter projects with
the target's lm_head rows of a reduced draft vocabulary (`draft_to_target`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.engine import rms_norm, rotate_half
from methods.eagle.model import layer_shape


@dataclass
class BlockConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    taps: list[int]  # target layers fused into the context (HF hidden_states numbering)
    num_layers: int = 3
    block_size: int = 16  # slots per block = drafts per round
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    draft_vocab_size: int | None = None  # rows of the target's lm_head the drafter scores (None = all)
    markov_rank: int = 0  # DSpark's Markov head rank (0 = off: DFlash)
    confidence: bool = False  # DSpark's confidence head
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, target_config, taps: list[int], **kwargs) -> BlockConfig:
        return cls(taps=list(taps), **layer_shape(target_config), **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


def block_taps(num_layers: int, count: int = 5) -> list[int]:
    """`count` taps evenly spaced from EAGLE-3's low tap (2) to L-3, rounded up
    (SmolLM2, L=30: 2, 9, 15, 21, 27; DFlash spaces its taps over [1, L-3])."""
    if count == 1:
        return [num_layers - 3]
    return [math.ceil(2 + i * (num_layers - 5) / (count - 1)) for i in range(count)]


class BlockLayer(nn.Module):
    """One Llama-shaped decoder layer whose attention also reads injected context K/V."""

    def __init__(self, c: BlockConfig) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)


class BlockDraftModel(nn.Module):
    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(len(config.taps) * d, d, bias=False)
        self.context_norm = nn.Parameter(torch.ones(d))
        self.mask_embed = nn.Parameter(torch.zeros(d))  # the MASK slot's input (the target has no mask token)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(d))
        vocab = config.draft_vocab_size or config.vocab_size
        self.register_buffer("draft_to_target", torch.arange(vocab))  # draft id -> target id
        if config.markov_rank:
            self.markov_in = nn.Embedding(config.vocab_size, config.markov_rank)  # W1, indexed by target id
            self.markov_out = nn.Linear(config.markov_rank, vocab, bias=False)  # W2
        if config.confidence:
            self.confidence_head = nn.Linear(d + config.markov_rank, 1)
        # Not a buffer: module.to(bfloat16) must not round the RoPE frequencies.
        hd = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        if config.markov_rank:
            nn.init.zeros_(self.markov_out.weight)  # start as plain DFlash: no bigram correction

    # ------------------------------------------------------------ pieces
    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().unsqueeze(-3), emb.sin().unsqueeze(-3)  # [.., 1, n, hd]: broadcast over heads

    def _heads(self, x: Tensor, count: int) -> Tensor:
        return x.view(*x.shape[:-1], count, self.config.head_dim).transpose(-2, -3)

    def context(self, taps: list[Tensor]) -> Tensor:
        """Fused context features [.., n, d] from the tapped target states."""
        return rms_norm(self.fc(torch.cat(taps, dim=-1)), self.context_norm, self.config.rms_norm_eps)

    def context_kv(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's keys/values [.., Hkv, n, hd] of the fused context (RoPE applied)."""
        cos, sin = self.rope(positions)
        kv = []
        for layer in self.layers:
            k = self._heads(layer.k_proj(context), self.config.num_kv_heads)
            v = self._heads(layer.v_proj(context), self.config.num_kv_heads)
            kv.append(((k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)), v))
        return kv

    def block_inputs(self, anchors: Tensor, embed: Tensor, slots: int) -> Tensor:
        """[.., slots, d]: the anchor's embedding, then MASK embeddings."""
        first = F.embedding(anchors, embed).to(self.mask_embed.dtype)
        rest = self.mask_embed.expand(*anchors.shape, slots - 1, -1)
        return torch.cat([first.unsqueeze(-2), rest], dim=-2)

    def forward_block(self, x: Tensor, positions: Tensor, context_kv: list[tuple[Tensor, Tensor]],
                      mask: Tensor | None = None) -> Tensor:
        """Run the block x [.., n, d] at `positions` [.., n] through every layer; keys are
        [context; block]. `mask` [.., 1, n, ctx + n] (None: everything visible).
        Returns the final normed hidden states [.., n, d]."""
        c = self.config
        eps = c.rms_norm_eps
        cos, sin = self.rope(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            h = rms_norm(x, layer.input_norm, eps)
            q = self._heads(layer.q_proj(h), c.num_heads)
            k = self._heads(layer.k_proj(h), c.num_kv_heads)
            v = self._heads(layer.v_proj(h), c.num_kv_heads)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys = torch.cat([context_k.to(k.dtype), k], dim=-2)
            values = torch.cat([context_v.to(v.dtype), v], dim=-2)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=c.head_dim ** -0.5,
                                                  enable_gqa=True)
            x = x + layer.o_proj(attn.transpose(-2, -3).flatten(-2))
            h = rms_norm(x, layer.post_norm, eps)
            x = x + layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
        return rms_norm(x, self.final_norm, eps)

    def markov_state(self, previous: Tensor) -> Tensor:
        """W1[x_{i-1}] for previous tokens (target ids)."""
        return self.markov_in(previous)

    def markov_bias(self, state: Tensor) -> Tensor:
        return self.markov_out(state)

    def confidence_logit(self, hidden: Tensor, state: Tensor | None) -> Tensor:
        """Logit of c_i from the slot's hidden state (and the Markov state when present)."""
        features = hidden if state is None else torch.cat([hidden, state.to(hidden.dtype)], dim=-1)
        return self.confidence_head(features).squeeze(-1)
