"""Row-wise reductions over a full vocabulary for the fused (no-autograd) lm_head losses.

Trainers that score every draft position against a 49152-token vocabulary compute each
chunk's logits, loss and logit gradient at once (Medusa, MTP). On a CPU the
vocabulary-wide elementwise passes cost as much as the lm_head matmuls, and some aten
reductions are several times slower than others that give the same numbers: the row dot
as bmm or einsum, max with indices and logsumexp against vecdot, amax and softmax
(a retired script timed them: results/<target>/profile/vocab-rows-*.json, results/ARCHIVE.md).
These helpers use the fast ones.
"""

from __future__ import annotations

import torch
from torch import Tensor


def softmax_lse(z: Tensor) -> tuple[Tensor, Tensor]:
    """(softmax(z), logsumexp(z)) of each row of fp32 logits z [m, V].
    The softmax's largest entry is exp(0) / sum exp(z - max z), so log-sum-exp is
    max z - log(max softmax): one fused softmax pass and two cheap amax passes."""
    q = z.softmax(-1)
    return q, z.amax(-1) - q.amax(-1).log()


def rowdot(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a[m, v] * b[m, v] of each row, without an [m, V] temporary."""
    return torch.linalg.vecdot(a, b)


def agrees(q: Tensor, index: Tensor) -> Tensor:
    """Whether index[m] is an argmax of row m of q [m, V] (probabilities or logits)."""
    return q.gather(1, index[:, None]).squeeze(1) == q.amax(-1)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, p: Tensor) -> Tensor:
        q, lse = softmax_lse(z)
        ctx.save_for_backward(q, p)
        return lse - rowdot(p, z)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        q, p = ctx.saved_tensors
        return (q - p) * grad[:, None], None


def soft_cross_entropy(z: Tensor, p: Tensor) -> Tensor:
    """-(p . log_softmax(z)) of each row, for fp32 logits z [m, V] and target probabilities p
    (rows summing to 1, no gradient): log-sum-exp(z) - p . z, whose logit gradient is
    softmax(z) - p, kept from the forward's one softmax pass (no [m, V] log-softmax, product
    or their backward passes)."""
    return _SoftCrossEntropy.apply(z, p)
