"""FR-Spec (Zhao et al. 2502.14856, thunlp/FR-Spec): draft over the most frequent tokens only.

EAGLE-1 and EAGLE-2 turn every draft level's feature into tokens through the target's whole
lm_head, and for a small target that read is most of a draft step (49152 x 576 here, against
a one-layer head). FR-Spec projects onto the N most frequent tokens of a corpus instead, and
softmaxes over those; the target still verifies every draft, so the output is unchanged and
only which tokens can be drafted is. The corpus here is the target's own self-distilled
replies (`bench distill`, the data the heads are trained on), counted at build in a few
seconds; the end-of-turn ids are always kept.

    bench run --method eagle2 --task mtbench --option draft_vocab=16384

`draft_vocab=0` (the default) is EAGLE's convention, the full vocabulary. EAGLE-3 drafts
over its own trained draft vocabulary and does not take the option.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from bench.training.distill import DistilledData, find_distilled, reply_token_counts


@functools.cache
def _counts(folder: str, vocab_size: int) -> Tensor:
    return reply_token_counts(Path(folder), vocab_size)


def frequent_tokens(target, size: int) -> tuple[Tensor, dict]:
    """The `size` most frequent reply tokens of the target's distilled data and its EOS ids,
    sorted; and where they were counted (for the run's records)."""
    folder = find_distilled(target)
    counts = _counts(str(folder), target.config.vocab_size).float()
    ranked = counts.clone()
    ranked[torch.tensor(list(target.eos_token_ids), dtype=torch.long)] = float("inf")
    ids = ranked.topk(min(size, len(ranked))).indices.sort().values
    return ids, {"size": len(ids), "counted_in": folder.name, "reply_tokens": DistilledData(folder).reply_tokens,
                 "coverage": round(float(counts[ids].sum() / counts.sum().clamp(min=1)), 4)}
