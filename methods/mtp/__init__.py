"""MTP: multi-token prediction modules trained on the frozen target, used as drafters.

Two variants (`--option variant=...`), both sharing the target's embedding and lm_head
(frozen, never stored) and trained by distillation on the cached target features
(bench.core.training.features).

sequential (default; DeepSeek-V3 2412.19437 §2.2, one module applied recursively)
    row j (position j):   x = Linear_2d->d([RMSNorm(h_{j-1}); RMSNorm(Emb(x_j))])
                          g_j = RMSNorm_final(DecoderLayer(x))       (causal over the rows)
                          q_j = softmax(lm_head(g_j))  ~ the target's p(x_{j+1} | x_<=j)
    h = the target's final normed hidden state (tap L). Because h_{j-1} already predicts
    x_j, the module predicts one token further: x_{t+2} from h_t, as in DeepSeek's MTP-1.
    Drafting chains the module on its own output (methods/mtp/drafter.py); training
    unrolls that chain `ttt_steps` times (methods/mtp/model.py, chained_outputs).

parallel (Gloeckle et al. 2404.19737, blockwise parallel)
    n heads (default 3), each one decoder layer over the target's trunk features (tap T,
    default L-2 = 28 for SmolLM2: the input of layer 28, i.e. the trunk minus the last two
    layers; the shared feature cache has taps 27, 28, 30 but not 29, and adding a tap costs
    a full target pass over the data), then its own final RMSNorm (initialised from the
    target's) and the shared lm_head. Head k at position t predicts x_{t+1+k}; the target
    itself is "head 0". One proposal reads every head at one position, so no recursion.

Index offsets (what predicts what; see the tests): the training teacher of sequential row
j is the target's distribution at position j, lm_head(h_j); parallel head k at row t is
taught by the target's distribution at t+k. At decode the draft d_k sits at position s+k
and is verified by the target's distribution at s+k-1: the same pairs.

Files: model.py (the modules, their shape and training-time recursion), drafter.py
(decode-time drafting and caches), store.py (the drafter folder: name, format, loading),
loss.py (the fused distillation loss), training.py (`bench train --method mtp`).

Decoding options: see `Options` below.

Training recipe (its duration is in results/README.md): `bench train --method mtp
--max-len 512 --batch-size 4 --lr 5e-4 --warmup-steps 20 --max-steps 600 --threads 1`
(600 steps of 4 conversations = about 3.7 epochs of the shared 300k-token cache), plus
`--option variant=parallel` for the heads. Options: see training.MtpSettings.

The training step's and drafting's measured costs are in results/README.md; the fused
loss is most of a training step. Init: after 60 steps (2 x 256 tokens)
the last-layer init (starts at KL 15-20 from the target) and a random layer (starts at
12-13) both reach held-out step-1 KL 5.2-5.4 and top-1 agreement 0.12-0.14, i.e. no
difference that short; the last layer stays the default (see training.init_model).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from bench.core.decode import LoopDecoder
from bench.core.drafters import WEIGHTS
from bench.core.options import Dtype, option, parse_options
from methods.mtp.drafter import MAX_DEPTH, make_drafter
from methods.mtp.store import METHOD, find_folder, load_model

if TYPE_CHECKING:
    from bench.core.target import Target
    from bench.core.training import TrainSettings

__all__ = ["METHOD", "Options", "build", "train"]


@dataclass(frozen=True)
class Options:
    """variant: sequential | parallel (default sequential, or the manifest's for an explicit
    drafter); depth: chain length (default 4 sequential, every head parallel; parallel
    allows at most its heads); sample: at T > 0 draw drafts from the module's warped q and
    record it for the min(1, p/q) rule (default false: argmax drafts, q one-hot, exact at
    any temperature); draft_dtype: bfloat16 by default (the drafter only proposes);
    drafter: folder.

    --budget K: depth = K."""

    variant: Literal["sequential", "parallel"] | None = None
    depth: int | None = option(None, min=1, max=MAX_DEPTH)
    sample: bool = False
    drafter: str | None = None
    draft_dtype: Dtype = "bfloat16"

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"depth": budget}

    def draft_budget(self) -> int | None:
        return self.depth


def build(target: Target, options: dict | Options | None = None) -> LoopDecoder:
    """`bench run --method mtp`: the decoding options above, then the drafter they name."""
    from bench.core.target import parse_dtype

    opts = parse_options(Options, options, METHOD)
    dtype = parse_dtype(opts.draft_dtype)
    folder = find_folder(target, opts.variant, opts.drafter)
    model, manifest = load_model(target, folder, opts.variant)
    drafter = make_drafter(target, model, manifest, opts.depth, opts.sample, dtype)
    training = manifest.get("training", {})
    info = {"drafter": str(folder), "variant": manifest["variant"], "depth": drafter.depth, "sample": opts.sample,
            "tap": manifest.get("tap"), "draft_dtype": str(dtype).removeprefix("torch."),
            "trained_steps": training.get("steps"), "heldout_acc": training.get("heldout", {}).get("acc"),
            "weights_sha1": hashlib.sha1((folder / manifest.get("weights", WEIGHTS)).read_bytes()).hexdigest()[:12]}
    return LoopDecoder(target, drafter, info)


def train(target: Target, settings: TrainSettings) -> dict:
    """`bench train --method mtp`: see methods/mtp/training.py."""
    # Imported here so `bench run` never loads the training code. The module is training.py,
    # not train.py: importing a submodule methods.mtp.train would rebind the package's
    # `train` attribute to that module, and the registry's methods.mtp.train(...) would break.
    from methods.mtp.training import train_mtp

    return train_mtp(target, settings)
