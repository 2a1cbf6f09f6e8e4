"""Medusa-1 (Cai et al. 2401.10774): K extra heads on the target's last hidden state, a
static token tree, one target pass per round.

Heads. Head i (0-based) is ResBlock(d) x num_layers (x + SiLU(W x + b), W zero-initialised)
followed by the target's own lm_head (frozen, shared, not stored: Medusa's "legacy" head).
It reads the final normed hidden state (tap L = number of target layers) at position t and
predicts the token at t+2+i; the target itself gives t+1. At decode time the state at the
last committed row is the one whose logits produced the root, so head 0 on it predicts the
token after the root, head 1 the one after that, and so on.

Tree. Node paths are tuples of ranks, as Medusa's `medusa_choices`: (0, 2) = head 0's top-1
token, then head 1's top-3 token under it. Children are chosen, not sampled (q = None), so
the shared verifier is lossless at any temperature. The tree is built from per-head top-k
accuracies measured on held-out features: assuming heads err independently, node
(k1..kd) is accepted with probability prod_j P(head j's rank-kj token is right), where the
rank-k probability is top-k accuracy minus top-(k-1) accuracy; the expected number of
accepted drafts is the sum over nodes. Node values only shrink from parent to child, so
best-first expansion picks the `tree_size` most valuable nodes, which is optimal.

Acceptance. Default "exact": the shared verifier (lossless). Option acceptance=typical is
Medusa's typical acceptance, LOSSY when sampling: a draft token x passes if
p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))); the deepest passing path
wins (ties: the larger log-likelihood), and the next token is drawn from p with the tokens
below that cutoff removed. p is the target's distribution after the run's own transform
(temperature, top-k, top-p). At temperature 0 it is plain greedy verification.

Training (`bench train --method medusa`). Frozen target; features from the shared cache
(bench.training.features, tap L). Loss per head: soft cross-entropy against the target's
own distribution for that token (softmax(lm_head(h_L[t+1+i])), self-distillation: the heads
are judged against the target, not against ShareGPT's text), option labels=data for
Medusa's hard CE on the data token. Only (position, head) pairs whose label is an
assistant-reply token of the same conversation count. Head weights 0.8^i on per-head means.
A step = batch_size random windows of `window` consecutive positions (the target's label
logits are shared by the heads inside a window). The last 5% of conversations are held
out: the exported drafter records the heads' top-1..10 agreement with the target's greedy
token there, and the tree built from it.

Cost and defaults (SmolLM2-135M, V=49152, d=576): the lm_head projections dominate (per
window position: the target's label row, and per head the logits and their gradient,
computed block by block without storing [n, V] activations). batch_size 4 x window 128
gives ~400 valid positions per step (windows stop at conversation ends and reply
boundaries), so the CLI's default 600 steps see ~240k positions (~1 epoch of the
300k-token cache). Each export also measures the held-out accuracies (eval_positions
4096). Step and export times: results/README.md. settings.max_len is not used: the cache's
FeatureData fixes it.

Drafter formats (`--drafter FOLDER`; key names in methods/medusa/model.py):
- ours: drafter.json (method, target, architecture, accuracy, tree, training) + model.safetensors
  with keys "{head}.{layer}.linear.weight|bias" in bf16;
- FasterDecoding's: config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path) +
  medusa_lm_head.safetensors or medusa_lm_head.pt with "{head}.{layer}.linear.weight|bias" and,
  in the non-legacy layout, a per-head lm_head "{head}.{num_layers}.weight" [V, d];
- vLLM's: config.json (model_type medusa, num_heads, num_hidden_layers, truncated_vocab_size,
  medusa_fc_bias, original_lm_head) + model.safetensors with "blocks.{h}.layers.{l}.weight|bias",
  "lm_heads.{h}.weight" and token_map for a truncated vocabulary.
A folder made for another target (hidden size, vocabulary, tokenizer) is refused in one line.
Published heads carry no measured accuracies: their tree comes from PRIOR_TOP1 (or choices=...).
`bench export --method medusa --format medusa|medusa-vllm` writes either published layout.

Options of `bench run`: see `Options` below.

Files: model.py (the heads, drafter folders), tree.py (node values, best-first and
device-sized trees, Tree), drafter.py (decode time, typical acceptance), training.py
(`bench train --method medusa`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench.core.decode import LoopDecoder
from bench.core.drafters import find_drafter
from bench.core.errors import BenchError
from bench.core.options import DraftOptions, option, parse_options
from methods.medusa.drafter import ACCEPTANCE, MedusaDrafter, typical_acceptance
from methods.medusa.model import FORMAT, LAYOUTS, METHOD, MedusaHeads, export_heads, export_published, load_drafter
from methods.medusa.training import Features, MedusaObjective, MedusaTraining, cross_entropy_block
from methods.medusa.tree import (
    TOPK,
    Tree,
    build_tree,
    device_sized_tree,
    expected_accepted,
    prior_accuracy,
    rank_probabilities,
)

CONVENTION = ("FasterDecoding Medusa-1 legacy heads (medusa/model/medusa_model_legacy.py): ResBlocks, then the "
              "target's lm_head; head i predicts t+2+i")
EXPORT_FORMATS = LAYOUTS  # "medusa": FasterDecoding's layout; "medusa-vllm": vLLM's

__all__ = ["ACCEPTANCE", "CONVENTION", "EXPORT_FORMATS", "FORMAT", "METHOD", "TOPK", "Features", "MedusaDrafter",
           "MedusaHeads", "MedusaObjective", "MedusaTraining", "Options", "Tree", "build", "build_tree",
           "cross_entropy_block", "expected_accepted", "export", "export_heads", "rank_probabilities", "train",
           "typical_acceptance"]


@dataclass(frozen=True)
class Options(DraftOptions):
    """drafter: folder (ours or Medusa's; default: user-trained, then shipped); tree_size:
    "auto" (the best-first tree cut where expected tokens per second peak under this
    device's t_v(k), read from the stored `bench profile` of this machine and thread count
    when there is one, else timed for a few seconds at build, so the size can vary between
    builds; a drafter without measured accuracies gets its stored tree, else 63 nodes),
    "manifest" (the tree stored at training) or a node count; choices: explicit rank paths
    (JSON, e.g. [[0], [1], [0, 0]]; overrides tree_size); acceptance: exact | typical
    (lossy when sampling); posterior_threshold, posterior_alpha: typical acceptance's.

    --budget K: tree_size = K (the K most valuable nodes; choices may not be given)."""

    drafter: str | None = None
    tree_size: int | Literal["auto", "manifest"] = option("auto", min=1)
    choices: tuple[tuple[int, ...], ...] | None = option(None, min=0)
    acceptance: Literal["exact", "typical"] = "exact"
    posterior_threshold: float = option(0.09, above=0.0, max=1.0)
    posterior_alpha: float = option(0.3, above=0.0, max=1.0)

    @classmethod
    def budget_knobs(cls, budget: int) -> dict:
        return {"tree_size": budget, "choices": None}

    def draft_budget(self) -> int | None:
        if self.choices is not None:
            return len(set(self.choices))
        return self.tree_size if isinstance(self.tree_size, int) else None


def build(target, options: dict | Options | None = None) -> LoopDecoder:
    opts = parse_options(Options, options, METHOD)
    folder = find_drafter(target.name, METHOD, opts.drafter)
    heads, accuracy, stored_tree, info = load_drafter(target, folder)
    if opts.choices is not None:
        paths, source = opts.choices, "choices option"
    elif opts.tree_size == "auto" and accuracy:
        paths = device_sized_tree(target, accuracy)
        source = f"sized for this device: {len(paths)} nodes"
    elif stored_tree is not None and opts.tree_size in ("manifest", "auto"):
        paths, source = stored_tree, "manifest"
    elif opts.tree_size == "manifest":
        raise BenchError(f"medusa tree_size=manifest: drafter {folder} stores no tree")
    else:  # a number, or "auto" for a drafter with neither accuracies nor a tree: 63 as Medusa's
        size = 63 if opts.tree_size == "auto" else opts.tree_size
        paths = build_tree(accuracy or prior_accuracy(heads.num_heads), size)
        source = "measured accuracies" if accuracy else "prior accuracies"
    tree = Tree.from_paths(paths, heads.num_heads)
    if not tree.paths:
        raise BenchError("medusa tree is empty")
    engine = target.engine
    heads = heads.to_engine(engine.device, engine.dtype).eval()
    for p in heads.parameters():
        p.requires_grad_(False)
    drafter = MedusaDrafter(heads, engine.lm_head, engine.num_layers, tree, opts.acceptance,
                            opts.posterior_threshold, opts.posterior_alpha)
    info = dict(info, tree_size=len(tree.paths), tree_depth=tree.depth, tree_source=source,
                acceptance=opts.acceptance)
    if accuracy:
        info["expected_accepted"] = round(expected_accepted(list(tree.paths), accuracy), 3)
    return LoopDecoder(target, drafter, info)


def export(target, drafter: str | None, fmt: str, out: Path) -> Path:
    """`bench export --method medusa --format medusa|medusa-vllm`: the heads (ours or a
    published folder) in FasterDecoding's or vLLM's layout, weights exact."""
    heads, *_ = load_drafter(target, find_drafter(target.name, METHOD, drafter))
    return export_published(heads, target, fmt, Path(out))


def train(target, settings) -> dict:
    """`bench train --method medusa`: see methods/medusa/training.py."""
    from methods.medusa.training import train_medusa

    return train_medusa(target, settings)
