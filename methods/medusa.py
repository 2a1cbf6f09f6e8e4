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
(bench.core.training.features, tap L). Loss per head: soft cross-entropy against the target's
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

Drafter formats (`--drafter FOLDER`):
- ours: drafter.json (method, target, architecture, accuracy, tree, training) + model.safetensors
  with keys "{head}.{layer}.linear.weight|bias" in bf16;
- Medusa's: config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path) +
  medusa_lm_head.safetensors or medusa_lm_head.pt with "{head}.{layer}.linear.weight|bias" and,
  in the non-legacy layout, a per-head lm_head "{head}.{num_layers}.weight" [V, d]. Without
  measured accuracies its tree comes from PRIOR_TOP1 (or pass choices=...).

Options of `bench run`: drafter, tree_size (default auto: the best-first tree cut where
expected tokens per second peak under this device's t_v(k), read from the stored
`bench profile` of this machine and thread count when there is one, else timed for a few
seconds at build, so the size can vary between builds; "manifest": the tree
stored at training, 63 nodes; or a number),
choices (a JSON list of rank paths, overrides the tree), acceptance (exact | typical),
posterior_threshold (0.09), posterior_alpha (0.3).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.decode import DecodeState, Drafter, LoopDecoder
from bench.core.draft import Draft
from bench.core.drafters import MANIFEST, WEIGHTS, check_target, find_drafter, read_manifest, write_drafter
from bench.core.engine import ForwardOutput
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig, process_logits
from bench.core.verify import Verdict, verify, verify_greedy

METHOD = "medusa"
FORMAT = "spec-bench-medusa/1"
TOPK = 10  # ranks per head the tree may use, and the top-k accuracies measured
ACCEPTANCE = ("exact", "typical")
THEIR_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# Rough top-1 agreement per head for published heads that carry no measurements; rank k
# then gets top1 * 0.4^(k-1). Only used to shape a tree when nothing better is known.
PRIOR_TOP1 = (0.6, 0.42, 0.3, 0.21, 0.15)


# ---------------------------------------------------------------------- heads
class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as x + SiLU(b): close to the target's own prediction

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The trainable part: per head a stack of ResBlocks. Logits need an lm_head: the
    target's (shared), or per-head matrices from a published non-legacy checkpoint."""

    def __init__(self, hidden: int, num_heads: int = 5, num_layers: int = 1) -> None:
        super().__init__()
        self.hidden, self.num_heads, self.num_layers = hidden, num_heads, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self.own_lm_heads: list[Tensor] | None = None  # [V, d] per head (Medusa's non-legacy layout)

    def states(self, hidden: Tensor, heads: int | None = None) -> Tensor:
        """[..., d] -> [heads, ..., d]: each head's state before the lm_head."""
        return torch.stack([block(hidden) for block in self.blocks[: heads or self.num_heads]])

    def logits(self, hidden: Tensor, lm_head: Tensor, heads: int | None = None) -> Tensor:
        """[n, d] -> [heads, n, V]; one pass over the shared lm_head for all heads."""
        states = self.states(hidden, heads)
        if self.own_lm_heads is not None:
            return torch.stack([F.linear(s, w) for s, w in zip(states, self.own_lm_heads)])
        return F.linear(states, lm_head)

    def export_state(self) -> dict[str, Tensor]:
        """Medusa's key names: "{head}.{layer}.linear.weight|bias"."""
        return {name.removeprefix("blocks."): p.detach() for name, p in self.named_parameters()}

    def load_export_state(self, state: dict[str, Tensor], folder: Path) -> None:
        own = {f"blocks.{k}": v for k, v in state.items()}
        expected = self.state_dict()
        missing = [k for k in expected if k not in own]
        if missing:
            raise BenchError(f"medusa drafter {folder} lacks weights {missing[0].removeprefix('blocks.')}")
        for name, value in expected.items():
            if tuple(own[name].shape) != tuple(value.shape):
                raise BenchError(f"medusa drafter {folder}: {name.removeprefix('blocks.')} has shape "
                                 f"{tuple(own[name].shape)}, expected {tuple(value.shape)}")
        self.load_state_dict({k: own[k].float() for k in expected})


# ----------------------------------------------------------------------- tree
def rank_probabilities(topk_accuracy: list[list[float]]) -> list[list[float]]:
    """Cumulative top-k accuracy per head -> P(the rank-k token is the right one)."""
    out = []
    for row in topk_accuracy:
        previous = 0.0
        ranks = []
        for value in row:
            ranks.append(max(0.0, value - previous))
            previous = max(previous, value)
        out.append(ranks)
    return out


