"""Verification: which draft nodes the target accepts, and the one extra token.

Input: a Draft and the target's logits at every verified position (row 0 = the root,
row i+1 = draft node i). Output: the accepted root-to-node path and the next token
(correction or bonus). Every method goes through `verify`; the rules:

- greedy target, any draft (q ignored): walk while a child carries the argmax.
- sampling, chain (q given, or None = one-hot drafts): Leviathan's rule, accept node i
  if u < min(1, p/q), else emit y ~ norm(max(0, p - q)); all accepted: bonus y ~ p.
- sampling, tree with q None (deterministic children): draw y ~ p at the node, descend
  if a child carries y, else emit y.
- sampling, tree with q and sampled_children=True: SpecInfer multi-step speculative
  sampling; recursive rejection sampling when meta["without_replacement"] is set.

p = softmax(process_logits(logits, cfg)): the same transform as the AR baseline, so
residuals use the truncated p. q rows must be the distributions the draft really
sampled from, after the draft's own transform.

Sampled trees: Draft.q[c] is the distribution node c's token was drawn from; i.i.d.
siblings share it. With draft.meta["without_replacement"] = True, the siblings of a
node were drawn one after another without replacement, in node-index order, from their
shared q row; the rule then removes each rejected token from q as well.

Randomness: `verify` draws n+1 uniforms from the caller's generator up front: uniform c
decides node c's acceptance test and uniform n the emitted token (the deterministic-tree
rule draws at logits row r with uniform r). Every rule consumes them by index, so the
torch reference here and the Triton kernels (bench/core/verify_triton.py, used for greedy and
chains when the logits are on CUDA) agree for the same seed. The greedy kernel does not
reproduce torch.argmax on NaN logits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.core.draft import Draft
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig, process_logits

WITHOUT_REPLACEMENT = "without_replacement"  # Draft.meta key: sampled siblings drawn without replacement
use_triton = True  # module flag: False forces the torch reference everywhere
TRITON_DEVICES = ("cuda",)  # device types whose logits go through the Triton kernels
# Greedy verification is one argmax and a short walk, which the Triton walk does not make
# faster on a GPU (results/README.md, GPU), so greedy stays in torch unless asked; sampled
# chains go through Triton there, where it is faster end to end.
triton_greedy = False


@dataclass
class Verdict:
    accepted: list[int]  # draft node indices on the accepted path, root excluded
    next_token: int  # correction (first rejection) or bonus (all accepted)


def verify(draft: Draft, logits: Tensor, cfg: SamplingConfig,
           generator: torch.Generator | None = None) -> Verdict:
    """Dispatch to the rule that keeps the output distributed exactly as the target's."""
    check_inputs(draft, logits)
    if cfg.greedy:
        if triton_greedy and _triton_enabled(logits):
            return _verify_greedy_triton(draft, logits)
        return verify_greedy(draft, logits)
    probs = process_logits(logits, cfg).softmax(-1)
    uniforms = draw_uniforms(len(draft) + 1, generator, logits.device)
    if draft.is_chain:
        return verify_chain(draft, probs, uniforms)
    if draft.q is None:
        return verify_deterministic(draft, probs, uniforms)
    return verify_multidraft(draft, probs, uniforms)


def check_inputs(draft: Draft, logits: Tensor) -> None:
    """Bad drafts fail loudly here rather than verify with the wrong rule."""
    n = len(draft)
    if logits.dim() != 2 or logits.shape[0] != n + 1:
        raise BenchError(f"verify: logits shape {tuple(logits.shape)} does not match {n} draft nodes + root")
    vocab = logits.shape[1]
    if n and not 0 <= min(draft.tokens) <= max(draft.tokens) < vocab:
        raise BenchError(f"verify: draft token outside the vocabulary [0, {vocab})")
    if draft.q is not None and tuple(draft.q.shape) != (n, vocab):
        raise BenchError(f"verify: draft.q shape {tuple(draft.q.shape)} should be ({n}, {vocab})")
    without = bool(draft.meta.get(WITHOUT_REPLACEMENT, False))
    if draft.q is None:
        if draft.sampled_children or without:
            raise BenchError("verify: sampled drafts must record q, the distributions they were drawn from")
        return
    if not draft.is_chain and not draft.sampled_children:
        raise BenchError("verify: a tree with q must set sampled_children=True (siblings drawn independently "
                         "from q); trees of chosen children (top-k, n-grams) must pass q=None")
    if without:
        for siblings in _children(draft).values():
            if len({draft.tokens[c] for c in siblings}) != len(siblings):
                raise BenchError("verify: siblings drawn without replacement carry a repeated token")
            if any(not torch.equal(draft.q[c], draft.q[siblings[0]]) for c in siblings[1:]):
                raise BenchError("verify: siblings drawn without replacement must share one q row")


