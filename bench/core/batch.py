"""Several requests verified in one target pass: B KV slots, each with its own length.

A request is prefilled alone (the engine's batch-1 prefill, whose K/V are copied into its
slot), then every round one pass runs each live slot's verification block: blocks padded
to the round's longest (padding rows' K/V zeroed, seen by nobody), each row attending to its
own slot under its own tree mask, linears over all rows at once. Per-slot compaction keeps
the accepted rows. With the engine's batch-invariant path (bf16/fp16) every row gets the
bits a batch-1 pass gives it, so batched greedy decoding is token-exact; in fp32 a row may
round differently at a near tie (the audit reports those apart).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.engine import PAD_TOKEN, Engine, ForwardOutput, aligned, rms_norm
from bench.core.errors import BenchError


class TargetBatch:
    """`slots` sequences of up to `capacity` tokens on `engine`'s weights."""

    def __init__(self, engine: Engine, slots: int, capacity: int) -> None:
        self.engine = engine
        capacity = aligned(capacity)
        shape = (engine.num_layers, slots, engine.num_kv_heads, capacity, engine.head_dim)
        dtype = engine.cache_dtype
        needed = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=engine.device)
            self.v = torch.zeros(shape, dtype=dtype, device=engine.device)
        except (RuntimeError, MemoryError):
            raise BenchError(f"a batch of {slots} slots of {capacity} tokens needs {needed / 2**30:.1f} GiB of "
                             "KV cache, more than this device can hold; use a smaller --batch-size") from None
        self.lengths = [0] * slots

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @torch.inference_mode()
    def start(self, slot: int, prompt: list[int], taps: tuple[int, ...] = ()) -> ForwardOutput:
        """Prefill `prompt` into `slot` (alone, as batch-1 decoding does)."""
        n = len(prompt)
        if n >= self.capacity:
            raise BenchError(f"prompt of {n} tokens does not fit a slot of {self.capacity}")
        out = self.engine.prefill(torch.tensor(prompt), taps=taps)
        self.k[:, slot, :, :n] = self.engine.cache.k[:, 0, :, :n]
        self.v[:, slot, :, :n] = self.engine.cache.v[:, 0, :, :n]
        self.lengths[slot] = n
        return out

    def keep(self, slot: int, start: int, kept: list[int]) -> None:
        """Keep block rows `kept` (offsets from `start`) of `slot` at slots start..: compaction."""
        if kept != list(range(len(kept))):
            src = torch.tensor(kept, device=self.k.device) + start
            self.k[:, slot, :, start:start + len(kept)] = self.k[:, slot, :, src]
            self.v[:, slot, :, start:start + len(kept)] = self.v[:, slot, :, src]
        self.lengths[slot] = start + len(kept)

    @torch.inference_mode()
    def forward(self, slots: list[int], blocks: list[tuple[Tensor, Tensor, Tensor | None]],
                taps: tuple[int, ...] = ()) -> list[ForwardOutput]:
        """One pass over each slot's block (tokens [n_r], positions [n_r] relative to the slot's
        filled length, mask [n_r, n_r] over the block or None for causal), appended after the
        slot's filled length; returns each
        row's logits at every block row and its tapped hidden states."""
        engine = self.engine
        b, n = len(slots), max(len(tokens) for tokens, _, _ in blocks)
        starts = [self.lengths[s] for s in slots]
        if max(starts) + n > self.capacity:
            raise BenchError(f"a slot is full ({max(starts) + n} > {self.capacity} tokens)")
        invariant = engine.invariant
        spans = [aligned(start + n) if invariant else start + n for start in starts]
        tokens = torch.full((b, n), PAD_TOKEN, dtype=torch.long)
        positions = torch.zeros(b, n, dtype=torch.long)
        visible = []
        for r, ((row_tokens, row_positions, mask), start, span) in enumerate(zip(blocks, starts, spans)):
            m = len(row_tokens)
            tokens[r, :m], positions[r, :m] = row_tokens, row_positions + start
            positions[r, m:] = start + int(row_positions[-1])
            seen = torch.zeros(n, span, dtype=torch.bool)
            seen[:m, :start] = True
            seen[:m, start:start + m] = torch.ones(m, m, dtype=torch.bool).tril() if mask is None else mask
            seen[range(m, n), range(start + m, start + n)] = True  # padding rows see only themselves
            visible.append(seen.to(engine.device))
        if invariant:
            for s, start, span in zip(slots, starts, spans):
                self.k[:, s, :, start + n:span] = 0  # stale slots: masked, and 0 * v stays 0
                self.v[:, s, :, start + n:span] = 0
        real = torch.tensor([[i < len(block[0]) for i in range(n)] for block in blocks], device=engine.device)
        cos, sin = engine.rope(positions.to(engine.device))
        cos, sin = cos[:, None], sin[:, None]
        keep = real[:, None, :, None]

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k, v = torch.where(keep, k, 0), torch.where(keep, v, 0)  # padding K/V: zeros, whatever they held
            rows = []
            for r, (s, start, span) in enumerate(zip(slots, starts, spans)):
                self.k[i, s, :, start:start + n] = k[r]
                self.v[i, s, :, start:start + n] = v[r]
                keys, values = self.k[i, s:s + 1, :, :span], self.v[i, s:s + 1, :, :span]
                if invariant:
                    rows.append(engine.invariant_attention(q[r:r + 1], keys, values, visible[r]))
                else:
                    rows.append(F.scaled_dot_product_attention(q[r:r + 1], keys, values, attn_mask=visible[r],
                                                               scale=engine.scale, enable_gqa=True))
            return torch.cat(rows)

        with engine.rows_limited(invariant):
            x = F.embedding(tokens.to(engine.device), engine.embed)  # [b, n, d]
            x, hidden = engine.decoder_layers(x, cos, sin, attend, taps)
            x = rms_norm(x, engine.final_norm, engine.eps)
            if engine.num_layers in taps:
                hidden[engine.num_layers] = x
            logits = engine.linear(x, engine.lm_head).float()
        outputs = []
        for r, (s, start, block) in enumerate(zip(slots, starts, blocks)):
            m = len(block[0])
            self.lengths[s] = start + m
            outputs.append(ForwardOutput(logits=logits[r, :m], hidden={t: h[r, :m] for t, h in hidden.items()}))
        return outputs