def prior_accuracy(num_heads: int) -> list[list[float]]:
    """Cumulative top-k accuracies from PRIOR_TOP1 (heads beyond it decay by 0.7)."""
    table = []
    for i in range(num_heads):
        top1 = PRIOR_TOP1[i] if i < len(PRIOR_TOP1) else PRIOR_TOP1[-1] * 0.7 ** (i + 1 - len(PRIOR_TOP1))
        table.append([top1 * (1 - 0.4 ** k) / 0.6 for k in range(1, TOPK + 1)])
    return table


def path_value(path: tuple[int, ...], ranks: list[list[float]]) -> float:
    value = 1.0
    for depth, rank in enumerate(path):
        value *= ranks[depth][rank]
    return value


def expected_accepted(paths: list[tuple[int, ...]], topk_accuracy: list[list[float]]) -> float:
    """Expected accepted drafts per round under independent heads: sum of node values."""
    ranks = rank_probabilities(topk_accuracy)
    return sum(path_value(tuple(p), ranks) for p in paths)


def build_tree(topk_accuracy: list[list[float]], size: int = 63, topk: int = TOPK) -> list[tuple[int, ...]]:
    """The `size` nodes (rank paths) with the largest acceptance probability, best first.
    A child is never worth more than its parent, so best-first expansion from the root
    keeps the set connected and maximises the expected accepted length."""
    ranks = rank_probabilities(topk_accuracy)
    depth_limit = len(ranks)
    frontier = [(-path_value((k,), ranks), (k,)) for k in range(min(topk, len(ranks[0])))] if ranks else []
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < size:
        _, path = heapq.heappop(frontier)  # ties: the smaller path (lower ranks, shallower) first
        chosen.append(path)
        if len(path) < depth_limit:
            for k in range(min(topk, len(ranks[len(path)]))):
                child = path + (k,)
                heapq.heappush(frontier, (-path_value(child, ranks), child))
    return chosen


@dataclass(frozen=True)
class Tree:
    """A static tree in topological order: nodes sorted by (depth, path)."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    heads: Tensor  # [n] head index (= depth - 1) per node
    ranks: Tensor  # [n] rank within that head's top-k
    depth_ends: tuple[int, ...]  # depth_ends[d-1] = number of nodes of depth <= d

    @classmethod
    def from_paths(cls, paths, num_heads: int) -> Tree:
        try:
            ordered = sorted({tuple(int(k) for k in p) for p in paths}, key=lambda p: (len(p), p))
        except (TypeError, ValueError):
            raise BenchError("medusa choices must be a list of rank lists, e.g. [[0], [1], [0, 0]]") from None
        index = {p: i for i, p in enumerate(ordered)}
        parents = []
        for p in ordered:
            if not p or len(p) > num_heads or min(p) < 0 or max(p) >= TOPK:
                raise BenchError(f"medusa tree path {list(p)}: need 1..{num_heads} ranks, each in 0..{TOPK - 1}")
            if len(p) > 1 and p[:-1] not in index:
                raise BenchError(f"medusa tree path {list(p)} lacks its parent {list(p[:-1])}")
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        depth = max((len(p) for p in ordered), default=0)
        ends = tuple(sum(1 for p in ordered if len(p) <= d) for d in range(1, depth + 1))
        return cls(paths=tuple(ordered), parents=tuple(parents),
                   heads=torch.tensor([len(p) - 1 for p in ordered], dtype=torch.long),
                   ranks=torch.tensor([p[-1] for p in ordered], dtype=torch.long), depth_ends=ends)

    @property
    def depth(self) -> int:
        return len(self.depth_ends)

    def draft(self, topk_tokens: Tensor, max_depth: int) -> Draft:
        """Fill the tree from each head's top-k tokens [heads, >= max rank + 1], cut at max_depth."""
        depth = min(self.depth, max_depth)
        if depth < 1:
            return Draft.empty()
        n = self.depth_ends[depth - 1]
        tokens = topk_tokens[self.heads[:n], self.ranks[:n]].tolist()
        return Draft(tokens=tokens, parents=list(self.parents[:n]))


