"""Triton kernels for the verification hot path: sampling chains and greedy trees.

bench.core.verify holds the readable torch reference of every rule and calls these on CUDA.
Randomness comes in as uniforms drawn by the caller (one per draft node, one for the
final draw), so for the same uniforms these kernels and the torch reference agree token
for token (up to float32 rounding of a cumulative sum, which moves a draw only when its
uniform lands within a few ulps of a token boundary).

Both paths split the vocabulary into chunks so the work spreads over many programs
instead of one program walking 150k entries:

- Chain (Leviathan's rule): `_chain_partials` finds the first rejected node (every
  program redoes this cheap n-element test) and writes per-chunk sums of the emitted
  token's weights; `_chain_draw` turns the uniform into a target mass, and the one
  program whose chunk holds it runs a local cumulative sum and writes the token.
- Greedy tree: `_argmax_partials` writes each (row, chunk)'s max and first argmax;
  `_greedy_walk` (one program) reduces them to per-row targets (first maximum, as
  torch.argmax) and walks from the root, one tree level per step.

Importing this module needs triton but no GPU; on a CPU, set TRITON_INTERPRET=1 before
importing it to run the kernels in Triton's interpreter (the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHAIN_BLOCK_V = 4096  # vocabulary entries per program
ARGMAX_BLOCK_V = 4096
# No fused multiply-adds: the kernels then round exactly like the torch reference.
LAUNCH = {"num_warps": 8, "enable_fp_fusion": False}


@triton.jit
def _first_rejection(p_ptr, q_ptr, tok_ptr, u_ptr, n, stride_p, stride_q,
                     HAS_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """Index of the first draft node failing u * q(d) < p(d) (n when all pass). The
    product form is u < min(1, p/q) without a division: q(d) = 0 < p(d) passes and
    p(d) = 0 always fails. Without q the draft is one-hot: q(d) = 1."""
    nodes = tl.arange(0, BLOCK_N)
    valid = nodes < n
    drafted = tl.load(tok_ptr + nodes, mask=valid, other=0)
    u = tl.load(u_ptr + nodes, mask=valid, other=0.0)
    p_drafted = tl.load(p_ptr + nodes.to(tl.int64) * stride_p + drafted, mask=valid, other=0.0).to(tl.float32)
    if HAS_Q:
        q_drafted = tl.load(q_ptr + nodes.to(tl.int64) * stride_q + drafted, mask=valid, other=1.0).to(tl.float32)
    else:
        q_drafted = tl.full([BLOCK_N], 1.0, tl.float32)
    failed = valid & ((u * q_drafted) >= p_drafted)
    return tl.min(tl.where(failed, nodes, n), axis=0)


@triton.jit
def _emitted_weights(p_ptr, q_ptr, tok_ptr, row, n, offs, in_vocab, stride_p, stride_q, HAS_Q: tl.constexpr):
    """(residual, p) on one vocabulary chunk of the emitted token's row. Residual =
    max(0, p - q) at a rejected row (p with the drafted token removed when q is one-hot)
    and plain p for the bonus row (row == n, where q is masked to 0)."""
    rejected = row < n
    p = tl.load(p_ptr + row.to(tl.int64) * stride_p + offs, mask=in_vocab, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(q_ptr + row.to(tl.int64) * stride_q + offs, mask=tl.where(rejected, in_vocab, False),
                    other=0.0).to(tl.float32)
        residual = tl.maximum(p - q, 0.0)
    else:
        drafted = tl.load(tok_ptr + row, mask=rejected, other=-1)
        residual = tl.where(offs == drafted, 0.0, p)
    return residual, p


@triton.jit
def _chain_partials(p_ptr, q_ptr, tok_ptr, u_ptr, out_ptr, sums_ptr, last_ptr, residual_ptr,
                    n, V, stride_p, stride_q, n_chunks,
                    HAS_Q: tl.constexpr, WRITE_RESIDUAL: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    chunk = tl.program_id(0)
    row = _first_rejection(p_ptr, q_ptr, tok_ptr, u_ptr, n, stride_p, stride_q, HAS_Q, BLOCK_N)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = offs < V
    residual, p = _emitted_weights(p_ptr, q_ptr, tok_ptr, row, n, offs, in_vocab, stride_p, stride_q, HAS_Q)
    tl.store(sums_ptr + chunk, tl.sum(residual, axis=0))
    tl.store(sums_ptr + n_chunks + chunk, tl.sum(p, axis=0))
    tl.store(last_ptr + chunk, tl.max(tl.where(residual > 0, offs, -1), axis=0))
    tl.store(last_ptr + n_chunks + chunk, tl.max(tl.where(p > 0, offs, -1), axis=0))
    if WRITE_RESIDUAL:
        tl.store(residual_ptr + offs, residual, mask=in_vocab)
    if chunk == 0:
        tl.store(out_ptr, row)
        tl.store(out_ptr + 1, V)  # "no token yet": _chain_draw lowers it with atomic_min


@triton.jit
def _chain_draw(p_ptr, q_ptr, tok_ptr, u_ptr, out_ptr, sums_ptr, last_ptr,
                n, V, stride_p, stride_q, n_chunks,
                HAS_Q: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr):
    chunk = tl.program_id(0)
    row = tl.load(out_ptr)
    chunks = tl.arange(0, BLOCK_C)
    in_chunks = chunks < n_chunks
    residual_sums = tl.load(sums_ptr + chunks, mask=in_chunks, other=0.0)
    p_sums = tl.load(sums_ptr + n_chunks + chunks, mask=in_chunks, other=0.0)
    use_p = tl.sum(residual_sums, axis=0) <= 0.0  # residual without mass: fall back to p
    sums = tl.where(use_p, p_sums, residual_sums)
    # Chunk c owns the mass interval [ends[c-1], ends[c]): one scan, so the intervals tile
    # [0, total) without gaps or overlaps whatever the rounding.
    ends = tl.cumsum(sums, axis=0)
    target = tl.load(u_ptr + n) * tl.sum(tl.where(chunks == n_chunks - 1, ends, 0.0), axis=0)
    before = tl.sum(tl.where(chunks == chunk - 1, ends, 0.0), axis=0)
    end = tl.sum(tl.where(chunks == chunk, ends, 0.0), axis=0)
    holds_target = (before <= target) & (target < end)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = tl.where(holds_target, offs < V, False)  # (block & scalar masks misbehave in the interpreter)
    residual, p = _emitted_weights(p_ptr, q_ptr, tok_ptr, row, n, offs, in_vocab, stride_p, stride_q, HAS_Q)
    weights = tl.where(use_p, p, residual)
    positive = (weights > 0) & in_vocab
    cdf = before + tl.cumsum(weights, axis=0)
    # First token past the target with positive weight: zero-weight (masked) tokens stay
    # unreachable. If rounding of the local sum leaves none, the chunk's last positive token.
    token = tl.min(tl.where((cdf > target) & positive, offs, V), axis=0)
    token = tl.where(token < V, token, tl.max(tl.where(positive, offs, -1), axis=0))
    tl.atomic_min(out_ptr + 1, token, mask=holds_target & (token >= 0))
    if chunk == 0:
        lasts = tl.load(last_ptr + tl.where(use_p, n_chunks, 0) + chunks, mask=in_chunks, other=-1)
        tl.store(out_ptr + 2, tl.max(lasts, axis=0))  # used only when u * total rounds up to total


def chain_accept(probs: Tensor, q: Tensor | None, tokens: Tensor, uniforms: Tensor,
                 residual_out: Tensor | None = None, block_v: int = CHAIN_BLOCK_V) -> Tensor:
    """Sampling-chain verification on device. probs [n+1, V] (target, after the shared
    transform), q [n, V] or None (one-hot drafts), tokens [n] int, uniforms [n+1].

    Returns int32 [3] on device: (accepted count, token or V, last positive-weight token);
    `chain_result` turns it into (accepted count, emitted token). residual_out [V], if
    given, receives the unnormalised weights of the emitted token's row (before the
    zero-mass fallback)."""
    n, V = tokens.numel(), probs.shape[-1]
    if probs.stride(-1) != 1 or (q is not None and q.stride(-1) != 1):
        raise ValueError("chain_accept needs rows with unit stride")
    n_chunks = triton.cdiv(V, block_v)
    device = probs.device
    out = torch.empty(3, dtype=torch.int32, device=device)
    sums = torch.empty(2 * n_chunks, dtype=torch.float32, device=device)
    last = torch.empty(2 * n_chunks, dtype=torch.int32, device=device)
    tokens = tokens.to(torch.int32)
    q_arg = probs if q is None else q  # unused when HAS_Q is false
    args = (probs, q_arg, tokens, uniforms, out)
    shape = (n, V, probs.stride(0), q_arg.stride(0), n_chunks)
    _chain_partials[(n_chunks,)](
        *args, sums, last, probs if residual_out is None else residual_out, *shape,
        HAS_Q=q is not None, WRITE_RESIDUAL=residual_out is not None,
        BLOCK_N=triton.next_power_of_2(max(n, 1)), BLOCK_V=block_v, **LAUNCH)
    _chain_draw[(n_chunks,)](
        *args, sums, last, *shape,
        HAS_Q=q is not None, BLOCK_C=triton.next_power_of_2(n_chunks), BLOCK_V=block_v, **LAUNCH)
    return out


def chain_result(out: Tensor, vocab: int) -> tuple[int, int]:
    accepted, token, last_positive = out.tolist()
    return accepted, token if token < vocab else last_positive


@triton.jit
def _argmax_partials(x_ptr, best_ptr, index_ptr, V, stride, n_chunks, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.min(tl.where(x == best, offs, V), axis=0)  # first maximum, as torch.argmax
    tl.store(best_ptr + row * n_chunks + chunk, best)
    tl.store(index_ptr + row * n_chunks + chunk, first)


@triton.jit
def _greedy_walk(best_ptr, index_ptr, tok_ptr, parent_ptr, out_ptr, targets_ptr, n, n_chunks, max_depth,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # Per-row target = first maximum over chunks (strict > keeps the earlier chunk on ties).
    rows = tl.arange(0, BLOCK_R)
    in_rows = rows < n + 1
    targets = tl.load(index_ptr + rows * n_chunks, mask=in_rows, other=0)
    best = tl.load(best_ptr + rows * n_chunks, mask=in_rows, other=float("-inf"))
    for chunk in range(1, n_chunks):
        value = tl.load(best_ptr + rows * n_chunks + chunk, mask=in_rows, other=float("-inf"))
        index = tl.load(index_ptr + rows * n_chunks + chunk, mask=in_rows, other=0)
        better = value > best
        targets = tl.where(better, index, targets)
        best = tl.where(better, value, best)
    tl.store(targets_ptr + rows, targets, mask=in_rows)

    # Walk: at each level take the first child (lowest node index) carrying the current
    # node's target; stop at the first level with none and emit that target.
    nodes = tl.arange(0, BLOCK_N)
    in_nodes = nodes < n
    drafted = tl.load(tok_ptr + nodes, mask=in_nodes, other=-1)
    parents = tl.load(parent_ptr + nodes, mask=in_nodes, other=-2)
    current = tl.full([], -1, tl.int32)
    accepted = tl.full([], 0, tl.int32)
    next_token = tl.full([], 0, tl.int32)
    done = tl.full([], 0, tl.int32)
    for _ in range(0, max_depth + 1):
        wanted = tl.sum(tl.where(rows == current + 1, targets, 0), axis=0)
        child = tl.min(tl.where((parents == current) & (drafted == wanted), nodes, BLOCK_N), axis=0)
        found = (child < BLOCK_N) & (done == 0)
        tl.store(out_ptr + 2 + accepted, child, mask=found)
        next_token = tl.where((done == 0) & (child >= BLOCK_N), wanted, next_token)
        done = tl.where(found, done, 1)
        accepted = accepted + found.to(tl.int32)
        current = tl.where(found, child, current)
    tl.store(out_ptr, accepted)
    tl.store(out_ptr + 1, next_token)


def greedy_tree(logits: Tensor, tokens: Tensor, parents: Tensor, max_depth: int,
                block_v: int = ARGMAX_BLOCK_V) -> tuple[Tensor, Tensor]:
    """Greedy tree (or chain) verification on device. logits [n+1, V] (any float dtype),
    tokens/parents [n] int32 (parent -1 = root), max_depth = the tree's depth.

    Returns (out, targets): out int32 [2 + max_depth] = (accepted count, next token,
    accepted nodes root-first...), targets int32 [n+1] = the argmax of every row."""
    n, V = tokens.numel(), logits.shape[-1]
    if logits.stride(-1) != 1:
        raise ValueError("greedy_tree needs rows with unit stride")
    n_chunks = triton.cdiv(V, block_v)
    device = logits.device
    best = torch.empty((n + 1) * n_chunks, dtype=torch.float32, device=device)
    index = torch.empty((n + 1) * n_chunks, dtype=torch.int32, device=device)
    _argmax_partials[(n + 1, n_chunks)](logits, best, index, V, logits.stride(0), n_chunks, BLOCK_V=block_v,
                                        **LAUNCH)
    out = torch.empty(2 + max_depth, dtype=torch.int32, device=device)
    targets = torch.empty(n + 1, dtype=torch.int32, device=device)
    _greedy_walk[(1,)](best, index, tokens, parents, out, targets, n, n_chunks, max_depth,
                       BLOCK_R=triton.next_power_of_2(n + 1), BLOCK_N=triton.next_power_of_2(max(n, 1)),
                       num_warps=4, enable_fp_fusion=False)
    return out, targets


def greedy_result(out: Tensor) -> tuple[list[int], int]:
    values = out.tolist()
    return values[2: 2 + values[0]], values[1]
