"""A compact Llama-family forward pass with a slot-addressed KV cache.

Every decoding method needs the same few operations from the target: prefill, a forward
of several new tokens at explicit positions under a tree mask, logits at every new
position, hidden states of chosen layers, and a way to keep only the accepted part of
what was just written to the KV cache. Driving HF modules through `past_key_values`
costs more Python per step than the model itself at this size, so the forward is
written out here (as in gpt-fast) and checked against HF's logits in the tests.

Conventions
- Batch size 1. Tokens are 1-D tensors. The cache has `length` filled slots; a forward
  of n tokens writes slots [length, length+n) and attends to all earlier slots plus,
  inside the new block, whatever `tree_mask` allows (causal when omitted).
- Hidden-state taps use HF's `hidden_states` numbering: tap 0 is the embedding output,
  tap l the output of decoder layer l-1, tap L (num layers) the final normed state.
- Batch-invariant passes (`invariant`, on by default in bf16/fp16): after the prefill,
  every row of a pass gets the bits it would get alone, so a k-token verification rounds
  exactly as the one-token AR step and greedy decoding in half precision stays
  token-exact. Two things differ with the number of rows otherwise: the attention kernel's
  blocking and the slots a tree row's ancestors sit in (here: fp64 attention over the cache
  padded to a multiple of SPAN_ALIGN slots, padding masked and zeroed, the same arithmetic
  for one row or many, and sums that do not depend on their order at bf16's resolution;
  fp32 sums did, for 7 of 20 random 24-node trees) and the GEMM kernel
  picked for large M (here: linears in chunks of at most PACK_ROWS rows on prepacked weights,
  INVARIANT_ROWS on plain ones, the largest M measured bitwise equal to M = 1, and prepacked
  reductions no longer than PACK_K: on an AVX512-BF16 CPU without AMX the packed GEMM over
  K = 1536 gave rows that changed with M, over K <= 1024 none did; tests/test_engine.py
  checks it on the machine at hand).
  Where this CPU builds them, the invariant passes run on bench.core.cpu_kernels instead:
  linears, attention and the layer's small ops in C++ whose rows are independent by
  construction, over a bf16 cache (no fp64, no row chunks, no column pieces).
- Prepacked weights: on the CPU in bf16 the linears run oneDNN's GEMM on weights reordered
  once at load (`F.linear` reorders them on every call, about half a one-token step here);
  the prefill keeps them with the kernels too (its many rows are GEMM work oneDNN does well).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.errors import BenchError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SPAN_ALIGN = 64  # invariant attention reads the cache in whole multiples of this many slots
INVARIANT_ROWS = 16  # invariant attention (and unpacked linears) run in chunks of at most this many rows
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # pass sizes with a fixed shape (CUDA graphs capture these)
PAD_TOKEN = 0  # token of bucket padding rows (any valid id: nothing in them reaches a real row)
ROPE_PRECOMPUTED = 131072  # RoPE tables are built once, up to the model's context limit or this
PACK_ROWS = 32  # bf16 CPU weights are prepacked for GEMMs of this many rows; invariant linears run in such chunks
PACK_K = 1024  # longer bf16 CPU reductions are split into packed pieces of at most this many columns, summed in fp32


def piece_width(columns: int) -> int:
    """Width of the equal column pieces, none longer than PACK_K, that a packed weight is cut into."""
    return -(-columns // -(-columns // PACK_K))


def aligned(slots: int) -> int:
    """`slots` rounded up to a whole multiple of SPAN_ALIGN."""
    return -(-slots // SPAN_ALIGN) * SPAN_ALIGN


@dataclass
class ForwardOutput:
    logits: Tensor  # [n, vocab] float32 (rows for the requested positions)
    hidden: dict[int, Tensor]  # tap -> [n, hidden]


class KVCache:
    """Preallocated K/V for every layer (batch 1); grows by doubling when a forward needs
    room. The target's cache, and the drafters' caches of their own layers."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, 1, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = aligned(max(needed, 2 * self.capacity))
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[:3] + (new_capacity, old.shape[4]))
            grown[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, grown)

    def append(self, kv: list[tuple[Tensor, Tensor]]) -> None:
        """Write n new rows after the filled slots: one (k, v) [1, heads, n, head_dim] per layer."""
        n = kv[0][0].shape[-2]
        self.reserve(self.length + n)
        for layer, (k, v) in enumerate(kv):
            self.k[layer, :, :, self.length: self.length + n] = k
            self.v[layer, :, :, self.length: self.length + n] = v
        self.length += n

    def view(self, layer: int) -> tuple[Tensor, Tensor]:
        """The filled K/V [1, heads, length, head_dim] of one layer."""
        return self.k[layer, :, :, : self.length], self.v[layer, :, :, : self.length]

    def crop(self, length: int) -> None:
        """Roll back to `length` filled slots (chain commit / rejection rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop cache of length {self.length} to {length}")
        self.length = length

    def keep(self, start: int, kept: list[int]) -> None:
        """Keep block rows `kept` (offsets from `start`, increasing) at slots start.. and
        drop the rest of the block: tree compaction. A prefix 0..m-1 is a plain crop."""
        if kept != list(range(len(kept))):
            src = torch.tensor(kept, device=self.k.device) + start
            dst = slice(start, start + len(kept))
            self.k[:, :, :, dst] = self.k[:, :, :, src]
            self.v[:, :, :, dst] = self.v[:, :, :, src]
        self.crop(start + len(kept))


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Same arithmetic as HF's LlamaRMSNorm: normalise in fp32, scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope_inv_freq(config) -> tuple[Tensor, float]:
    """Inverse frequencies from the model's own rotary class, so every RoPE variant that
    transformers knows (llama3, yarn, ...) matches it exactly."""
    module = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    rotary_cls = next(getattr(module, name) for name in dir(module)
                      if name.endswith("RotaryEmbedding") and not name.startswith("_"))
    rotary = rotary_cls(config=config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


class Engine:
    """Target model forward with KV cache; see the module docstring for conventions."""

    def __init__(self, config, state_dict: dict[str, Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, invariant: bool | None = None) -> None:
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise BenchError(
                f"architecture '{config.model_type}' is not supported by the engine "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        # Batch-invariant passes where greedy half-precision decoding is to stay token-exact: the
        # CPU. On CUDA passes run static (bench.core.static: captured graphs), audited for near ties.
        self.invariant = dtype != torch.float32 and self.device.type == "cpu" if invariant is None else invariant
        self.static_passes = None  # bench.core.static.StaticPasses once enabled (load_target does on CUDA)
        self._rows_limit: int | None = None  # INVARIANT_ROWS during an invariant pass
        # Passes after the prefill padded to VERIFY_BUCKETS rows: fixed shapes for captured
        # graphs on CUDA; off on the CPU, where padding only costs (tests turn it on there).
        self.buckets: tuple[int, ...] = VERIFY_BUCKETS if self.device.type == "cuda" else ()
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps
        self.scale = 1.0 / math.sqrt(self.head_dim)

        def w(name: str) -> Tensor:
            return state_dict[name].to(device=self.device, dtype=dtype).contiguous()

        def maybe(name: str) -> Tensor | None:
            return w(name) if name in state_dict else None

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in state_dict else self.embed
        self.final_norm = w("model.norm.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            # Fused projections: one matmul for q/k/v and one for gate/up.
            qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            biases = [maybe(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            self.layers.append({
                "in_norm": w(p + "input_layernorm.weight"),
                "qkv": qkv,
                "qkv_bias": torch.cat(biases) if biases[0] is not None else None,
                "q_norm": maybe(p + "self_attn.q_norm.weight"),
                "k_norm": maybe(p + "self_attn.k_norm.weight"),
                "o": w(p + "self_attn.o_proj.weight"),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                "down": w(p + "mlp.down_proj.weight"),
            })
        self._packed = self._pack_weights()
        # Row-invariant bf16 kernels for the passes after the prefill, where this CPU builds them.
        self.kernels = self._kernels()
        self._kernel_packed = ({id(w): (self.kernels.pack(w), w.shape[0]) for w in self._linear_weights()}
                               if self.kernels is not None else {})
        self.inv_freq, self.rope_scaling = _rope_inv_freq(config)
        self.inv_freq = self.inv_freq.to(self.device)
        self._rope_cos = self._rope_sin = None
        self._rope_tables(min(getattr(config, "max_position_embeddings", 4096) or 4096, ROPE_PRECOMPUTED))
        self.cache = self.new_cache()

    # ----------------------------------------------------------------- cache
    @property
    def cache_dtype(self) -> torch.dtype:
        """K/V storage: the model dtype, except on the invariant path without the CPU kernels,
        which keeps fp64 (exact copies of the rounded values) for its fp64 attention."""
        return torch.float64 if self.invariant and self.kernels is None else self.dtype

    def new_cache(self, capacity: int = 1024) -> KVCache:
        capacity = aligned(capacity)
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity,
                       self.cache_dtype, self.device)

    def reset(self, capacity: int = 1024) -> None:
        """Start a new sequence. Reuses the buffers when they are large enough."""
        if self.cache.capacity >= capacity and self.cache.k.dtype == self.cache_dtype:
            self.cache.length = 0
        else:
            self.cache = self.new_cache(capacity)

    def fork(self) -> Engine:
        """The same weights with a KV cache of its own (a draft model per batched request)."""
        import copy

        twin = copy.copy(self)
        twin.cache = self.new_cache(self.cache.capacity)
        if self.static_passes is not None:  # its passes are bound to its own cache
            twin.static_passes = type(self.static_passes)()
        return twin

    @property
    def length(self) -> int:
        return self.cache.length

    def keep(self, start: int, kept: list[int]) -> None:
        self.cache.keep(start, kept)

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    # ------------------------------------------------------------------ rope
    def _rope_tables(self, size: int) -> None:
        freqs = torch.arange(size, device=self.device, dtype=torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self._rope_cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        self._rope_sin = (emb.sin() * self.rope_scaling).to(self.dtype)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin at `positions`. The tables cover the model's context limit from the
        start; past it they grow, checked on the CPU only (a GPU check would be a host sync)."""
        if positions.device.type == "cpu" and int(positions.max()) >= self._rope_cos.shape[0]:
            self._rope_tables(2 * int(positions.max()) + 1)
        return self._rope_cos[positions], self._rope_sin[positions]

    # ------------------------------------------------------- layer pieces
    def _linear_weights(self) -> list[Tensor]:
        return [*(layer[name] for layer in self.layers for name in ("qkv", "o", "gate_up", "down")), self.lm_head]

    def _kernels(self):
        """bench.core.cpu_kernels for an invariant bf16 engine on the CPU, where they build."""
        if not (self.invariant and self.device.type == "cpu" and self.dtype == torch.bfloat16
                and self.head_dim % 16 == 0):
            return None
        from bench.core.cpu_kernels import kernels

        return kernels()

    def _pack_weights(self) -> dict[int, list[Tensor]]:
        """oneDNN-reordered copies of the linear weights (by the id of the plain tensor), for
        bf16 on the CPU, each in column pieces of at most PACK_K; empty elsewhere (fp32 keeps
        F.linear: its packed GEMM was no faster and not row-invariant here)."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return {}
        def pieces(w: Tensor) -> list[Tensor]:
            step = piece_width(w.shape[1])
            return [torch.ops.mkldnn._reorder_linear_weight(w[:, i:i + step].contiguous(), PACK_ROWS)
                    for i in range(0, w.shape[1], step)]

        return {id(w): pieces(w) for w in self._linear_weights()}

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [..., d] @ weight.T (+ bias), on the prepacked weight when there is one; during an
        invariant pass in chunks of rows small enough that each row's GEMM is the one a
        one-row pass runs (or, with the CPU kernels, in one call whose rows are independent)."""
        if self._rows_limit and id(weight) in self._kernel_packed and x.numel():
            packed, n = self._kernel_packed[id(weight)]
            out = self.kernels.linear(x, packed, n)
            return (out if bias is None else out + bias).to(x.dtype)
        packed = self._packed.get(id(weight))
        limit = self._rows_limit and (PACK_ROWS if packed is not None else self._rows_limit)
        if (packed is None and (limit is None or x.shape[-2] <= limit)) or x.numel() == 0:
            return F.linear(x, weight, bias)
        # 2-D rows: a sliced 3-D input would take the batched-matmul path, which copies the weight.
        rows = x.reshape(-1, x.shape[-1])
        limit = limit or rows.shape[0]
        gemm = F.linear if packed is None else self._packed_gemm
        parts = [gemm(rows[i:i + limit], packed or weight, bias) for i in range(0, rows.shape[0], limit)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def _packed_gemm(rows: Tensor, pieces: list[Tensor], bias: Tensor | None) -> Tensor:
        """rows @ W.T on W's packed column pieces: one GEMM, or the pieces' products summed in fp32."""
        def product(piece: Tensor, columns: Tensor, b: Tensor | None) -> Tensor:
            return torch.ops.mkldnn._linear_pointwise(columns, piece, b, "none", [], "")

        if len(pieces) == 1:
            return product(pieces[0], rows, bias)
        step, total = piece_width(rows.shape[1]), None
        for n, piece in enumerate(pieces):
            part = product(piece, rows[:, n * step:(n + 1) * step].contiguous(), bias if n == 0 else None).float()
            total = part if total is None else total.add_(part)
        return total.to(rows.dtype)

    def _fused(self, layer: dict) -> bool:
        """Whether this layer runs as the CPU kernels' two fused halves: inside an invariant
        pass, where they are built, for layers without per-head q/k norms."""
        return bool(self._rows_limit) and self.kernels is not None and layer["q_norm"] is None

    def attention_inputs(self, layer: dict, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [b, heads, n, head_dim] of x [b, n, d], RoPE applied (cos/sin broadcast
        to [b or 1, 1, n, head_dim])."""
        b, n, _ = x.shape
        if self._fused(layer):
            rows = b * n
            cos, sin = (t.expand(b, 1, n, self.head_dim).reshape(rows, self.head_dim) for t in (cos, sin))
            packed, width = self._kernel_packed[id(layer["qkv"])]
            q, k, v = self.kernels.layer_inputs(x.reshape(rows, -1), layer["in_norm"], packed, width,
                                                layer["qkv_bias"], cos, sin, self.num_heads, self.num_kv_heads,
                                                self.eps)
            return tuple(t.view(t.shape[0], b, n, self.head_dim).transpose(0, 1) for t in (q, k, v))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = rms_norm(x, layer["in_norm"], self.eps)
        q, k, v = self.linear(h, layer["qkv"], layer["qkv_bias"]).split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if layer["q_norm"] is not None:  # Qwen3 per-head norms, before RoPE
            q = rms_norm(q, layer["q_norm"], self.eps)
            k = rms_norm(k, layer["k_norm"], self.eps)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attention_output_and_mlp(self, layer: dict, x: Tensor, attn: Tensor) -> Tensor:
        """The rest of the layer: o-projection of attention output [b, heads, n, head_dim],
        residual, MLP, residual."""
        b, _, n, _ = attn.shape
        if self._fused(layer):
            rows = b * n
            attn = attn.transpose(1, 2).reshape(rows, self.num_heads * self.head_dim)
            gate_up, width = self._kernel_packed[id(layer["gate_up"])]
            out = self.kernels.layer_outputs(x.reshape(rows, -1), attn, self._kernel_packed[id(layer["o"])][0],
                                             layer["post_norm"], gate_up, width,
                                             self._kernel_packed[id(layer["down"])][0], self.eps)
            return out.view(b, n, -1)
        x = x + self.linear(attn.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim), layer["o"])
        h = rms_norm(x, layer["post_norm"], self.eps)
        gate, up = self.linear(h, layer["gate_up"]).chunk(2, dim=-1)
        return x + self.linear(F.silu(gate) * up, layer["down"])

    def invariant_attention(self, q: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
        """Attention of q [1, heads, n, head_dim] over fp64 keys and values [1, kv_heads,
        span, head_dim] (span a multiple of SPAN_ALIGN, slots past the filled ones zeroed),
        `visible` [n, span], in fp64 with one row's arithmetic independent of the others and
        of where its keys sit: the heads sharing a K/V head are stacked as rows of one matmul,
        masked scores are exact zeros after the softmax, and the sums' rounding is far below
        bf16's. With the CPU kernels: keys and values in bf16, scores and sums in fp32 in a
        fixed order per row (bench/core/kernels/cpu_bf16.cpp)."""
        if self.kernels is not None:
            return self.kernels.attention(q[0], keys[0], values[0], visible, self.scale)[None]
        n = q.shape[2]
        if n > INVARIANT_ROWS:  # the matmuls below pick other kernels for many rows too
            return torch.cat([self.invariant_attention(q[:, :, i:i + INVARIANT_ROWS], keys, values,
                                                       visible[i:i + INVARIANT_ROWS])
                              for i in range(0, n, INVARIANT_ROWS)], dim=2)
        _, heads, n, dim = q.shape
        group, span = heads // self.num_kv_heads, keys.shape[2]
        scores = torch.matmul(q.double().reshape(1, self.num_kv_heads, group * n, dim), keys.transpose(-1, -2))
        scores = (scores * self.scale).view(1, self.num_kv_heads, group, n, span)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).view(1, self.num_kv_heads, group * n, span)
        return torch.matmul(probs, values).view(1, heads, n, dim).to(q.dtype)

    @contextmanager
    def rows_limited(self, invariant: bool) -> Iterator[None]:
        """Inside: an invariant pass, whose linears run in row chunks a one-row pass shares."""
        self._rows_limit = INVARIANT_ROWS if invariant else None
        try:
            yield
        finally:
            self._rows_limit = None

    def decoder_layers(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Callable[..., Tensor],
                       taps: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """Every decoder layer over x [b, n, d]; attend(layer index, q, k, v) stores the layer's
        K/V where the caller keeps them and returns its attention output. Returns the last
        layer's output (before the final norm) and the tapped hidden states below it."""
        hidden = {0: x} if 0 in taps else {}
        for i, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, x, cos, sin)
            x = self.attention_output_and_mlp(layer, x, attend(i, q, k, v))
            if i + 1 in taps and i + 1 < self.num_layers:
                hidden[i + 1] = x
        return x, hidden

    def _kernel_layers(self, x: Tensor, cos: Tensor, sin: Tensor, start: int, visible: Tensor,
                       taps: tuple[int, ...]) -> tuple[Tensor, dict[int, Tensor]]:
        """decoder_layers for an invariant batch-1 pass on the CPU kernels: one call per layer
        (its norms, projections, RoPE, K/V write, attention and MLP), the same bits as the
        layer's fused halves with the attention between them."""
        hidden = {0: x} if 0 in taps else {}
        rows, packed = x[0], self._kernel_packed
        for i, layer in enumerate(self.layers):
            rows = self.kernels.layer_step(
                rows, layer["in_norm"], *packed[id(layer["qkv"])], layer["qkv_bias"], cos, sin, self.cache.k[i, 0],
                self.cache.v[i, 0], start, visible, self.scale, packed[id(layer["o"])][0], layer["post_norm"],
                *packed[id(layer["gate_up"])], packed[id(layer["down"])][0], self.num_heads, self.num_kv_heads,
                self.eps)
            if i + 1 in taps and i + 1 < self.num_layers:
                hidden[i + 1] = rows[None]
        return rows[None], hidden

    # --------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, tree_mask: Tensor | None = None,
                taps: tuple[int, ...] = (), logits_rows: str | Tensor = "all") -> ForwardOutput:
        """Run n new tokens, append their K/V at slots [length, length+n).

        positions: [n] RoPE positions (default: consecutive from `length`).
        tree_mask: [n, n] bool, row i may see column j of the new block (default causal), all
            earlier slots visible; or [n, length+n]: visibility over every slot.
        taps: hidden-state layers to return (HF numbering, see module docstring).
        logits_rows: "all", "last", "none" or an index tensor of rows to project.
        """
        tokens = tokens.to(self.device).reshape(-1)
        n = tokens.shape[0]
        start = self.cache.length
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        positions = positions.to(self.device)
        total = start + n
        mask = None
        is_causal = False
        if tree_mask is not None and tree_mask.shape[1] == total and total != n:
            mask = tree_mask.to(self.device)  # visibility over every slot (trees drafted level by level)
        elif tree_mask is not None:
            mask = torch.ones(n, total, dtype=torch.bool, device=self.device)
            mask[:, start:] = tree_mask.to(self.device)
        elif n > 1:
            if start == 0:
                is_causal = True
            else:
                mask = torch.ones(n, total, dtype=torch.bool, device=self.device)
                mask[:, start:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        padded = self.bucket(n) if self.buckets and start > 0 else n
        if self.static_passes is not None and start > 0 and not self.invariant and padded in self.buckets:
            visible = mask if mask is not None else torch.ones(n, total, dtype=torch.bool, device=self.device)
            return self.static_passes(self, tokens, positions, visible, padded, taps, logits_rows)
        if padded > n:  # padding rows: token PAD_TOKEN at the last row's position, each sees only itself
            extra = padded - n
            tokens = torch.cat([tokens, tokens.new_full((extra,), PAD_TOKEN)])
            positions = torch.cat([positions, positions[-1:].expand(extra)])
            full = torch.zeros(padded, start + padded, dtype=torch.bool, device=self.device)
            full[:n, :total] = True if mask is None else mask
            full[n:, total:] = torch.eye(extra, dtype=torch.bool, device=self.device)
            mask = full
        self.cache.reserve(start + padded)
        cos, sin = self.rope(positions)
        cos, sin = cos[None, None], sin[None, None]
        out = self._forward(tokens, positions, mask, is_causal, cos, sin, start, n, taps, logits_rows)
        self.cache.length = total
        return out

    def bucket(self, n: int) -> int:
        """The row count a pass of n rows is padded to (n itself past the largest bucket)."""
        return next((b for b in self.buckets if b >= n), n)

    def _forward(self, tokens: Tensor, positions: Tensor, mask: Tensor | None, is_causal: bool, cos: Tensor,
                 sin: Tensor, start: int, real: int, taps: tuple[int, ...], logits_rows: str | Tensor) -> ForwardOutput:
        """The layers over tokens [n] (the first `real` of them the caller's, the rest bucket
        padding, whose K/V are zeroed so nothing in them reaches a real row)."""
        n = tokens.shape[0]
        total = start + n
        invariant = self.invariant and start > 0  # the prefill is shared by every method: no need
        if invariant:
            span = aligned(total)  # within capacity: capacities are multiples of it
            self.cache.k[:, :, :, total:span] = 0  # stale or poisoned slots: masked, and 0 * v stays 0
            self.cache.v[:, :, :, total:span] = 0
            visible = torch.zeros(n, span, dtype=torch.bool, device=self.device)
            visible[:, :total] = mask if mask is not None else True  # n == 1 without a mask sees everything
        k_cache, v_cache = self.cache.k, self.cache.v

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if real < n:
                k[:, :, real:], v[:, :, real:] = 0, 0
            k_cache[i, :, :, start:total] = k
            v_cache[i, :, :, start:total] = v
            if invariant:
                return self.invariant_attention(q, k_cache[i, :, :, :span], v_cache[i, :, :, :span], visible)
            keys, values = (k, v) if start == 0 else (k_cache[i, :, :, :total], v_cache[i, :, :, :total])
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal,
                                                  scale=self.scale, enable_gqa=True)

        with self.rows_limited(invariant):
            x = F.embedding(tokens, self.embed)[None]
            if invariant and real == n and self.kernels is not None and self.layers[0]["q_norm"] is None:
                x, hidden = self._kernel_layers(x, cos[0, 0], sin[0, 0], start, visible, taps)
            else:
                x, hidden = self.decoder_layers(x, cos, sin, attend, taps)
            hidden = {t: h[0, :real] for t, h in hidden.items()}
            x = rms_norm(x[:, :real], self.final_norm, self.eps)[0]
            if self.num_layers in taps:
                hidden[self.num_layers] = x
            if isinstance(logits_rows, str):
                rows = {"all": x, "last": x[-1:], "none": x[:0]}[logits_rows]
            else:
                rows = x[logits_rows.to(self.device)]
            logits = self.linear(rows[None], self.lm_head)[0].float()
        return ForwardOutput(logits=logits, hidden=hidden)

    def prefill(self, tokens: Tensor, taps: tuple[int, ...] = (), logits_rows: str = "last",
                capacity: int | None = None) -> ForwardOutput:
        """Start a new sequence from `tokens` (the prompt). `capacity`: the slots the turn will
        need (prompt, reply and one pass of headroom), so the cache is sized once, not grown
        inside a round."""
        self.reset(capacity=capacity or max(1024, 2 * int(tokens.numel())))
        return self.forward(tokens, taps=taps, logits_rows=logits_rows)