# ---------------------------------------------------------- typical acceptance
def typical_acceptance(draft: Draft, logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
                       posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> Verdict:
    """Medusa's typical acceptance on a tree (LOSSY when sampling). logits: [n+1, V], row 0
    the root's. Node c passes if p_parent(token_c) > min(threshold, alpha * exp(-H(p_parent)));
    the deepest node whose whole path passes wins (ties: the larger sum of log p, then node
    order); the next token is drawn from p at that node, restricted to p >= the same cutoff
    (the likeliest token always kept). Greedy: the exact greedy walk, as in Medusa."""
    if cfg.greedy:
        return verify_greedy(draft, logits)
    probs = process_logits(logits, cfg).softmax(-1)
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    cutoff = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    best, best_key = -1, (0, 0.0)
    score: list[tuple[int, float] | None] = []  # per node: (depth, log-likelihood) if its path passes
    if len(draft):
        rows = torch.tensor(draft.parents, device=probs.device) + 1
        p_token = probs[rows, torch.tensor(draft.tokens, device=probs.device)]
        passes = (p_token > cutoff[rows]).tolist()
        log_p = p_token.clamp(min=1e-30).log().tolist()
    for node, parent in enumerate(draft.parents):
        above = (0, 0.0) if parent < 0 else score[parent]
        ok = above is not None and passes[node]
        score.append((above[0] + 1, above[1] + log_p[node]) if ok else None)
        if ok and score[node] > best_key:
            best, best_key = node, score[node]
    accepted = []
    node = best
    while node >= 0:
        accepted.insert(0, node)
        node = draft.parents[node]
    row = best + 1
    floor = torch.minimum(cutoff[row], probs[row].max())  # the likeliest token always stays
    kept = torch.where(probs[row] >= floor, probs[row], torch.zeros_like(probs[row]))
    source = generator.device if generator is not None else kept.device
    next_token = int(torch.multinomial(kept.to(source), 1, generator=generator))
    return Verdict(accepted, next_token)


# -------------------------------------------------------------------- drafter
class MedusaDrafter(Drafter):
    name = METHOD

    def __init__(self, heads: MedusaHeads, lm_head: Tensor, tap: int, tree: Tree, acceptance: str = "exact",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        if acceptance not in ACCEPTANCE:
            raise BenchError(f"medusa acceptance '{acceptance}' unknown (choose from {', '.join(ACCEPTANCE)})")
        if tree.depth > heads.num_heads:
            raise BenchError(f"medusa tree depth {tree.depth} exceeds the drafter's {heads.num_heads} heads")
        self.heads, self.lm_head, self.tree = heads, lm_head, tree
        self.taps = (tap,)
        self.tap = tap
        self.acceptance = acceptance
        self.lossless = acceptance == "exact"  # typical acceptance changes the output distribution
        self.posterior_threshold, self.posterior_alpha = posterior_threshold, posterior_alpha
        self.ranks_needed = int(tree.ranks.max()) + 1 if len(tree.paths) else 1
        self.hidden: Tensor | None = None  # target state at the last committed row: its logits gave the root

    def begin(self, state: DecodeState, prefill: ForwardOutput) -> None:
        self.hidden = prefill.hidden[self.tap][-1]

    @torch.inference_mode()
    def head_logits(self, hidden: Tensor, heads: int) -> Tensor:
        """[heads, V]: head i's logits for the token i+1 places after the root."""
        return self.heads.logits(hidden[None], self.lm_head, heads)[:, 0]

    def propose(self, state: DecodeState) -> Draft:
        room = state.config.max_new_tokens - len(state.generated) - 1  # the verify pass adds one itself
        depth = min(self.tree.depth, room)
        if depth < 1 or self.hidden is None:
            return Draft.empty()
        logits = self.head_logits(self.hidden, depth)
        return self.tree.draft(logits.topk(self.ranks_needed, dim=-1).indices.cpu(), depth)

    def learn(self, state: DecodeState, draft: Draft, verdict: Verdict, out: ForwardOutput,
              rows: list[int]) -> None:
        self.hidden = out.hidden[self.tap][rows[-1]]

    def verify(self, draft: Draft, logits: Tensor, cfg: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        """Acceptance rule for the round (a runner hook: Drafter.verify)."""
        if self.acceptance == "typical":
            return typical_acceptance(draft, logits, cfg, generator, self.posterior_threshold, self.posterior_alpha)
        return verify(draft, logits, cfg, generator)


class MedusaDecoder(LoopDecoder):
    def __init__(self, target, drafter: MedusaDrafter, info: dict) -> None:
        super().__init__(target, drafter)
        self.info = info


# --------------------------------------------------------------------- loading
def _read_weights(path: Path) -> dict[str, Tensor]:
    try:
        if path.suffix == ".pt":
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            from safetensors.torch import load_file

            state = load_file(str(path))
    except Exception as exc:
        raise BenchError(f"cannot read medusa weights {path}: {exc}") from None
    if not isinstance(state, dict):
        raise BenchError(f"medusa weights {path} are not a state dict")
    return {k.removeprefix("medusa_head."): v for k, v in state.items()}


def load_drafter(target, folder: Path) -> tuple[MedusaHeads, list[list[float]] | None, list | None, dict]:
    """Heads (fp32, CPU), measured top-k accuracies, the stored tree and a description,
    from our format (drafter.json) or Medusa's (config.json + medusa_lm_head.*)."""
    folder = Path(folder)
    d, vocab = target.config.hidden_size, target.config.vocab_size
    if (folder / MANIFEST).exists():
        manifest = read_manifest(folder)
        if manifest.get("method") != METHOD:
            raise BenchError(f"drafter {folder} is a {manifest.get('method')} drafter, not {METHOD}")
        check_target(manifest, target, folder)
        arch = manifest.get("architecture", {})
        try:
            heads = MedusaHeads(int(arch["hidden"]), int(arch["num_heads"]), int(arch["num_layers"]))
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"medusa drafter {folder}: manifest architecture lacks "
                             "hidden/num_heads/num_layers") from None
        if heads.hidden != d:
            raise BenchError(f"medusa drafter {folder} has hidden size {heads.hidden}, target has {d}")
        weights = folder / manifest.get("weights", WEIGHTS)
        if not weights.exists():
            raise BenchError(f"medusa drafter {folder} has no weights file {weights.name}")
        heads.load_export_state(_read_weights(weights), folder)
        accuracy = manifest.get("accuracy", {}).get("topk")
        tree = manifest.get("tree", {}).get("paths")
        info = {"drafter": str(folder), "format": "spec-bench", "num_heads": heads.num_heads,
                "trained_steps": manifest.get("training", {}).get("steps")}
        return heads, accuracy, tree, info
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (OSError, ValueError, KeyError, TypeError):
        raise BenchError(f"{folder} is not a medusa drafter: needs {MANIFEST}, or a config.json with "
                         "medusa_num_heads") from None
    weights = next((folder / name for name in THEIR_WEIGHTS if (folder / name).exists()), None)
    if weights is None:
        raise BenchError(f"medusa drafter {folder} has neither {' nor '.join(THEIR_WEIGHTS)}")
    state = _read_weights(weights)
    heads = MedusaHeads(d, num_heads, num_layers)
    heads.load_export_state({k: v for k, v in state.items() if ".linear." in k}, folder)
    own = [state.get(f"{i}.{num_layers}.weight") for i in range(num_heads)]
    if any(w is not None for w in own):  # non-legacy: each head has its own d -> V projection
        if any(w is None or tuple(w.shape) != (vocab, d) for w in own):
            raise BenchError(f"medusa drafter {folder}: per-head lm_head weights must all be [{vocab}, {d}]")
        heads.own_lm_heads = [w.float() for w in own]
    info = {"drafter": str(folder), "format": "medusa", "num_heads": num_heads,
            "base_model": config.get("base_model_name_or_path"), "own_lm_heads": heads.own_lm_heads is not None}
    return heads, None, None, info


def _int_option(options: dict, key: str, default: int, low: int = 1) -> int:
    try:
        value = int(options.get(key, default))
    except (TypeError, ValueError):
        raise BenchError(f"medusa option {key} must be an integer, got {options.get(key)!r}") from None
    if value < low:
        raise BenchError(f"medusa option {key} must be >= {low}, got {value}")
    return value


def _float_option(options: dict, key: str, default: float) -> float:
    try:
        value = float(options.get(key, default))
    except (TypeError, ValueError):
        raise BenchError(f"medusa option {key} must be a number, got {options.get(key)!r}") from None
    if not 0.0 < value <= 1.0:
        raise BenchError(f"medusa option {key} must be in (0, 1], got {value}")
    return value


def device_sized_tree(target, accuracy: list[list[float]], largest: int = 64) -> list[tuple[int, ...]]:
    """The best-first tree cut where expected tokens per second peak on this device: node
    values come from the measured head accuracies, t_v(k) from the stored `bench profile` of
    this machine, else from a few seconds of timing (the heads' own cost is one pass,
    whatever the tree size, so it does not move the cut)."""
    from bench.core.costs import best_size, quick_chain_costs, stored_chain_costs

    paths = build_tree(accuracy, largest)
    ranks = rank_probabilities(accuracy)
    gains = [0.0]
    for path in paths:
        gains.append(gains[-1] + path_value(tuple(path), ranks))
    costs = stored_chain_costs(target, len(paths) + 1) or quick_chain_costs(target.engine, len(paths) + 1)
    size = best_size(gains, costs)
    return paths[: max(1, size)]


def build(target, options: dict) -> MedusaDecoder:
    known = {"drafter", "tree_size", "choices", "acceptance", "posterior_threshold", "posterior_alpha"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise BenchError(f"unknown medusa option '{unknown[0]}' (known: {', '.join(sorted(known))})")
    acceptance = str(options.get("acceptance", "exact"))
    if acceptance not in ACCEPTANCE:
        raise BenchError(f"medusa acceptance '{acceptance}' unknown (choose from {', '.join(ACCEPTANCE)})")
    threshold = _float_option(options, "posterior_threshold", 0.09)
    alpha = _float_option(options, "posterior_alpha", 0.3)
    folder = find_drafter(target.name, METHOD, options.get("drafter"))
    heads, accuracy, stored_tree, info = load_drafter(target, folder)
    choices = options.get("choices")
    if isinstance(choices, str):
        try:
            choices = json.loads(choices)
        except json.JSONDecodeError:
            raise BenchError(f"medusa choices must be JSON, got {choices!r}") from None
    if choices is not None:
        paths, source = choices, "choices option"
    elif str(options.get("tree_size", "auto")) == "auto" and accuracy:
        paths = device_sized_tree(target, accuracy)
        source = f"sized for this device: {len(paths)} nodes"
    elif stored_tree is not None and str(options.get("tree_size", "manifest")) in ("manifest", "auto"):
        paths, source = stored_tree, "manifest"
    else:
        size = _int_option(options, "tree_size", 63)
        paths = build_tree(accuracy or prior_accuracy(heads.num_heads), size)
        source = "measured accuracies" if accuracy else "prior accuracies"
    tree = Tree.from_paths(paths, heads.num_heads)
    if not tree.paths:
        raise BenchError("medusa tree is empty")
    engine = target.engine
    heads = heads.to(device=engine.device, dtype=engine.dtype).eval()
    if heads.own_lm_heads is not None:
        heads.own_lm_heads = [w.to(device=engine.device, dtype=engine.dtype) for w in heads.own_lm_heads]
    for p in heads.parameters():
        p.requires_grad_(False)
    drafter = MedusaDrafter(heads, engine.lm_head, engine.num_layers, tree, acceptance, threshold, alpha)
    info = dict(info, tree_size=len(tree.paths), tree_depth=tree.depth, tree_source=source, acceptance=acceptance)
    if accuracy:
        info["expected_accepted"] = round(expected_accepted(list(tree.paths), accuracy), 3)
    return MedusaDecoder(target, drafter, info)


# -------------------------------------------------------------------- training
@dataclass
class MedusaTraining:
    """`bench train --method medusa --option key=value` (beside --max-steps, --batch-size = windows
    per step, --lr, --warmup-steps, --seed, --data-limit = training conversations)."""

    num_heads: int = 5
    num_layers: int = 1
    window: int = 128  # consecutive positions per window; a step has batch_size windows
    labels: str = "soft"  # soft: the target's distribution (self-distillation); data: the data token
    head_decay: float = 0.8  # head i's loss weight is head_decay**i
    heldout: float = 0.05  # last fraction of conversations, for the measured accuracies
    eval_positions: int = 4096  # held-out positions measured at each export
    tree_size: int = 63
    feature_tokens: int | None = None  # feature cache size (default: FeatureData's, shared with others)
    self_distill: bool = False  # features of target-generated replies (a separate cache)


def _training_options(options: dict) -> MedusaTraining:
    known = {f.name for f in fields(MedusaTraining)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise BenchError(f"unknown medusa training option '{unknown[0]}' (known: {', '.join(sorted(known))})")
    try:
        opts = MedusaTraining(**options)
        for name in ("num_heads", "num_layers", "window", "eval_positions", "tree_size"):
            setattr(opts, name, int(getattr(opts, name)))
        opts.head_decay, opts.heldout = float(opts.head_decay), float(opts.heldout)
        opts.feature_tokens = None if opts.feature_tokens is None else int(opts.feature_tokens)
    except (TypeError, ValueError) as exc:
        raise BenchError(f"bad medusa training option: {exc}") from None
    if min(opts.num_heads, opts.num_layers, opts.window, opts.eval_positions, opts.tree_size) < 1:
        raise BenchError("medusa num_heads, num_layers, window, eval_positions and tree_size must be >= 1")
    if opts.labels not in ("soft", "data"):
        raise BenchError(f"medusa labels '{opts.labels}' unknown (soft | data)")
    if not 0.0 < opts.heldout < 1.0:
        raise BenchError(f"medusa heldout must be in (0, 1), got {opts.heldout}")
    return opts


class Features:
    """The feature cache as training/held-out sets of (anchor, head) pairs.

    A pair (t, i) is valid when position t+1+i, whose target logits give head i's label
    (the token t+2+i), lies in t's conversation and is an assistant-reply prediction."""

    def __init__(self, data: dict[str, Tensor], tap: int, heldout: float, data_limit: int | None) -> None:
        self.hidden = data[f"h{tap}"]
        self.tokens = data["tokens"]
        self.loss_mask = data["loss_mask"]
        offsets = data["offsets"]
        sequences = len(offsets) - 1
        held = max(1, round(sequences * heldout))
        if sequences - held < 1:
            raise BenchError(f"feature cache has {sequences} conversation(s): too few to hold some out")
        lengths = offsets[1:] - offsets[:-1]
        self.end = torch.repeat_interleave(offsets[1:], lengths)  # per position: its conversation's end
        train_end = int(offsets[min(sequences - held, data_limit or sequences)])
        self.split = int(offsets[sequences - held])
        self.train_anchors = self.anchors(0, train_end)
        self.held_anchors = self.anchors(self.split, len(self.tokens))
        if not len(self.train_anchors) or not len(self.held_anchors):
            raise BenchError("feature cache has no reply tokens in its training or held-out conversations")

    def anchors(self, start: int, stop: int) -> Tensor:
        """Positions whose head 0 has a valid label."""
        t = torch.arange(start, stop - 1)
        return t[(t + 1 < self.end[t]) & self.loss_mask[t + 1]]

    def pairs(self, t: Tensor, head: int) -> Tensor:
        """Mask over anchors t: is (t, head) a valid pair?"""
        label = t + 1 + head
        inside = label < self.end[t]
        return inside & self.loss_mask[label.clamp(max=len(self.tokens) - 1)]


CHUNK = 128  # lm_head rows per block: 128 x 49152 fp32 = 25 MB, reused by malloc instead of page-faulted


class _GivenGradient(torch.autograd.Function):
    """Per-pair losses whose gradient wrt the head states x was computed with them:
    d loss_m / d x_m = grad[m] (each loss depends on its own row only)."""

    @staticmethod
    def forward(ctx, x: Tensor, losses: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return losses.clone()

    @staticmethod
    def backward(ctx, upstream: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * upstream[:, None], None, None


def cross_entropy_block(z: Tensor, p: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Cross-entropy of logits z [m, V] against distributions p [m, V] (tokens None) or
    against tokens [m]; returns (loss [m], soft CE vs p [m]) and overwrites z with
    d loss / d z. Without storing [m, V] activations for autograd: the heads' logits are
    the whole cost of training, and three extra copies of them triple the time."""
    z.sub_(z.max(-1, keepdim=True).values)
    dot = torch.einsum("mv,mv->m", p, z)
    picked = None if tokens is None else z.gather(1, tokens[:, None]).squeeze(1)
    z.exp_()
    total = z.sum(-1, keepdim=True)
    log_total = total.log().squeeze(1)
    z.div_(total)  # softmax
    soft = log_total - dot
    if tokens is None:
        z.sub_(p)
        return soft, soft
    z.scatter_add_(1, tokens[:, None], -torch.ones_like(z[:, :1]))
    return log_total - picked, soft


class MedusaObjective:
    """Weighted per-head cross-entropy against the target's label distribution (or token)."""

    def __init__(self, heads: MedusaHeads, lm_head: Tensor, features: Features, opts: MedusaTraining,
                 device: torch.device) -> None:
        self.heads, self.features, self.opts, self.device = heads, features, opts, device
        self.lm_head = lm_head.detach().to(device=device, dtype=torch.float32)
        self._eval: tuple[Tensor, list[Tensor], list[Tensor]] | None = None

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.heads.named_parameters())

    def _pairs(self, windows: list[tuple[int, int]]) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
        """Feature rows of the windows (anchors plus label rows), and per head the valid
        pairs as (anchor row, label row) in that row list plus the data token."""
        f, k = self.features, self.heads.num_heads
        rows, anchors, labels, tokens = [], [[] for _ in range(k)], [[] for _ in range(k)], [[] for _ in range(k)]
        base = 0
        for start, stop in windows:
            span = torch.arange(start, min(stop + k, int(f.end[start])))
            rows.append(span)
            t = torch.arange(start, stop)
            for i in range(k):
                t_i = t[f.pairs(t, i)]
                anchors[i].append(base + t_i - start)
                labels[i].append(base + t_i + 1 + i - start)
                tokens[i].append(f.tokens[t_i + 2 + i])
            base += len(span)
        return torch.cat(rows), *([torch.cat(x) for x in lists] for lists in (anchors, labels, tokens))

    def loss(self, windows: list[tuple[int, int]]) -> tuple[Tensor, dict[str, float]]:
        """windows: (first anchor, end of anchors) in the feature index."""
        rows, anchors, labels, tokens = self._pairs(windows)
        k, w = self.heads.num_heads, self.lm_head
        hidden = self.features.hidden[rows].to(self.device, torch.float32)
        states = [self.heads.blocks[i](hidden[anchors[i].to(self.device)]) for i in range(k)]
        losses = [torch.zeros(len(a), device=self.device) for a in anchors]
        grads = [torch.zeros_like(s) for s in states]
        kl_sum, agree = torch.zeros(k), torch.zeros(k)
        with torch.no_grad():
            for a in range(0, len(rows), CHUNK):  # label rows a..b: the target's distribution once
                b = min(a + CHUNK, len(rows))
                teacher = F.linear(hidden[a:b], w)
                top = teacher.argmax(-1)
                teacher.sub_(teacher.max(-1, keepdim=True).values)
                p = teacher.exp()
                total = p.sum(-1, keepdim=True)
                p.div_(total)
                entropy = total.log().squeeze(1) - torch.einsum("rv,rv->r", p, teacher)
                for i in range(k):
                    lo, hi = torch.searchsorted(labels[i], torch.tensor([a, b])).tolist()
                    if lo == hi:
                        continue
                    local = (labels[i][lo:hi] - a).to(self.device)
                    z = F.linear(states[i][lo:hi], w)
                    agree[i] += float((z.argmax(-1) == top[local]).sum())
                    hard = tokens[i][lo:hi].to(self.device) if self.opts.labels == "data" else None
                    losses[i][lo:hi], soft = cross_entropy_block(z, p[local], hard)
                    kl_sum[i] += float((soft - entropy[local]).sum())
                    grads[i][lo:hi] = z @ w
        total = torch.zeros((), device=self.device)
        metrics: dict[str, float] = {}
        used = [i for i in range(k) if len(anchors[i])]
        for i in used:
            total = total + self.opts.head_decay ** i * _GivenGradient.apply(states[i], losses[i], grads[i]).mean()
            metrics[f"acc_h{i}"] = float(agree[i]) / len(anchors[i])
        metrics["kl"] = sum(float(kl_sum[i]) / len(anchors[i]) for i in used) / max(1, len(used))  # mean of heads
        metrics["acc"] = metrics.get("acc_h0", 0.0)
        metrics["tokens"] = float(len(anchors[0]))  # head-0 pairs (anchors) this step
        return total, metrics

    @torch.no_grad()
    def measure(self, chunk: int = CHUNK) -> tuple[list[list[float]], list[int]]:
        """Per head, the fraction of held-out pairs whose target greedy token is in the
        head's top-1..TOPK (cumulative), and the number of pairs."""
        f, k = self.features, self.heads.num_heads
        if self._eval is None:  # fixed evenly spaced anchors; the targets' argmax labels once
            anchors = f.held_anchors
            if len(anchors) > self.opts.eval_positions:
                anchors = anchors[torch.linspace(0, len(anchors) - 1, self.opts.eval_positions).long()]
            valid = [f.pairs(anchors, i) for i in range(k)]
            labels = []
            for i in range(k):
                rows = (anchors + 1 + i).clamp(max=len(f.tokens) - 1)
                labels.append(torch.cat([F.linear(f.hidden[rows[a:a + chunk]].to(self.device, torch.float32),
                                                  self.lm_head).argmax(-1).cpu()
                                         for a in range(0, len(rows), chunk)]))
            self._eval = (anchors, valid, labels)
        anchors, valid, labels = self._eval
        hits = torch.zeros(k, TOPK)
        for a in range(0, len(anchors), chunk):
            hidden = f.hidden[anchors[a:a + chunk]].to(self.device, torch.float32)
            for i in range(k):
                top = F.linear(self.heads.blocks[i](hidden), self.lm_head).topk(TOPK, dim=-1).indices.cpu()
                ok = valid[i][a:a + chunk]
                found = (top[ok] == labels[i][a:a + chunk][ok, None]).float()
                hits[i] += found.cumsum(-1).sum(0)
        counts = [int(v.sum()) for v in valid]
        accuracy = [[round(float(hits[i, j]) / max(1, counts[i]), 5) for j in range(TOPK)] for i in range(k)]
        return accuracy, counts


def train(target, settings) -> dict:
    """`bench train --method medusa`: Medusa-1 heads on cached target features."""
    from bench.core.provenance import git_sha, timestamp
    from bench.core.training import loop
    from bench.core.training.features import FeatureData, ensure_features

    opts = _training_options(dict(settings.options))
    tap = target.engine.num_layers
    data = FeatureData()
    changes = {}
    if opts.feature_tokens is not None:
        changes["max_tokens"] = opts.feature_tokens
    if opts.self_distill:
        changes["self_distill"] = True
    if settings.data_path:
        changes["data_path"] = str(settings.data_path)
    data = FeatureData(**(asdict(data) | changes))
    store = ensure_features(target, (tap,), data, progress=settings.progress)
    features = Features(store.load((tap,)), tap, opts.heldout, settings.data_limit)
    torch.manual_seed(settings.seed)  # the heads' bias init
    heads = MedusaHeads(target.config.hidden_size, opts.num_heads, opts.num_layers)
    device = torch.device(settings.device)
    heads.to(device)
    objective = MedusaObjective(heads, target.engine.lm_head, features, opts, device)

    def next_batch(cursor: int) -> tuple[list[tuple[int, int]], int]:
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + cursor)  # exact resume
        picks = torch.randint(len(features.train_anchors), (settings.batch_size,), generator=generator)
        starts = features.train_anchors[picks].tolist()
        return [(s, min(s + opts.window, int(features.end[s]) - 1)) for s in starts], cursor + 1

    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}
    identity = {"method": METHOD, "target": target_info, "batch_size": settings.batch_size,
                "data_limit": settings.data_limit, "features": data.key(),
                "medusa": {k: v for k, v in asdict(opts).items() if k not in ("eval_positions", "tree_size")}}
    cfg = loop.LoopConfig(max_steps=settings.max_steps, lr=settings.lr, warmup_steps=settings.warmup_steps,
                          checkpoint_every_s=settings.checkpoint_every_s, seed=settings.seed)
    out_dir = Path(settings.out_dir)

    def export(step: int) -> None:
        accuracy, counts = objective.measure()
        paths = build_tree(accuracy, opts.tree_size)
        rows = loop.read_log(out_dir)
        last = rows[-20:]
        manifest = {
            "method": METHOD, "format": FORMAT, "target": target_info, "weights": WEIGHTS,
            "architecture": {"num_heads": opts.num_heads, "num_layers": opts.num_layers,
                             "hidden": heads.hidden, "tap": tap, "lm_head": "target (shared, not stored)",
                             "head_offset": "head i predicts the token at t+2+i"},
            "accuracy": {"topk": accuracy, "pairs": counts, "label": "target greedy token",
                         "held_out": f"last {opts.heldout:.0%} of conversations",
                         "held_out_positions": int(len(features.held_anchors))},
            "tree": {"paths": [list(p) for p in paths], "size": len(paths),
                     "expected_accepted": round(expected_accepted(paths, accuracy), 4)},
            "training": {
                "steps": step, "max_steps": settings.max_steps, "batch_size": settings.batch_size,
                "window": opts.window, "lr": settings.lr, "warmup_steps": settings.warmup_steps,
                "seed": settings.seed, "device": settings.device, "labels": opts.labels,
                "head_decay": opts.head_decay, "features": str(store.folder), "feature_data": asdict(data),
                "train_positions": int(len(features.train_anchors)),
                "positions_seen": int(sum(r.get("tokens", 0) for r in rows)),
                "last_20_steps": {key: round(sum(r.get(key, 0) for r in last) / max(1, len(last)), 4)
                                  for key in ["loss", "kl"] + [f"acc_h{i}" for i in range(opts.num_heads)]},
                "elapsed_s": rows[-1]["elapsed_s"] if rows else None,
                "git_sha": git_sha(), "exported_at": timestamp(),
            },
        }
        export_heads(heads, out_dir, manifest)

    summary = loop.train(objective, next_batch, cfg, out_dir, identity, settings.progress, on_checkpoint=export)
    summary["drafter"] = str(out_dir)
    return summary


def export_heads(heads: MedusaHeads, folder: Path, manifest: dict) -> None:
    """Our drafter folder: the heads' weights in bf16 and the manifest."""
    write_drafter(folder, {k: v.to(torch.bfloat16) for k, v in heads.export_state().items()}, manifest)