def draw_uniforms(count: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    source = generator.device if generator is not None else device
    return torch.rand(count, generator=generator, device=source).to(device)


def _children(draft: Draft) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(draft.parents):
        children.setdefault(parent, []).append(node)
    return children


# ---------------------------------------------------------------- greedy


def verify_greedy(draft: Draft, logits: Tensor) -> Verdict:
    """Walk from the root while some child carries the target's argmax (the first such
    child in node order when siblings repeat a token)."""
    targets = logits.argmax(-1).tolist()
    children = _children(draft)
    accepted: list[int] = []
    row = 0  # logits row of the current node (root)
    node = -1
    while True:
        wanted = targets[row]
        match = next((c for c in children.get(node, []) if draft.tokens[c] == wanted), None)
        if match is None:
            return Verdict(accepted, wanted)
        accepted.append(match)
        node, row = match, match + 1


# ---------------------------------------------------------------- sampling: chains


def verify_chain(draft: Draft, probs: Tensor, uniforms: Tensor) -> Verdict:
    """Leviathan et al. Alg. 1 on a chain; q None means one-hot drafts (n-grams, argmax)."""
    device = probs.device
    q = None if draft.q is None else draft.q.to(device)
    if _triton_enabled(probs):
        from bench.core import verify_triton
        tokens = torch.tensor(draft.tokens, dtype=torch.int32, device=device)
        out = verify_triton.chain_accept(probs, None if q is None else q.contiguous(), tokens, uniforms)
        n_accepted, token = verify_triton.chain_result(out, probs.shape[-1])
    else:
        tokens = torch.tensor(draft.tokens, dtype=torch.long, device=device)
        n_accepted, token = (int(x) for x in chain_reference(probs, q, tokens, uniforms))
    return Verdict(list(range(n_accepted)), token)


def chain_reference(probs: Tensor, q: Tensor | None, tokens: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Torch reference of the chain rule, without host syncs: (accepted count, token).

    Node i passes when u_i * q_i(d_i) < p_i(d_i), i.e. u_i < min(1, p/q) without the
    division (q(d) = 0 < p(d) passes, p(d) = 0 always fails). The chain stops at the
    first failure; the emitted token is drawn with uniform n from `chain_weights`."""
    n = tokens.numel()
    nodes = torch.arange(n, device=probs.device)
    p_drafted = probs[nodes, tokens]
    q_drafted = torch.ones_like(p_drafted) if q is None else q[nodes, tokens].float()
    passed = uniforms[:n] * q_drafted < p_drafted
    n_accepted = passed.long().cumprod(0).sum()  # length of the all-pass prefix
    return n_accepted, sample_inverse_cdf(chain_weights(probs, q, tokens, n_accepted), uniforms[n])


def chain_weights(probs: Tensor, q: Tensor | None, tokens: Tensor, n_accepted: Tensor) -> Tensor:
    """Unnormalised distribution of the emitted token: max(0, p_k - q_k) at the first
    rejected node k (p_k without d_k when q is one-hot), p_n (the bonus) when all n
    passed, and p_k itself if the residual has no mass (as DeepSpec's sample_residual)."""
    def row(table: Tensor, index: Tensor) -> Tensor:  # table[index] for a 0-d index, without a host sync
        return table.index_select(0, index.view(1)).squeeze(0)

    n = tokens.numel()
    p_row = row(probs, n_accepted)
    if n == 0:
        return p_row
    rejected = n_accepted < n
    k = n_accepted.clamp(max=n - 1)
    if q is None:
        q_row = (torch.arange(probs.shape[-1], device=probs.device) == row(tokens, k)).float()
    else:
        q_row = row(q, k).float()
    residual = (p_row - q_row * rejected).clamp(min=0)
    return torch.where(residual.sum() > 0, residual, p_row)


def sample_inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Draw from unnormalised weights [V] with one uniform: the first token whose CDF
    exceeds u * total. Requiring weight > 0 keeps masked tokens unreachable when float
    rounding flattens the CDF; the last positive-weight token catches u * total rounding
    past the end. No host sync."""
    cdf = weights.cumsum(-1)
    hit = (cdf > u * cdf[-1]) & (weights > 0)
    index = torch.arange(weights.numel(), device=weights.device)
    last_positive = torch.where(weights > 0, index, -1).max()
    return torch.where(hit.any(), hit.int().argmax(), last_positive)


# ---------------------------------------------------------------- sampling: trees


def verify_deterministic(draft: Draft, probs: Tensor, uniforms: Tensor) -> Verdict:
    """Sampling with deterministic children (q one-hot): draw y ~ p(node); descend if a
    child carries y, else emit y. Exact because the tree does not depend on the draw.
    (The same as testing each child c with probability r(c) and zeroing it on failure.)"""
    children = _children(draft)
    accepted: list[int] = []
    row, node = 0, -1
    while True:
        drawn = int(sample_inverse_cdf(probs[row], uniforms[row]))
        match = next((c for c in children.get(node, []) if draft.tokens[c] == drawn), None)
        if match is None:
            return Verdict(accepted, drawn)
        accepted.append(match)
        node, row = match, match + 1


def verify_multidraft(draft: Draft, probs: Tensor, uniforms: Tensor) -> Verdict:
    """SpecInfer multi-step speculative sampling, one tree level at a time.

    At a node: r <- p. For each child x_j in node order, with q_j the distribution it was
    drawn from: accept if u_j * q_j(x_j) < r(x_j) (u < min(1, r/q)) and descend; else
    r <- norm(max(0, r - q_j)). If no child is accepted, emit y ~ r. Each step is one
    speculative-sampling step of target r against proposal q_j, so the level emits
    exactly r = p as long as each x_j is drawn from q_j independently of the earlier
    rejections' uniforms. Without replacement, x_j is drawn from q with x_1..x_{j-1}
    removed, so the q update q <- norm(q without x_j) follows each rejection (recursive
    rejection sampling); plain MSS on such drafts would be biased."""
    q = draft.q.to(probs.device, torch.float32)
    without = bool(draft.meta.get(WITHOUT_REPLACEMENT, False))
    children = _children(draft)
    accepted: list[int] = []
    row, node = 0, -1
    while True:
        r = probs[row]
        q_next: Tensor | None = None  # without replacement: the shared q minus rejected siblings
        match = None
        siblings = children.get(node, [])
        for position, child in enumerate(siblings):
            token = draft.tokens[child]
            q_child = q[child] if q_next is None else q_next
            if uniforms[child] * q_child[token] < r[token]:
                match = child
                break
            r = _residual(r, q_child)
            if without and position + 1 < len(siblings):  # the last sibling may have emptied q
                q_next = _remove(q_child, token)
        if match is None:
            return Verdict(accepted, int(sample_inverse_cdf(r, uniforms[-1])))
        accepted.append(match)
        node, row = match, match + 1


def _residual(r: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, r - q)); r itself when that has no mass (then r = q and a rejection had probability 0)."""
    residual = (r - q).clamp(min=0)
    mass = residual.sum()
    return residual / mass if mass > 0 else r


def _remove(q: Tensor, token: int) -> Tensor:
    q = q.clone()
    q[token] = 0.0
    mass = q.sum()
    if mass <= 0:
        raise BenchError("verify: siblings drawn without replacement exhaust their q")
    return q / mass


# ---------------------------------------------------------------- Triton dispatch


def _triton_enabled(tensor: Tensor) -> bool:
    global use_triton
    if not use_triton or tensor.device.type not in TRITON_DEVICES:
        return False
    try:
        import bench.core.verify_triton  # noqa: F401  (lazy: CPU-only installs never import triton)
    except ImportError as error:
        warnings.warn(f"triton unavailable ({error}); verifying with the torch reference", stacklevel=3)
        use_triton = False
    return use_triton


def _verify_greedy_triton(draft: Draft, logits: Tensor) -> Verdict:
    from bench.core import verify_triton
    n = len(draft)
    tree = torch.tensor(draft.tokens + draft.parents, dtype=torch.int32, device=logits.device)
    out, _ = verify_triton.greedy_tree(logits.contiguous(), tree[:n], tree[n:], max(draft.depths(), default=0))
    accepted, next_token = verify_triton.greedy_result(out)
    return Verdict(accepted, next_token)
