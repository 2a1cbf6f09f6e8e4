"""MTP: multi-token prediction modules trained on the frozen target, used as drafters.

Two variants (`--option variant=...`), both sharing the target's embedding and lm_head
(frozen, never stored) and trained by distillation on the cached target features
(bench.training.features).

sequential (default; DeepSeek-V3 2412.19437 §2.2, one module applied recursively)
    row j (position j):   x = Linear_2d->d([RMSNorm(h_{j-1}); RMSNorm(Emb(x_j))])
                          g_j = RMSNorm_final(DecoderLayer(x))       (causal over the rows)
                          q_j = softmax(lm_head(g_j))  ~ the target's p(x_{j+1} | x_<=j)
    h = the target's final normed hidden state (tap L). Because h_{j-1} already predicts
    x_j, the module predicts one token further: x_{t+2} from h_t, as in DeepSeek's MTP-1.
    Drafting from the root x_s (position s, not yet in the target's KV cache): step 1 is
    row s with the target's h_{s-1}; step k feeds back the previous step's output g (the
    module's *normed* output, the same kind of vector as tap L, which is what step 1 was
    trained on; DeepSeek passes the pre-norm output, but its next module normalises it
    anyway) with the embedding of the token just drafted, at position s+k-1.
    The drafter's one-layer KV cache holds only context rows 1..s (each from a true target
    feature); the chained rows are written after them and cropped at the end of every
    proposal, and the features of the committed rows of each verify pass are fed at the
    next proposal (the EAGLE "stable KV" scheme). Training runs the recursion
    `ttt_steps` times (EAGLE-3's training-time test): step-k row j attends to the step-1
    keys of rows <= j-k+1 and to its own chain (rows j-k+2..j of steps 2..k), exactly
    the keys it sees at decode time.

parallel (Gloeckle et al. 2404.19737, blockwise parallel)
    n heads (default 3), each one decoder layer over the target's trunk features (tap T,
    default L-2 = 28 for SmolLM2: the input of layer 28, i.e. the trunk minus the last two
    layers; the shared feature cache has taps 27, 28, 30 but not 29, and adding a tap costs
    a full target pass over the data), then its own final RMSNorm (initialised from the
    target's) and the shared lm_head. Head k at position t predicts x_{t+1+k}; the target
    itself is "head 0". One proposal = every head at the last position with a known trunk
    feature (s-1), so the chain d_1..d_n needs no recursion, and the heads' caches only
    ever hold committed rows (no rollback).

Index offsets (what predicts what; see the tests): the training teacher of sequential row
j is the target's distribution at position j, lm_head(h_j); parallel head k at row t is
taught by the target's distribution at t+k. At decode the draft d_k sits at position s+k
and is verified by the target's distribution at s+k-1: the same pairs.

Training (`bench train --method mtp [--option variant=parallel]`): soft cross-entropy
against the target's own next-token distribution (KL(p || q)), only where the predicted
token is an assistant-reply token and inside one conversation; steps / heads weighted
step_decay^(k-1) (EAGLE-3's 0.8), each averaged over its valid rows. The [rows, vocab]
logits are never kept: a fused function computes loss and gradient chunk by chunk (the
lm_head over the 49152-token vocabulary is nearly all the cost), with the lm_head
matmuls in bfloat16 (2.4x faster than fp32 on this CPU). The drafter folder holds the
trainable weights (bf16) and drafter.json; the parallel variant is trained into
`.../drafters/<target>/mtp-parallel` (the manifest says method "mtp", variant "parallel"),
so `bench run --method mtp --option variant=parallel` finds it.

Decoding options: variant (sequential | parallel; default sequential, or the manifest's
for an explicit --drafter), depth (chain length; default 4 sequential, number of heads
parallel), sample (0 | 1: at T > 0 draw drafts from the module's warped q and record it
for the min(1, p/q) rule; default 0 = argmax drafts, q one-hot, exact at any
temperature), draft_dtype (default bfloat16: the drafter only proposes), drafter (path).

Training recipe (about an hour on one free CPU thread): `bench train --method mtp
--max-len 512 --batch-size 4 --lr 5e-4 --warmup-steps 20 --max-steps 600 --threads 1`
(600 steps of 4 conversations = about 3.7 epochs of the shared 300k-token cache), plus
`--option variant=parallel` for the heads. Options: see MtpSettings.

Measured (2-core EPYC shared with other jobs, one thread, load ~4): a training step of
4 x 512 tokens (~1570 reply rows) takes ~8 s sequential (ttt_steps=2) and ~9.5 s parallel
(3 heads), ~190 and ~165 rows/s; the fused loss is ~75% of it. Drafting in bf16 costs
~13 ms per sequential step (the lm_head) and ~36 ms for 3 parallel heads, against ~80 ms
per AR target step; fp32 drafting is ~1.35x slower. Init: after 60 steps (2 x 256 tokens)
the last-layer init (starts at KL 15-20 from the target) and a random layer (starts at
12-13) both reach held-out step-1 KL 5.2-5.4 and top-1 agreement 0.12-0.14, i.e. no
difference that short; the last layer stays the default (see init_model).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.draft import Draft
from bench.drafters import WEIGHTS, check_target, find_drafter, read_manifest, user_dir, write_drafter
from bench.engine import ForwardOutput, KVCache, rms_norm, rotate_half
from bench.errors import BenchError
from bench.runner import DecodeState, Drafter, LoopDecoder
from bench.sampling import process_logits, sample_from
from bench.verify import Verdict

METHOD = "mtp"
VARIANTS = ("sequential", "parallel")
FORMAT = "spec-bench-mtp/1"
MAX_DEPTH = 16


def drafter_key(variant: str) -> str:
    """Folder name under drafters/<target>/: each variant has its own drafter."""
    return METHOD if variant == "sequential" else f"{METHOD}-{variant}"


# ======================================================================= model
class Rope:
    """The target's rotary embedding (its inverse frequencies and scaling), any dtype."""

    def __init__(self, engine, dtype: torch.dtype, device: torch.device) -> None:
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
    def of(cls, engine) -> LayerShape:
        layer = engine.layers[-1]
        return cls(hidden_size=engine.hidden_size, num_heads=engine.num_heads, num_kv_heads=engine.num_kv_heads,
                   head_dim=engine.head_dim, intermediate_size=layer["down"].shape[1], rms_norm_eps=engine.eps,
                   qkv_bias=layer["qkv_bias"] is not None, qk_norm=layer["q_norm"] is not None,
                   vocab_size=engine.vocab_size)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer (attention with RoPE + SwiGLU MLP); parameter names follow
    bench.engine's fused layout, so a target layer copies in directly."""

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
        qkv = F.linear(rms_norm(x, self.in_norm, s.rms_norm_eps), self.qkv, self.qkv_bias)
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
        x = x + F.linear(attn, self.o)
        gate, up = F.linear(rms_norm(x, self.post_norm, self.shape.rms_norm_eps), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)

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
    """DeepSeek-V3-style module: fuse (feature, next token) -> one layer -> final norm."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        d = shape.hidden_size
        self.shape = shape
        self.norm_h = nn.Parameter(torch.ones(d))
        self.norm_e = nn.Parameter(torch.ones(d))
        self.proj = nn.Parameter(torch.empty(d, 2 * d))
        nn.init.kaiming_uniform_(self.proj, a=math.sqrt(5))  # nn.Linear's default
        self.layer = DecoderLayer(shape)
        self.final_norm = nn.Parameter(torch.ones(d))

    def fuse(self, feature: Tensor, embedding: Tensor) -> Tensor:
        eps = self.shape.rms_norm_eps
        return F.linear(torch.cat([rms_norm(feature, self.norm_h, eps), rms_norm(embedding, self.norm_e, eps)], -1),
                        self.proj)

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


# ==================================================================== drafting
class _MtpDrafter(Drafter):
    name = METHOD

    def __init__(self, model: nn.Module, engine, depth: int, sample: bool, dtype: torch.dtype) -> None:
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
        logits = F.linear(normed, self.lm_head).float()
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

    def accept(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
               rows: list[int]) -> None:
        self._feed(out, rows)

    def reset_caches(self) -> None:
        raise NotImplementedError


class SequentialDrafter(_MtpDrafter):
    """One module applied `depth` times; see the module docstring."""

    def __init__(self, model: SequentialMTP, engine, depth: int = 4, sample: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, engine, depth, sample, dtype)
        self.taps = (engine.num_layers,)
        self.cache = model.layer.new_cache(dtype, self.device)

    def reset_caches(self) -> None:
        self.cache.length = 0  # slot i holds row i+1 (row 0, the first token, has no feature before it)

    @torch.inference_mode()
    def ingest(self, state: DecodeState) -> Tensor:
        """Add the context rows the cache lacks, up to the root's row s; returns g_s [d]."""
        s = len(state.tokens) - 1
        first = s - len(self.unfed) + 1  # rows first..s take features at first-1..s-1
        if first != self.cache.length + 1:
            raise RuntimeError(f"mtp draft cache out of step: {self.cache.length} rows, next row {first}")
        tokens = torch.tensor(state.tokens[first: s + 1], device=self.device)
        x = self.model.fuse(self.unfed, self.embed[tokens].to(self.dtype))
        out = self.model.layer.cached(x, torch.arange(first, s + 1, device=self.device), self.cache, self.rope)
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
                out = self.model.layer.cached(x, torch.tensor([s + step + 1], device=self.device), self.cache,
                                              self.rope)
                g = self.model.out(out[0])
        self.cache.crop(context)  # chained rows used the module's own features: drop them
        return Draft.chain(tokens, q=torch.stack(q_rows) if q_rows else None)


