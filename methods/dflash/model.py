"""The block drafter shared by DFlash, DDTree and DSpark.

Backbone (DFlash, Chen et al. 2602.06036; z-lab/dflash `dflash/model.py`): N non-causal
Qwen3-style decoder layers that denoise a block [anchor, MASK x (B-1)] in one pass. The
context is the target's hidden states at the committed tokens, tapped from several layers,
fused by fc + RMSNorm (`hidden_norm`) and injected as extra keys/values into every draft
layer (each layer's own k/v projections of the fused context, with its k_norm and RoPE at
the committed positions); queries come from the block only, which attends to the whole
context and to itself in both directions.

Conventions (z-lab's by default; what a drafter follows is in its config):
- `sample_from_anchor=False` (z-lab, speculators dflash): slot 0 holds the anchor (the last
  committed token, whose features the target has not computed yet) and each mask slot i
  (1..B-1, at position anchor+i) predicts the token at its own position: B-1 drafts.
  `sample_from_anchor=True` (DSpark paper, DeepSpec, speculators dspark; our drafters from
  before the z-lab convention): slot i predicts the token at anchor+i+1, B drafts.
- The mask slots' input is the target's embedding of `mask_token_id` (times
  `input_embedding_scale`, as the anchor's). Drafters from before it learned one vector
  (`mask_token_id=None`, the weight `mask_embed`).
- `qk_norm`: per-head RMSNorm of queries and keys (context keys included) before RoPE,
  as Qwen3; False only for our drafters from before the z-lab convention.
- Taps in HF `hidden_states` numbering (z-lab's `target_layer_ids` + 1): by default
  `zlab_taps(L, N)`, N draft layers spread over target layers [1, L-3].
- Logits: the target's lm_head (rows of an optional reduced draft vocabulary, as
  speculators' d2t), times `output_multiplier`, with an optional tanh softcap.

DSpark (Cheng et al. 2607.05147; names as speculators' `models/dspark`) adds two light heads:
- Markov head: logits_i = U_i + W2 W1[x_{i-1}] (`markov_head.markov_w1`, `.markov_w2`;
  x_{-1} = the anchor), a rank-r bigram correction applied position by position, so a
  sampled draft's q is exact;
- confidence head: c_i = sigmoid(proj [h_i; W1[x_{i-1}]]) (`confidence_head.proj`; without
  the Markov part when `confidence_head_with_markov` is off), the predicted chance that
  slot i survives verification given that the slots before it did.

The target's embedding and lm_head are shared, never stored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bench.core.cpu_kernels import PackedLinear
from bench.core.cpu_kernels import linear as packed_linear
from bench.core.engine import rms_norm, rotate_half
from methods.eagle.model import layer_shape

ZLAB = "z-lab"  # [anchor, MASK x (B-1)], B-1 drafts, q/k-norm, the target's mask-token embedding
ANCHOR_DRAFTS = "sample_from_anchor"  # the same, but the anchor slot drafts too: B drafts (DSpark paper)
LEGACY = "legacy"  # our drafters before the z-lab convention: anchor drafts, learned MASK vector, no q/k-norm

# The named deviations from z-lab's architecture (BlockConfig); no published layout holds them.
DEVIATIONS = ("tap_norm", "learned_mask", "anchor_context", "anchor_embedding")

# What a drafter config written before these fields existed followed (absent = old convention).
LEGACY_DEFAULTS = {"sample_from_anchor": True, "qk_norm": False, "mask_token_id": None}


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
    block_size: int = 16  # input slots per block, the anchor's included
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    sample_from_anchor: bool = False  # False: z-lab (B-1 drafts); True: the anchor slot drafts too (B drafts)
    qk_norm: bool = True  # per-head q/k RMSNorm before RoPE (z-lab, Qwen3)
    mask_token_id: int | None = None  # the mask slots' token (None: a learned vector, legacy drafters only)
    draft_vocab_size: int | None = None  # rows of the target's lm_head the drafter scores (None = all)
    rope_scaling: dict | None = None  # a non-default RoPE (transformers' rope_parameters beside rope_theta)
    input_embedding_scale: float = 1.0  # z-lab's optional scale of the block's embeddings
    output_multiplier: float = 1.0  # z-lab's optional logit multiplier
    final_logit_softcapping: float | None = None  # z-lab's optional tanh softcap of the logits
    markov_rank: int = 0  # DSpark's Markov head rank (0 = off: DFlash)
    enable_confidence_head: bool = False  # DSpark's confidence head
    confidence_head_with_markov: bool = True  # the confidence head also reads W1[x_{i-1}]
    # Named deviations from z-lab's recipe (off in every reference; kept where an ablation
    # justified them): an RMSNorm per tap before the fc (the taps' scales differ tenfold on
    # SmolLM2, as EAGLE-3's `fc_norm`), and the mask slots' input as a learned vector that
    # starts at the target's embedding of mask_token_id (`mask_embed`); and `anchor_context`:
    # every block slot's input adds the fused context row of position a-1, the one EAGLE-1
    # fuses with the anchor token, instead of reaching it only through attention; and
    # `anchor_embedding`: every mask slot's input adds the anchor token's embedding too.
    tap_norm: bool = False
    learned_mask: bool = False
    anchor_context: bool = False
    anchor_embedding: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, target_config, taps: list[int], **kwargs) -> BlockConfig:
        if "confidence" in kwargs:  # the field's name before speculators' naming
            kwargs["enable_confidence_head"] = kwargs.pop("confidence")
        return cls(taps=list(taps), **layer_shape(target_config), **kwargs)

    @classmethod
    def from_architecture(cls, arch: dict) -> BlockConfig:
        """The config of a drafter.json `architecture`; fields written before the z-lab
        convention existed are absent there and mean the old convention."""
        arch = dict(arch)
        if "confidence" in arch:
            arch["enable_confidence_head"] = arch.pop("confidence")
        for key, value in LEGACY_DEFAULTS.items():
            arch.setdefault(key, value)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(arch) - known)
        if unknown:
            raise TypeError(f"unknown field '{unknown[0]}'")
        return cls(**arch)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def first_draft_slot(self) -> int:
        """The slot whose hidden state gives the first draft: 1 (z-lab) or 0 (anchor drafts)."""
        return 0 if self.sample_from_anchor else 1

    @property
    def convention(self) -> str:
        if self.mask_token_id is None or not self.qk_norm:
            return LEGACY
        return ANCHOR_DRAFTS if self.sample_from_anchor else ZLAB

    def describe(self) -> dict:
        """The convention in a run record's drafter info."""
        return {"convention": self.convention, "sample_from_anchor": self.sample_from_anchor,
                "qk_norm": self.qk_norm, "mask_token_id": self.mask_token_id, "block_size": self.block_size,
                "drafts_per_block": self.drafts_per_block, "taps": list(self.taps), "num_layers": self.num_layers,
                "draft_vocab_size": self.draft_vocab_size, "markov_rank": self.markov_rank,
                "enable_confidence_head": self.enable_confidence_head,
                **{k: True for k in DEVIATIONS if getattr(self, k)}}


