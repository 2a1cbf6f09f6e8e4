"""MTP: multi-token prediction modules trained on the frozen target, used as drafters.

Two variants (`--option variant=...`), both sharing the target's embedding and lm_head
(frozen, never stored) and trained by distillation on the cached target features
(bench.training.features).

sequential (default; DeepSeek-V3 2412.19437 §2.2, one module applied recursively)
    row j, the pair (h_{j-1}, x_j) at RoPE position j-1 (the feature's position):
        x   = Linear_2d->d([RMSNorm(Emb(x_j)); RMSNorm(h_{j-1})])   (eh_proj, enorm, hnorm)
        g_j = RMSNorm_final(DecoderLayer(x))                         (shared_head.norm; causal)
        q_j = softmax(lm_head(g_j))  ~ the target's p(x_{j+1} | x_<=j)
    h = the target's final normed hidden state (tap L, what vLLM and SGLang hand their MTP
    modules). Because h_{j-1} already predicts x_j, the module predicts one token further:
    x_{t+2} from h_t, as in DeepSeek's MTP-1. Drafting chains the module on its own normed
    output g (methods/mtp/drafter.py); training unrolls that chain `ttt_steps` times
    (methods/mtp/model.py, chained_outputs).

Convention (CONVENTION below): DeepSeek-V3's, as vLLM (deepseek_mtp.py), SGLang
(deepseek_nextn.py) and speculators (models/mtp) run it: embedding half first, the row at
the feature's position, one decoder layer shaped like the target's, a final RMSNorm, the
target's embedding and lm_head shared (never stored). Named deviation: `fuse_order=
hidden_first` ([RMSNorm(h); RMSNorm(Emb(x))], Xiaomi MiMo's order and that of our drafters
trained before this default; a drafter.json without "fuse_order" is read so), a training
option recorded in drafter.json and in run records ("fuse_order", "layout"). Our older
drafters also placed the row at the token's position j; RoPE scores depend only on position
differences, so reading them at j-1 computes the same function (up to rounding). Training
differs from speculators' on purpose (EAGLE-3's TTT mask instead of full causal passes over
the chained rows, KL to the target instead of CE on data tokens, step weights 0.8^k instead
of 0.6^k), which changes no weight layout. Published layouts (speculators `mtp`, DeepSeek-V3,
Qwen3-Next, MiMo keys) load through --drafter and export to speculators:
methods/mtp/layouts.py.

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
layouts.py (published layouts: reading, speculators export), loss.py (the fused
distillation loss), training.py (`bench train --method mtp`).

Decoding options: see `Options` below.

Training recipe (its duration is in results/README.md): `bench train --method mtp
--max-len 512 --batch-size 4 --lr 5e-4 --warmup-steps 20 --max-steps 600 --threads 1`
(600 steps of 4 conversations = about 3.7 epochs of the shared 300k-token cache), plus
`--option variant=parallel` for the heads. The shipped drafter used `--option
self_distill=true --option feature_tokens=200000 --warmup-steps 30 --max-steps 500`.
Options: see training.MtpSettings.

The training step's and drafting's measured costs are in results/README.md; the fused
loss is most of a training step. Init: after 60 steps (2 x 256 tokens)
the last-layer init (starts at KL 15-20 from the target) and a random layer (starts at
12-13) both reach held-out step-1 KL 5.2-5.4 and top-1 agreement 0.12-0.14, i.e. no
difference that short; the last layer stays the default (see training.init_model).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bench.core.decode import LoopDecoder
from bench.core.drafters import WEIGHTS
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, Dtype, option, parse_options
from methods.mtp.drafter import MAX_DEPTH, make_drafter
from methods.mtp.store import METHOD, find_folder, load_model

if TYPE_CHECKING:
    from bench.core.target import Target
    from bench.training import TrainSettings

__all__ = ["CONVENTION", "EXPORT_FORMATS", "METHOD", "Options", "build", "export", "train"]

CONVENTION = ("DeepSeek-V3 MTP (2412.19437 §2.2, as vLLM deepseek_mtp / speculators mtp): "
              "eh_proj([enorm(Emb(x_t+1)); hnorm(h_t)]) at h_t's position, one layer, final norm, "
              "shared embedding and lm_head; option fuse_order=hidden_first (MiMo, older drafters)")
EXPORT_FORMATS = ("speculators",)


@dataclass(frozen=True)
class Options(DraftOptions):
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
    sha1 = manifest.get("weights_sha1") or hashlib.sha1(
        (folder / manifest.get("weights", WEIGHTS)).read_bytes()).hexdigest()[:12]
    info = {"drafter": str(folder), "variant": manifest["variant"], "depth": drafter.depth, "sample": opts.sample,
            "tap": manifest.get("tap"), "draft_dtype": str(dtype).removeprefix("torch."),
            "layout": manifest["layout"], "fuse_order": manifest["fuse_order"],
            "trained_steps": training.get("steps"), "heldout_acc": training.get("heldout", {}).get("acc"),
            "weights_sha1": sha1}
    return LoopDecoder(target, drafter, info)


def export(target: Target, drafter: str | None, fmt: str, out: Path) -> Path:
    """`bench export --method mtp --format speculators`: the sequential drafter (`drafter`, else
    the user's trained one, else the shipped one) as a speculators `mtp` folder, in the dtype
    its weights are stored in (methods/mtp/layouts.write_speculators). A hidden_first module
    is written with its projection's halves swapped, the same function in speculators' order."""
    from bench.core.provenance import git_sha, timestamp
    from methods.mtp.layouts import write_speculators

    if fmt not in EXPORT_FORMATS:
        raise BenchError(f"mtp exports to {', '.join(EXPORT_FORMATS)}, not '{fmt}'")
    folder = find_folder(target, "sequential", drafter)
    model, manifest = load_model(target, folder)
    if manifest["variant"] != "sequential":
        raise BenchError(f"drafter {folder} is an mtp {manifest['variant']} drafter; the speculators mtp layout "
                         f"holds one sequential module")
    training = manifest.get("training", {})
    provenance = {"exported_by": "spec-bench-harness", "source": str(folder), "source_layout": manifest["layout"],
                  "source_fuse_order": manifest["fuse_order"], "trained_steps": training.get("steps"),
                  "target_fingerprint": target.fingerprint, "git_sha": git_sha(), "exported_at": timestamp()}
    depth = min(manifest.get("depth") or 4, MAX_DEPTH)
    return write_speculators(target, model, Path(out), depth, manifest["weights_dtype"], provenance)


def train(target: Target, settings: TrainSettings) -> dict:
    """`bench train --method mtp`: see methods/mtp/training.py."""
    # Imported here so `bench run` never loads the training code. The module is training.py,
    # not train.py: importing a submodule methods.mtp.train would rebind the package's
    # `train` attribute to that module, and the registry's methods.mtp.train(...) would break.
    from methods.mtp.training import train_mtp

    return train_mtp(target, settings)
