"""The one logits transform shared by the AR baseline and every method.

Order: temperature -> top-k -> top-p (as vLLM's `compute_probs`). Temperature 0 means
argmax; torch.argmax takes the first maximum, and every path uses it, so ties break
the same way in the baseline and in verification.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def process_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """Warp logits [..., V] for sampling; masked entries become -inf. Not for greedy."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (keep at least one).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """p = softmax(process(logits)); one-hot on the argmax when greedy."""
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return process_logits(logits, cfg).softmax(-1)


def sample(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """Draw one token from a single row of logits [V]."""
    if cfg.greedy:
        return int(logits.argmax())
    return sample_from(process_logits(logits, cfg).softmax(-1), generator)


def sample_from(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
