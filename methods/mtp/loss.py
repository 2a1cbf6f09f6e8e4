"""The fused distillation loss of MTP training: KL(target || module) per chain step / head.

The [rows, vocab] logits are never kept: one autograd Function computes loss and gradient
chunk by chunk, because the lm_head over the 49152-token vocabulary is nearly all the cost
of a training step, and with the lm_head matmuls in bfloat16 (faster than fp32 where bf16
matmul is native; measured in results/README.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.training.vocab_rows import agrees, rowdot, softmax_lse


class _DistillLoss(torch.autograd.Function):
    """sum_{s,r} weight[s,r] * KL(p_r || q_{s,r}) with p_r = softmax(lm_head(teacher_r)) and
    q_{s,r} = softmax(lm_head(student_{s,r})). Forward computes the gradient too, chunk by
    chunk, so no [rows, vocab] tensor outlives its chunk; the vocabulary-wide elementwise
    work (as costly as the matmuls on a CPU) is kept to a few in-place passes. Also returns
    per-step stats [steps, 4]: KL sum, top-1 agreements, sum of min(p, q) (the T=1
    acceptance; only when no gradient is needed), rows. The row reductions are
    bench.training.vocab_rows's fast ones."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, weight: Tensor, lm_head: Tensor,
                chunk: int, dtype: torch.dtype):
        steps, rows = weight.shape
        need_grad = ctx.needs_input_grad[0]
        grad = torch.zeros_like(student) if need_grad else None
        loss = torch.zeros((), device=student.device)
        stats = torch.zeros(steps, 4, device=student.device)
        head = lm_head.to(dtype)
        for a in range(0, rows, chunk):
            b = min(rows, a + chunk)
            z_t = F.linear(teacher[a:b].to(dtype), head).float()
            best = z_t.argmax(-1)
            p, lse_t = softmax_lse(z_t)
            neg_entropy = rowdot(p, z_t) - lse_t  # sum p log p
            del z_t
            for s in range(steps):
                w = weight[s, a:b]
                valid = w > 0
                if not bool(valid.any()):
                    continue
                z = F.linear(student[s, a:b].to(dtype), head).float()
                q, lse = softmax_lse(z)
                kl = neg_entropy - rowdot(p, z) + lse  # sum p (log p - log q)
                loss += (w * kl).sum()
                stats[s, 0] += kl[valid].sum()
                stats[s, 1] += agrees(q, best)[valid].sum()
                stats[s, 3] += valid.sum()
                del z
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
    """(loss, per-step stats [steps, 4]); see _DistillLoss."""
    return _DistillLoss.apply(student, teacher, weight, lm_head, chunk, dtype)