def zlab_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """z-lab's `build_target_layer_ids`: `count` target layers spread evenly over [1, L-3]
    (Python's round, so halves go to the even neighbour), L//2 alone when count is 1.
    These are decoder-layer indices; the features are hidden_states[id + 1]."""
    if count == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (count - 1)) for i in range(count)]


def zlab_taps(num_target_layers: int, count: int) -> list[int]:
    """The default taps in HF hidden_states numbering (SmolLM2, L=30, 3 layers: 2, 15, 28)."""
    return [i + 1 for i in zlab_layer_ids(num_target_layers, count)]


def block_taps(num_layers: int, count: int = 5) -> list[int]:
    """Our taps before the z-lab convention (kept for scripts and old drafters' docs): `count`
    taps evenly spaced from EAGLE-3's low tap (2) to L-3, rounded up (L=30: 2, 9, 15, 21, 27)."""
    if count == 1:
        return [num_layers - 3]
    return [math.ceil(2 + i * (num_layers - 5) / (count - 1)) for i in range(count)]


def default_mask_token_id(tokenizer, vocab_size: int) -> int | None:
    """A mask token for a target without a trained one: the tokenizer's mask token; else the
    first embedding row past the tokenizer's vocabulary (z-lab's choice for Qwen3, 151669);
    else, for SmolLM2's tokenizer (49152 ids, all used, no mask token), id 16 `<empty_output>`:
    a StarCoder2 Jupyter-notebook marker that the chat template and chat data never produce,
    and not an EOS or chat-control token. None when none of these applies."""
    mask = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask, int) and 0 <= mask < vocab_size:
        return mask
    size = len(tokenizer)
    if size < vocab_size:
        return size
    if tokenizer.convert_ids_to_tokens(16) == "<empty_output>":
        return 16
    return None