class ParallelDrafter(_MtpDrafter):
    """Heads 1..depth at the last position with a known trunk feature."""

    def __init__(self, model: ParallelMTP, engine, tap: int, depth: int = 3, sample: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, engine, depth, sample, dtype)
        self.taps = (tap,)
        self.caches = [head.layer.new_cache(dtype, self.device) for head in model.heads[:depth]]

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


# ==================================================================== loading
def new_model(variant: str, shape: LayerShape, heads: int = 3) -> nn.Module:
    if variant == "sequential":
        return SequentialMTP(shape)
    return ParallelMTP(shape, heads)


def _find(target, variant: str | None, path: str | None) -> Path:
    if path is not None:
        return find_drafter(target.name, METHOD, path)
    variant = variant or "sequential"
    try:
        return find_drafter(target.name, drafter_key(variant))
    except BenchError:
        extra = "" if variant == "sequential" else f" --option variant={variant}"
        raise BenchError(f"no mtp drafter (variant {variant}) for target '{target.name}': run "
                         f"`bench train --method mtp{extra}` or pass --drafter PATH") from None


def load_model(target, folder: Path, variant: str | None = None) -> tuple[nn.Module, dict]:
    """The trained module in `folder` (fp32, frozen) and its manifest; one-line BenchErrors
    for another method or variant, another target, a shape mismatch or unreadable weights."""
    from safetensors.torch import load_file

    manifest = read_manifest(folder)
    if manifest.get("method") != METHOD:
        raise BenchError(f"drafter {folder} is a '{manifest.get('method')}' drafter, not mtp")
    check_target(manifest, target, folder)
    saved = manifest.get("variant")
    if saved not in VARIANTS:
        raise BenchError(f"drafter {folder} has unknown mtp variant '{saved}'")
    if variant is not None and saved != variant:
        raise BenchError(f"drafter {folder} is an mtp {saved} drafter, not {variant}")
    shape = LayerShape.of(target.engine)
    architecture = manifest.get("architecture", {})
    expected = asdict(shape)
    mismatch = [k for k in expected if architecture.get(k) != expected[k]]
    if mismatch:
        raise BenchError(f"drafter {folder} has {mismatch[0]}={architecture.get(mismatch[0])}, "
                         f"the target's layers have {expected[mismatch[0]]}")
    try:
        heads = int(architecture.get("heads", 0)) if saved == "parallel" else 0
        if saved == "parallel" and heads < 1:
            raise ValueError("no heads")
    except (TypeError, ValueError):
        raise BenchError(f"drafter {folder} has a bad head count: {architecture.get('heads')}") from None
    model = new_model(saved, shape, heads)
    try:
        weights = load_file(str(folder / manifest.get("weights", WEIGHTS)))
    except Exception as exc:
        raise BenchError(f"cannot read drafter weights in {folder}: {str(exc).splitlines()[0]}") from None
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise BenchError(f"drafter weights in {folder} lack {missing[0]}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(weights[name].shape) != tuple(param.shape):
                raise BenchError(f"drafter weight {name} in {folder} has shape {tuple(weights[name].shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(weights[name].float())
    model.requires_grad_(False)
    return model, manifest


class MtpDecoder(LoopDecoder):
    """LoopDecoder that also reports which drafter it used."""

    def __init__(self, target, drafter: _MtpDrafter, info: dict) -> None:
        super().__init__(target, drafter)
        self.info = info


def make_drafter(target, model: nn.Module, manifest: dict, depth: int | None = None, sample: bool = False,
                 dtype: torch.dtype = torch.float32) -> _MtpDrafter:
    engine = target.engine
    model = model.to(device=engine.device, dtype=dtype).requires_grad_(False)
    if manifest["variant"] == "sequential":
        depth = 4 if depth is None else depth
        if not 1 <= depth <= MAX_DEPTH:
            raise BenchError(f"mtp depth must be in 1..{MAX_DEPTH}, got {depth}")
        return SequentialDrafter(model, engine, depth, sample, dtype)
    heads = len(model.heads)
    depth = heads if depth is None else depth
    if not 1 <= depth <= heads:
        raise BenchError(f"mtp parallel depth must be in 1..{heads} (the drafter's heads), got {depth}")
    return ParallelDrafter(model, engine, int(manifest["tap"]), depth, sample, dtype)


def build(target, options: dict) -> MtpDecoder:
    from bench.target import parse_dtype

    known = {"variant", "depth", "sample", "drafter", "draft_dtype"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise BenchError(f"unknown mtp option '{unknown[0]}' (known: {', '.join(sorted(known))})")
    variant = options.get("variant")
    if variant is not None and variant not in VARIANTS:
        raise BenchError(f"mtp variant '{variant}' unknown (choose from {', '.join(VARIANTS)})")
    try:
        depth = int(options["depth"]) if "depth" in options else None
        sample = bool(int(options.get("sample", 0)))
    except (TypeError, ValueError):
        raise BenchError("mtp depth and sample must be integers") from None
    dtype = parse_dtype(str(options.get("draft_dtype", "bfloat16")))
    folder = _find(target, variant, options.get("drafter"))
    model, manifest = load_model(target, folder, variant)
    drafter = make_drafter(target, model, manifest, depth, sample, dtype)
    training = manifest.get("training", {})
    info = {"drafter": str(folder), "variant": manifest["variant"], "depth": drafter.depth, "sample": sample,
            "tap": manifest.get("tap"), "draft_dtype": str(dtype).removeprefix("torch."),
            "trained_steps": training.get("steps"), "heldout_acc": training.get("heldout", {}).get("acc"),
            "weights_sha1": hashlib.sha1((folder / manifest.get("weights", WEIGHTS)).read_bytes()).hexdigest()[:12]}
    return MtpDecoder(target, drafter, info)


# ==================================================================== training
class _DistillLoss(torch.autograd.Function):
    """sum_{s,r} weight[s,r] * KL(p_r || q_{s,r}) with p_r = softmax(lm_head(teacher_r)) and
    q_{s,r} = softmax(lm_head(student_{s,r})). Forward computes the gradient too, chunk by
    chunk, so no [rows, vocab] tensor outlives its chunk; the vocabulary-wide elementwise
    work (as costly as the matmuls on a CPU) is kept to a few in-place passes. Also returns
    per-step stats [steps, 4]: KL sum, top-1 agreements, sum of min(p, q) (the T=1
    acceptance; only when no gradient is needed), rows."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, weight: Tensor, lm_head: Tensor,
                chunk: int, dtype: torch.dtype):
        steps, rows = weight.shape
        need_grad = ctx.needs_input_grad[0]
        grad = torch.zeros_like(student) if need_grad else None
        loss = torch.zeros((), device=student.device)
        stats = torch.zeros(steps, 4, device=student.device)
        head = lm_head.to(dtype)

        def dot(a: Tensor, b: Tensor) -> Tensor:  # row-wise a.b without a [rows, V] temporary
            return torch.bmm(a[:, None, :], b[:, :, None])[:, 0, 0]

        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            z_t = F.linear(teacher[a:b].to(dtype), head).float()
            lse_t = z_t.logsumexp(-1)
            best = z_t.argmax(-1)
            p = (z_t - lse_t[:, None]).exp_()
            neg_entropy = dot(p, z_t) - lse_t  # sum p log p
            del z_t
            for s in range(steps):
                w = weight[s, a:b]
                valid = w > 0
                if not bool(valid.any()):
                    continue
                z = F.linear(student[s, a:b].to(dtype), head).float()
                lse = z.logsumexp(-1)
                kl = neg_entropy - dot(p, z) + lse  # sum p (log p - log q)
                loss += (w * kl).sum()
                stats[s, 0] += kl[valid].sum()
                stats[s, 1] += (z.argmax(-1) == best)[valid].sum()
                stats[s, 3] += valid.sum()
                q = z.sub_(lse[:, None]).exp_()
                if need_grad:  # d loss / d logits = w (q - p)
                    grad[s, a:b] = F.linear(q.sub_(p).mul_(w[:, None]).to(dtype), head.t()).float()
                else:
                    stats[s, 2] += torch.minimum(p, q).sum(-1)[valid].sum()
        ctx.save_for_backward(grad if need_grad else torch.empty(0))
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_stats: Tensor):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None, None, None, None


def distill_loss(student: Tensor, teacher: Tensor, weight: Tensor, lm_head: Tensor, chunk: int = 128,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    return _DistillLoss.apply(student, teacher, weight, lm_head, chunk, dtype)


@dataclass
class MtpSettings:
    """`bench train --method mtp --option k=v` options."""

    variant: str = "sequential"
    ttt_steps: int = 2  # sequential: recursion depth trained (EAGLE-3 TTT); 1 = plain MTP-1
    heads: int = 3  # parallel: heads (x_{t+2}..x_{t+1+heads})
    tap: int | None = None  # parallel trunk tap (default L-2: in the shared feature cache)
    init: str = "target"  # "target": decoder layers copied from the target (init_layer); "random"
    init_layer: int | None = None  # default: last layer (sequential), the trunk tap's layer (parallel)
    step_decay: float = 0.8  # loss weight of step/head k: step_decay^(k-1)
    head_dtype: str = "bfloat16"  # lm_head matmuls in the loss (teacher and student)
    loss_chunk: int = 128  # rows per lm_head chunk in the fused loss (128 measured fastest)
    holdout: int = 16  # last N conversations of the feature cache: held out for evaluation
    eval_rows: int = 2000  # held-out reply positions evaluated at each export
    eval_steps: int = 4  # sequential: chain steps evaluated (parallel: every head)
    feature_tokens: int | None = None  # FeatureData.max_tokens (default: the shared cache's)
    feature_len: int | None = None  # FeatureData.max_len
    self_distill: bool = False  # FeatureData.self_distill

    @classmethod
    def parse(cls, options: dict) -> MtpSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise BenchError(f"unknown mtp training option '{unknown[0]}' (known: {', '.join(sorted(known))})")
        settings = cls(**options)
        if settings.variant not in VARIANTS:
            raise BenchError(f"mtp variant '{settings.variant}' unknown (choose from {', '.join(VARIANTS)})")
        if settings.init not in ("target", "random"):
            raise BenchError(f"mtp init '{settings.init}' unknown (target | random)")
        if settings.ttt_steps < 1 or settings.heads < 1 or settings.eval_steps < 1:
            raise BenchError("mtp ttt_steps, heads and eval_steps must be >= 1")
        return settings

    def trunk_tap(self, num_layers: int) -> int:
        tap = num_layers - 2 if self.tap is None else int(self.tap)
        if not 0 <= tap < num_layers:
            raise BenchError(f"mtp parallel tap must be in 0..{num_layers - 1} (a layer input), got {tap}")
        return tap

    def feature_data(self, data_path: Path | None):
        from bench.training.features import FeatureData

        values = {"self_distill": self.self_distill}
        if self.feature_tokens is not None:
            values["max_tokens"] = int(self.feature_tokens)
        if self.feature_len is not None:
            values["max_len"] = int(self.feature_len)
        if data_path is not None:
            values["data_path"] = str(data_path)
        return FeatureData(**values)


def init_model(target, settings: MtpSettings) -> nn.Module:
    """A fresh module; decoder layers copied from a target layer for init=target.

    Why the last layer for the sequential module: its output is read by the final norm and
    lm_head, so the copied layer already writes a "next token" readout; earlier layers
    expect a mid-network residual stream (for the SpS draft, a copied late layer fed
    embeddings started far from the target, see bench/training/draft_lm.init_layers)."""
    engine = target.engine
    shape = LayerShape.of(engine)
    model = new_model(settings.variant, shape, settings.heads)
    if settings.init == "random":
        return model
    if settings.variant == "sequential":
        index = engine.num_layers - 1 if settings.init_layer is None else int(settings.init_layer)
        layers = [model.layer]
        norms = [model.final_norm]
    else:
        tap = settings.trunk_tap(engine.num_layers)
        index = tap if settings.init_layer is None else int(settings.init_layer)
        layers = [head.layer for head in model.heads]
        norms = [head.final_norm for head in model.heads]
    if not 0 <= index < engine.num_layers:
        raise BenchError(f"mtp init_layer must be in 0..{engine.num_layers - 1}, got {index}")
    settings.init_layer = index
    for layer in layers:
        layer.copy_from({k: v.float().cpu() for k, v in engine.layers[index].items() if v is not None})
    with torch.no_grad():
        for norm in norms:
            norm.copy_(engine.final_norm.float())
    return model


def windows_of(offsets: list[int], max_len: int) -> list[tuple[int, int, int]]:
    """(sequence start, a, b): each conversation cut into windows of <= max_len tokens that
    overlap by one token, so every row (predicted position) is in exactly one window."""
    out = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        a = start
        while end - a >= 2:
            b = min(end, a + max_len)
            out.append((start, a, b))
            if b == end:
                break
            a = b - 1
    return out


class MtpObjective:
    """bench.training.loop Objective over the cached features; batches are window lists."""

    def __init__(self, target, model: nn.Module, settings: MtpSettings, features: dict[str, Tensor],
                 device: str | torch.device = "cpu") -> None:
        engine = target.engine
        self.settings = settings
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.variant = settings.variant
        self.last = engine.num_layers
        self.trunk = settings.trunk_tap(self.last) if self.variant == "parallel" else self.last
        self.features = features
        self.embed = engine.embed.detach().to(self.device, torch.float32)
        self.lm_head = engine.lm_head.detach().to(self.device, torch.float32)
        self.rope = Rope(engine, torch.float32, self.device)
        from bench.target import parse_dtype

        self.head_dtype = parse_dtype(settings.head_dtype)
        self.train_steps = settings.ttt_steps if self.variant == "sequential" else settings.heads
        weights = torch.tensor([settings.step_decay ** k for k in range(max(self.train_steps, settings.eval_steps,
                                                                            settings.heads))])
        self.step_weights = weights.to(self.device)

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def _window(self, window: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        start, a, b = window
        f = self.features
        tokens = f["tokens"][a:b].to(self.device)
        mask = f["loss_mask"][a:b].to(self.device)
        final = f[f"h{self.last}"][a:b].to(self.device, torch.float32)
        trunk = final if self.trunk == self.last else f[f"h{self.trunk}"][a:b].to(self.device, torch.float32)
        positions = torch.arange(a - start, b - start, device=self.device)
        return tokens, mask, final, trunk, positions

    def pairs(self, windows: list[tuple[int, int, int]], steps: int) -> tuple[Tensor, Tensor, Tensor]:
        """Student outputs [steps, R, d], teacher features [R, d] and validity [steps, R]
        over every row of the windows (see the module docstring for the offsets)."""
        students, teachers, valids = [], [], []
        for window in windows:
            tokens, mask, final, trunk, positions = self._window(window)
            n = tokens.shape[0]
            if self.variant == "sequential":
                # rows r = 0..n-2 are positions j = r+1: input (h_{j-1}, x_j), teacher h_j
                cos, sin = self.rope(positions[1:])
                outs = chained_outputs(self.model, final[:-1], self.embed[tokens[1:]], cos, sin, steps)
                rows = torch.arange(n - 1, device=self.device)
                students.append(outs)
                teachers.append(final[1:])
                valids.append(mask[1:][None] & (rows[None] >= torch.arange(steps, device=self.device)[:, None]))
            else:
                # teacher row j (position j); head k's row j-k predicts the token after j
                cos, sin = self.rope(positions)
                rows = torch.arange(n, device=self.device)
                outs, valid = [], []
                for k, head in enumerate(self.model.heads[:steps], start=1):
                    out = head.out(head.layer.causal(trunk[None], cos, sin)[0])
                    outs.append(torch.cat([out[:1].expand(min(k, n), -1), out[: max(0, n - k)]]))
                    valid.append(mask & (rows >= k))
                students.append(torch.stack(outs))
                teachers.append(final)
                valids.append(torch.stack(valid))
        return torch.cat(students, dim=1), torch.cat(teachers), torch.cat(valids, dim=1)

    def _loss(self, windows: list[tuple[int, int, int]], steps: int) -> tuple[Tensor, Tensor]:
        student, teacher, valid = self.pairs(windows, steps)
        keep = valid.any(0)
        student, teacher, valid = student[:, keep], teacher[keep], valid[:, keep]
        # step k weighs step_decay^(k-1), averaged over its valid rows; weights sum to 1
        lam = self.step_weights[:steps]
        weight = valid.float() * (lam / valid.sum(1).clamp(min=1) / lam.sum())[:, None]
        return distill_loss(student, teacher, weight, self.lm_head, self.settings.loss_chunk, self.head_dtype)

    def loss(self, batch: list[tuple[int, int, int]]) -> tuple[Tensor, dict[str, float]]:
        loss, stats = self._loss(batch, self.train_steps)
        rows = stats[:, 3].clamp(min=1)
        metrics = {"tokens": float(stats[0, 3])}
        for k in range(stats.shape[0]):
            metrics[f"kl{k + 1}"] = float(stats[k, 0] / rows[k])
            metrics[f"acc{k + 1}"] = float(stats[k, 1] / rows[k])
        metrics["acc"] = metrics["acc1"]
        metrics["kl"] = metrics["kl1"]
        return loss, metrics

    @torch.no_grad()
    def evaluate(self, windows: list[tuple[int, int, int]]) -> dict:
        """Teacher-forced top-1 agreement with the target per chain step / head on held-out
        windows: step k drafts from the target feature k-1 positions back, fed the data's
        tokens (a proxy of greedy acceptance at depth k given the earlier drafts were right)."""
        steps = self.settings.eval_steps if self.variant == "sequential" else len(self.model.heads)
        total = torch.zeros(steps, 4)
        for i in range(0, len(windows), 4):
            _, stats = self._loss(windows[i: i + 4], steps)
            total += stats.cpu()
            if total[0, 3] >= self.settings.eval_rows:
                break
        rows = total[:, 3].clamp(min=1)
        return {"acc": [round(float(v), 4) for v in total[:, 1] / rows],
                "accept": [round(float(v), 4) for v in total[:, 2] / rows],
                "kl": [round(float(v), 4) for v in total[:, 0] / rows], "rows": int(total[0, 3])}

    def export(self, folder: Path, manifest: dict) -> None:
        write_drafter(folder, {n: p.to(torch.bfloat16) for n, p in self.model.named_parameters()}, manifest)



def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else None


def train(target, settings) -> dict:
    """`bench train --method mtp`: train the MTP module(s) on cached target features into
    settings.out_dir (resuming from a checkpoint there); exports the drafter at every
    checkpoint with its held-out agreement per step."""
    from bench.training import loop
    from bench.training.draft_lm import git_sha, timestamp
    from bench.training.features import ensure_features

    opts = MtpSettings.parse(dict(settings.options))
    num_layers = target.engine.num_layers
    out_dir = Path(settings.out_dir)
    if opts.variant != "sequential" and out_dir == user_dir(target.name, METHOD):
        out_dir = user_dir(target.name, drafter_key(opts.variant))  # where build() looks for it
    trunk = opts.trunk_tap(num_layers) if opts.variant == "parallel" else num_layers
    taps = tuple(sorted({num_layers, trunk}))
    data = opts.feature_data(settings.data_path)
    store = ensure_features(target, taps, data, progress=settings.progress)
    features = store.load(taps)
    offsets = features["offsets"].tolist()
    held = min(opts.holdout, max(0, len(offsets) - 2))  # keep at least one training conversation
    train_offsets, held_offsets = offsets[: len(offsets) - held], offsets[len(offsets) - held - 1:]
    if settings.data_limit:
        train_offsets = train_offsets[: settings.data_limit + 1]
    mask = features["loss_mask"]

    def useful(windows: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:  # windows with reply rows
        return [w for w in windows if bool(mask[w[1] + 1: w[2]].any())]

    train_windows = useful(windows_of(train_offsets, settings.max_len))
    held_windows = useful(windows_of(held_offsets, settings.max_len)) if held else []
    if not train_windows:
        raise BenchError(f"feature cache {store.folder} has no training conversations")

    torch.manual_seed(settings.seed)  # the module's random parts (proj, init=random)
    model = init_model(target, opts)
    objective = MtpObjective(target, model, opts, features, settings.device)
    epoch_order: dict[int, list[int]] = {}

    def next_batch(cursor: int) -> tuple[list[tuple[int, int, int]], int]:
        batch = []
        for index in range(cursor, cursor + settings.batch_size):
            epoch, i = divmod(index, len(train_windows))
            if epoch not in epoch_order:  # a fresh shuffle per epoch, fixed by the seed
                epoch_order.clear()
                generator = torch.Generator().manual_seed(settings.seed * 100_003 + epoch)
                epoch_order[epoch] = torch.randperm(len(train_windows), generator=generator).tolist()
            batch.append(train_windows[epoch_order[epoch][i]])
        return batch, cursor + settings.batch_size

    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}
    identity = {"method": METHOD, "target": target_info, "batch_size": settings.batch_size,
                "max_len": settings.max_len, "data_limit": settings.data_limit, "features": data.key(),
                "mtp": asdict(opts)}
    cfg = loop.LoopConfig(max_steps=settings.max_steps, lr=settings.lr, warmup_steps=settings.warmup_steps,
                          checkpoint_every_s=settings.checkpoint_every_s, seed=settings.seed)
    architecture = dict(asdict(LayerShape.of(target.engine)), kind=opts.variant)
    if opts.variant == "parallel":
        architecture["heads"] = opts.heads
    keys = ("kl", "acc") + tuple(f"acc{k + 1}" for k in range(objective.train_steps))

    def export(step: int) -> None:
        rows = loop.read_log(out_dir)
        heldout = objective.evaluate(held_windows) if held_windows else {}
        manifest = {
            "format": FORMAT, "method": METHOD, "variant": opts.variant, "target": target_info, "weights": WEIGHTS,
            "architecture": architecture, "tap": trunk, "teacher_tap": num_layers,
            "shared": ["embedding", "lm_head"], "mtp_settings": asdict(opts),
            "training": {
                "steps": step, "max_steps": settings.max_steps, "batch_size": settings.batch_size,
                "max_len": settings.max_len, "lr": settings.lr, "warmup_steps": settings.warmup_steps,
                "seed": settings.seed, "device": settings.device, "features": str(store.folder),
                "feature_data": asdict(data), "train_windows": len(train_windows),
                "heldout_conversations": held, "reply_rows_seen": int(sum(r.get("tokens", 0) for r in rows)),
                "first_10_steps": {k: _mean(rows[:10], k) for k in keys},
                "last_10_steps": {k: _mean(rows[-10:], k) for k in keys},
                "heldout": heldout, "elapsed_s": rows[-1]["elapsed_s"] if rows else None,
                "git_sha": git_sha(), "exported_at": timestamp(),
            },
        }
        objective.export(out_dir, manifest)

    summary = loop.train(objective, next_batch, cfg, out_dir, identity, settings.progress, on_checkpoint=export)
    summary["drafter"] = str(out_dir)
    summary["heldout"] = read_manifest(out_dir).get("training", {}).get("heldout")
    return summary
