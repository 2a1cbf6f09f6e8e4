"""Many sequences at once on the target: a KV cache of B slots, each with its own length.

A slot is filled by a batch-1 prefill (the engine's own forward, no padding), then every
live slot advances one token per `step`: one batched pass whose rows write K/V at their
own slot lengths and attend only to their own filled slots. A finished slot is refilled at
once (continuous batching), so a long reply never holds a batch of short ones hostage.
Greedy self-distillation runs on it (bench.training.distill).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.engine import Engine, rms_norm


class SlotBatch:
    """`slots` sequences of up to `capacity` tokens on `engine`'s weights (batch-1 engine
    for prefill, the batched step below for decoding)."""

    def __init__(self, engine: Engine, slots: int, capacity: int) -> None:
        self.engine = engine
        shape = (engine.num_layers, slots, engine.num_kv_heads, capacity, engine.head_dim)
        self.k = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.v = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=engine.device)
        self.last = torch.zeros(slots, dtype=torch.long, device=engine.device)  # each slot's newest token
        engine.rope(torch.tensor([capacity - 1], device=engine.device))  # RoPE tables sized once

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @torch.inference_mode()
    def start(self, slot: int, prompt: list[int]) -> int:
        """Prefill `prompt` into `slot`; returns the greedy first token."""
        n = len(prompt)
        if n >= self.capacity:
            raise ValueError(f"prompt of {n} tokens does not fit a slot of {self.capacity}")
        out = self.engine.prefill(torch.tensor(prompt, device=self.engine.device))
        cache = self.engine.cache
        self.k[:, slot, :, :n] = cache.k[:, 0, :, :n]
        self.v[:, slot, :, :n] = cache.v[:, 0, :, :n]
        self.lengths[slot] = n
        token = int(out.logits[-1].argmax())
        self.last[slot] = token
        return token

    @torch.inference_mode()
    def step(self, live: int | None = None) -> Tensor:
        """One greedy token for each of the first `live` slots (default all), fed their
        newest token; returns the new tokens [live]. A slot past its capacity is the
        caller's error (it must retire the slot first)."""
        engine, live = self.engine, live or self.slots
        lengths = self.lengths[:live]
        if int(lengths.max()) >= self.capacity:
            raise ValueError("a slot is full: retire it before the next step")
        if engine.kernels is not None and engine.layers[0]["q_norm"] is None:
            tokens = self._kernel_step(live)
        else:
            tokens = self._torch_step(live)
        self.lengths[:live] += 1
        self.last[:live] = tokens
        return tokens

    def _kernel_step(self, live: int) -> Tensor:
        """The step on the engine's CPU kernels: every row gets the bits of the same token
        decoded alone by the engine (its invariant one-token pass), so the replies are exactly
        the engine's own batch-1 greedy replies."""
        engine, kernels, lengths = self.engine, self.engine.kernels, self.lengths[:live]
        packed = engine._kernel_packed
        rows = torch.arange(live, device=lengths.device)
        cos, sin = engine.rope(lengths)
        x = F.embedding(self.last[:live], engine.embed)  # [b, d]
        for i, layer in enumerate(engine.layers):
            q, k, v = kernels.layer_inputs(x, layer["in_norm"], *packed[id(layer["qkv"])], layer["qkv_bias"], cos, sin,
                                           engine.num_heads, engine.num_kv_heads, engine.eps)
            self.k[i, rows, :, lengths] = k.transpose(0, 1)
            self.v[i, rows, :, lengths] = v.transpose(0, 1)
            attn = kernels.slot_attention(q.transpose(0, 1), self.k[i, :live], self.v[i, :live], lengths + 1,
                                          engine.scale)
            x = kernels.layer_outputs(x, attn.reshape(live, -1), packed[id(layer["o"])][0], layer["post_norm"],
                                      *packed[id(layer["gate_up"])], packed[id(layer["down"])][0], engine.eps)
        x = rms_norm(x, engine.final_norm, engine.eps)
        with engine.rows_limited(True):  # the lm_head as the one-token pass runs it
            return engine.linear(x, engine.lm_head).float().argmax(-1)

    def _torch_step(self, live: int) -> Tensor:
        engine, lengths = self.engine, self.lengths[:live]
        rows = torch.arange(live, device=lengths.device)
        spans = (lengths + 1).tolist()
        cos, sin = engine.rope(lengths)
        cos, sin = cos[:, None, None], sin[:, None, None]
        x = F.embedding(self.last[:live], engine.embed)[:, None]  # [b, 1, d]
        kv_heads = engine.num_kv_heads
        group = engine.num_heads // kv_heads
        for i, layer in enumerate(engine.layers):
            q, k, v = engine.attention_inputs(layer, x, cos, sin)
            self.k[i, rows, :, lengths] = k[:, :, 0]
            self.v[i, rows, :, lengths] = v[:, :, 0]
            # Row by row over its own filled slots: slot lengths differ by up to the context
            # limit, and a padded span would read K/V many times over. One query token per
            # row: the heads sharing a K/V head become its query rows (K/V read once).
            grouped = q.reshape(live, kv_heads, group, -1)
            attn = torch.cat([F.scaled_dot_product_attention(grouped[r:r + 1], self.k[i, r:r + 1, :, :n],
                                                             self.v[i, r:r + 1, :, :n], scale=engine.scale)
                              for r, n in enumerate(spans)])
            x = engine.attention_output_and_mlp(layer, x, attn.reshape(live, -1, 1, attn.shape[-1]))
        x = rms_norm(x[:, 0], engine.final_norm, engine.eps)
        return engine.linear(x, engine.lm_head).float().argmax(-1)  # bf16 argmax is the slower kernel

    def move(self, source: int, dest: int) -> None:
        """Copy slot `source` into slot `dest` (to pack live slots at the front)."""
        n = int(self.lengths[source])
        self.k[:, dest, :, :n] = self.k[:, source, :, :n]
        self.v[:, dest, :, :n] = self.v[:, source, :, :n]
        self.lengths[dest], self.last[dest] = self.lengths[source], self.last[source]