def rope_frequencies(config: BlockConfig) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention scaling), as transformers' Qwen3 rotary class."""
    hd = config.head_dim
    if not config.rope_scaling:
        return 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)), 1.0
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = Qwen3Config(hidden_size=config.hidden_size, num_attention_heads=config.num_heads, head_dim=hd,
                     rope_parameters={"rope_theta": config.rope_theta, **config.rope_scaling})
    rotary = Qwen3RotaryEmbedding(hf)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: BlockConfig) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.q_proj = PackedLinear(d, c.num_heads * hd, bias=False)
        self.k_proj = PackedLinear(d, c.num_kv_heads * hd, bias=False)
        self.v_proj = PackedLinear(d, c.num_kv_heads * hd, bias=False)
        self.o_proj = PackedLinear(c.num_heads * hd, d, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps)
            self.k_norm = RMSNorm(hd, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: BlockConfig) -> None:
        super().__init__()
        self.gate_proj = PackedLinear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = PackedLinear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = PackedLinear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlockLayer(nn.Module):
    """One Qwen3-shaped decoder layer whose attention also reads injected context K/V."""

    def __init__(self, c: BlockConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MarkovHead(nn.Module):
    """B(x_{i-1}) = W2 W1[x_{i-1}]: W1 indexed by target ids, W2 onto the draft vocabulary."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = PackedLinear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.proj = PackedLinear(features, 1)


# Weight names of drafters saved before the z-lab layout (legacy drafter folders).
_LEGACY_NAMES = {"context_norm": "hidden_norm.weight", "final_norm": "norm.weight",
                 "markov_in.weight": "markov_head.markov_w1.weight",
                 "markov_out.weight": "markov_head.markov_w2.weight",
                 "confidence_head.weight": "confidence_head.proj.weight",
                 "confidence_head.bias": "confidence_head.proj.bias"}
_LEGACY_LAYER_NAMES = {"input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
                       **{f"{n}_proj.weight": f"self_attn.{n}_proj.weight" for n in "qkvo"},
                       **{f"{n}_proj.weight": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}}


def upgrade_legacy_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A legacy drafter's weights under today's names (already-current names pass through)."""
    out = {}
    for name, tensor in state.items():
        parts = name.split(".", 2)
        if name in _LEGACY_NAMES:
            name = _LEGACY_NAMES[name]
        elif len(parts) == 3 and parts[0] == "layers" and parts[2] in _LEGACY_LAYER_NAMES:
            name = f"layers.{parts[1]}.{_LEGACY_LAYER_NAMES[parts[2]]}"
        out[name] = tensor
    return out


def block_diagonal_attention(q: Tensor, context_k: Tensor, context_v: Tensor, k: Tensor, v: Tensor,
                             context_visible: Tensor, block: int, scale: float) -> Tensor:
    """Attention of training's side-by-side blocks: q [B, H, n, hd] (n = A blocks of `block`
    slots), context keys/values [B, Hkv, T, hd], the blocks' own keys/values [B, Hkv, n, hd];
    a slot sees the context where context_visible [B, n, T] and every slot of its own block.
    The same result as SDPA over [context; all blocks] with the block-diagonal mask, without
    scoring the other A - 1 blocks' keys (most of the keys, all masked); grouped query heads
    share their key head as SDPA's enable_gqa does. Returns [B, H, n, hd]."""
    size, heads, n, hd = q.shape
    kv_heads, width = k.shape[1], context_k.shape[2]
    group, blocks = heads // kv_heads, n // block
    grouped = q.reshape(size, kv_heads, group * n, hd)  # q head h uses key head h // group
    on_context = (grouped @ context_k.transpose(-1, -2)).view(size, heads, n, width) * scale
    on_context = on_context.masked_fill(~context_visible[:, None], float("-inf"))
    per_block = q.reshape(size, kv_heads, group, blocks, block, hd)
    on_block = (per_block @ k.reshape(size, kv_heads, 1, blocks, block, hd).transpose(-1, -2)) * scale
    weights = torch.cat([on_context, on_block.reshape(size, heads, n, block)], dim=-1).float().softmax(-1)
    weights = weights.to(q.dtype)
    from_context = weights[..., :width].reshape(size, kv_heads, group * n, width) @ context_v
    from_block = weights[..., width:].reshape(size, kv_heads, group, blocks, block, block) \
        @ v.reshape(size, kv_heads, 1, blocks, block, hd)
    return (from_context.view(size, heads, n, hd) + from_block.reshape(size, heads, n, hd))


class BlockDraftModel(nn.Module):
    def __init__(self, config: BlockConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = PackedLinear(len(config.taps) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        if config.tap_norm:
            self.tap_norms = nn.ModuleList(RMSNorm(d, config.rms_norm_eps) for _ in config.taps)
        if config.mask_token_id is None or config.learned_mask:  # a learned MASK input vector
            self.mask_embed = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        vocab = config.draft_vocab_size or config.vocab_size
        self.register_buffer("draft_to_target", torch.arange(vocab))  # draft id -> target id
        if config.markov_rank:
            self.markov_head = MarkovHead(config.vocab_size, vocab, config.markov_rank)
        if config.enable_confidence_head:
            with_markov = config.confidence_head_with_markov and config.markov_rank
            self.confidence_head = ConfidenceHead(d + (config.markov_rank if with_markov else 0))
        # Not a buffer: module.to(bfloat16) must not round the RoPE frequencies.
        self.inv_freq, self.rope_scale = rope_frequencies(config)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        if config.markov_rank:
            nn.init.zeros_(self.markov_head.markov_w2.weight)  # start as plain DFlash: no bigram correction

    # ------------------------------------------------------------ pieces
    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos.unsqueeze(-3), sin.unsqueeze(-3)  # [.., 1, n, hd]: broadcast over heads

    def _heads(self, x: Tensor, count: int) -> Tensor:
        return x.view(*x.shape[:-1], count, self.config.head_dim).transpose(-2, -3)

    def _keys(self, layer: BlockLayer, h: Tensor) -> Tensor:
        k = self._heads(layer.self_attn.k_proj(h), self.config.num_kv_heads)
        return layer.self_attn.k_norm(k) if self.config.qk_norm else k

    def context(self, taps: list[Tensor]) -> Tensor:
        """Fused context features [.., n, d] from the tapped target states."""
        if self.config.tap_norm:
            taps = [norm(t) for norm, t in zip(self.tap_norms, taps)]
        return self.hidden_norm(self.fc(torch.cat(taps, dim=-1)))

    def context_kv(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's keys/values [.., Hkv, n, hd] of the fused context (k_norm, RoPE applied)."""
        cos, sin = self.rope(positions)
        kv = []
        for layer in self.layers:
            k = self._keys(layer, context)
            v = self._heads(layer.self_attn.v_proj(context), self.config.num_kv_heads)
            kv.append(((k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)), v))
        return kv

    def block_inputs(self, anchors: Tensor, embed: Tensor, slots: int, previous: Tensor | None = None) -> Tensor:
        """[.., slots, d]: the anchor's embedding, then the mask slots' (the target's embedding
        of mask_token_id, or the learned vector: a legacy drafter's, or `learned_mask`).
        With `anchor_context`, every slot adds `previous` [.., d], the fused context row of
        position a-1 (zeros where that row is withheld); with `anchor_embedding`, every mask
        slot adds the anchor's embedding."""
        dtype = self.fc.weight.dtype
        c = self.config
        first = F.embedding(anchors, embed).to(dtype)
        if c.mask_token_id is None:
            rest = self.mask_embed.expand(*anchors.shape, slots - 1, -1)
            return torch.cat([first.unsqueeze(-2), rest.to(dtype)], dim=-2)
        mask = self.mask_embed if c.learned_mask else embed[c.mask_token_id]
        rest = mask.to(dtype).expand(*anchors.shape, slots - 1, -1)
        if c.anchor_embedding:
            rest = rest + first.unsqueeze(-2)
        x = torch.cat([first.unsqueeze(-2), rest], dim=-2)
        x = x * c.input_embedding_scale if c.input_embedding_scale != 1.0 else x
        if c.anchor_context:
            if previous is None:
                raise ValueError("an anchor_context drafter needs the context row of position a-1")
            x = x + previous.to(dtype).unsqueeze(-2)
        return x

    def forward_block(self, x: Tensor, positions: Tensor, context_kv: list[tuple[Tensor, Tensor]],
                      mask: Tensor | None = None, context_visible: Tensor | None = None,
                      checkpoint_layers: bool = False) -> Tensor:
        """Run the block x [.., n, d] at `positions` [.., n] through every layer; keys are
        [context; block]. `mask` [.., 1, n, ctx + n] (None: everything visible). Training's
        layout instead: x holds n / block_size blocks side by side, each slot sees its own
        block and the context where `context_visible` [B, n, ctx] (block_diagonal_attention).
        `checkpoint_layers`: keep only each layer's input for the backward pass and recompute
        the rest there (the attention scores of many blocks over the context are the bulk).
        Returns the final normed hidden states [.., n, d]."""
        cos, sin = self.rope(positions)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            inputs = (layer, x, cos, sin, context_k, context_v, mask, context_visible)
            if checkpoint_layers and torch.is_grad_enabled():
                x = checkpoint(self._layer, *inputs, use_reentrant=False)
            else:
                x = self._layer(*inputs)
        return self.norm(x)

    def _layer(self, layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, context_k: Tensor, context_v: Tensor,
               mask: Tensor | None, context_visible: Tensor | None) -> Tensor:
        c = self.config
        attn_mod = layer.self_attn
        h = layer.input_layernorm(x)
        q = self._heads(attn_mod.q_proj(h), c.num_heads)
        if c.qk_norm:
            q = attn_mod.q_norm(q)
        k = self._keys(layer, h)
        v = self._heads(attn_mod.v_proj(h), c.num_kv_heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if context_visible is not None:
            attn = block_diagonal_attention(q, context_k.to(k.dtype), context_v.to(v.dtype), k, v,
                                            context_visible, c.block_size, c.head_dim ** -0.5)
        else:
            keys = torch.cat([context_k.to(k.dtype), k], dim=-2)
            values = torch.cat([context_v.to(v.dtype), v], dim=-2)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=c.head_dim ** -0.5,
                                                  enable_gqa=True)
        x = x + attn_mod.o_proj(attn.transpose(-2, -3).flatten(-2))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden: Tensor, lm_head: Tensor) -> Tensor:
        """U_i over the draft vocabulary (fp32) from `lm_head` [Vd, d] (the target's rows)."""
        c = self.config
        logits = packed_linear(hidden, lm_head).float()
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def markov_state(self, previous: Tensor) -> Tensor:
        """W1[x_{i-1}] for previous tokens (target ids)."""
        return self.markov_head.markov_w1(previous)

    def markov_bias(self, state: Tensor) -> Tensor:
        return self.markov_head.markov_w2(state)

    def confidence_logit(self, hidden: Tensor, state: Tensor | None) -> Tensor:
        """Logit of c_i from the slot's hidden state (and the Markov state when the head reads it)."""
        c = self.config
        if state is not None and c.confidence_head_with_markov:
            hidden = torch.cat([hidden, state.to(hidden.dtype)], dim=-1)
        return self.confidence_head.proj(hidden).squeeze(-1)
