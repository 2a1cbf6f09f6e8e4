"""`bench train --method medusa`: Medusa-1 heads on cached target features (see the
package docstring for the loss, the step and the costs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.core.drafters import WEIGHTS
from bench.core.errors import BenchError
from bench.training.vocab_rows import agrees, rowdot, softmax_lse
from methods.medusa.model import FORMAT, METHOD, MedusaHeads, export_heads
from methods.medusa.tree import TOPK, build_tree, expected_accepted


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
        bounds = offsets[sequences - held:].tolist()
        self.heldout_spans = list(zip(bounds[:-1], bounds[1:]))  # the held-out conversations, in order
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


def cross_entropy_block(z: Tensor, p: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Cross-entropy of fp32 logits z [m, V] against distributions p [m, V] (tokens None) or
    against tokens [m]; returns (loss [m], soft CE vs p [m], d loss / d z [m, V]). Without
    storing [m, V] activations for autograd: the heads' logits are the whole cost of
    training, and three extra copies of them triple the time."""
    q, lse = softmax_lse(z)
    soft = lse - rowdot(p, z)
    if tokens is None:
        return soft, soft, q.sub_(p)
    picked = z.gather(1, tokens[:, None]).squeeze(1)
    return lse - picked, soft, q.scatter_add_(1, tokens[:, None], -torch.ones_like(q[:, :1]))


class MedusaObjective:
    """Weighted per-head cross-entropy against the target's label distribution (or token)."""

    def __init__(self, heads: MedusaHeads, lm_head: Tensor, features: Features, opts: MedusaTraining,
                 device: torch.device, autocast: bool = False) -> None:
        self.heads, self.features, self.opts, self.device = heads, features, opts, device
        self.autocast = autocast  # bf16 matmuls; fp32 master weights and softmaxes
        self.lm_head = lm_head.detach().to(device=device, dtype=torch.float32)
        # the loss's lm_head products in bf16 under autocast, from one copy: autocast would cast the
        # frozen (non-leaf) fp32 head again on every call, 11 times per chunk
        self.head = self.lm_head.to(torch.bfloat16) if autocast else self.lm_head
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
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self._loss(windows)

    def _loss(self, windows: list[tuple[int, int]]) -> tuple[Tensor, dict[str, float]]:
        rows, anchors, labels, tokens = self._pairs(windows)
        k, w = self.heads.num_heads, self.head
        hidden = self.features.hidden[rows].to(self.device, torch.float32)
        states = [self.heads.blocks[i](hidden[anchors[i].to(self.device)]) for i in range(k)]
        losses = [torch.zeros(len(a), device=self.device) for a in anchors]
        grads = [torch.zeros_like(s) for s in states]
        kl_sum, agree = torch.zeros(k), torch.zeros(k)
        with torch.no_grad():
            for a in range(0, len(rows), CHUNK):  # label rows a..b: the target's distribution once
                b = min(a + CHUNK, len(rows))
                teacher = F.linear(hidden[a:b].to(w.dtype), w).float()  # softmaxes in fp32
                top = teacher.argmax(-1)
                p, lse = softmax_lse(teacher)
                entropy = lse - rowdot(p, teacher)
                for i in range(k):
                    lo, hi = torch.searchsorted(labels[i], torch.tensor([a, b])).tolist()
                    if lo == hi:
                        continue
                    local = (labels[i][lo:hi] - a).to(self.device)
                    z = F.linear(states[i][lo:hi].to(w.dtype), w).float()
                    agree[i] += float(agrees(z, top[local]).sum())
                    hard = tokens[i][lo:hi].to(self.device) if self.opts.labels == "data" else None
                    losses[i][lo:hi], soft, dz = cross_entropy_block(z, p[local], hard)
                    kl_sum[i] += float((soft - entropy[local]).sum())
                    grads[i][lo:hi] = (dz.to(w.dtype) @ w).float()
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


def train_medusa(target, settings) -> dict:
    """`bench train --method medusa`: Medusa-1 heads on cached target features."""
    from bench.core.provenance import git_sha, timestamp
    from bench.training import GRID_REPLY_TOKENS, HELDOUT_ROUNDS_CONVERSATIONS, heldout_prediction, loop
    from bench.training.features import FeatureData, data_facts, ensure_features
    from methods.medusa.rounds import heldout_rounds

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
    store = ensure_features(target, (tap,), data, progress=settings.progress, run_dir=Path(settings.out_dir))
    features = Features(store.load((tap,)), tap, opts.heldout, settings.data_limit)
    torch.manual_seed(settings.seed)  # the heads' bias init
    heads = MedusaHeads(target.config.hidden_size, opts.num_heads, opts.num_layers)
    device = torch.device(settings.device)
    heads.to(device)
    objective = MedusaObjective(heads, target.engine.lm_head, features, opts, device, settings.bf16_autocast())
    held_features = {"tokens": features.tokens, "loss_mask": features.loss_mask, "h": features.hidden}

    def next_batch(cursor: int) -> tuple[list[tuple[int, int]], int]:
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + cursor)  # exact resume
        picks = torch.randint(len(features.train_anchors), (settings.batch_size,), generator=generator)
        starts = features.train_anchors[picks].tolist()
        return [(s, min(s + opts.window, int(features.end[s]) - 1)) for s in starts], cursor + 1

    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}
    identity = {"method": METHOD, "target": target_info, "batch_size": settings.batch_size,
                "data_limit": settings.data_limit, "features": data.key(),
                "medusa": {k: v for k, v in asdict(opts).items() if k not in ("eval_positions", "tree_size")},
                "bf16_autocast": settings.bf16_autocast()}
    # An epoch: every training reply position once, in windows of opts.window.
    cfg = settings.loop_config(max(1, len(features.train_anchors) // opts.window))
    out_dir = Path(settings.out_dir)

    def export(step: int) -> None:
        accuracy, counts = objective.measure()
        paths = build_tree(accuracy, opts.tree_size)
        heads.eval()
        spans = features.heldout_spans[-HELDOUT_ROUNDS_CONVERSATIONS:]
        rounds = heldout_rounds(heads, objective.lm_head, held_features, spans, paths, keep=GRID_REPLY_TOKENS)
        heads.train()
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
            "heldout": dict(heldout_prediction([head[0] for head in accuracy]), **rounds),
            "tree": {"paths": [list(p) for p in paths], "size": len(paths),
                     "expected_accepted": round(expected_accepted(paths, accuracy), 4)},
            "training": {
                "steps": step, "max_steps": cfg.max_steps, "batch_size": settings.batch_size,
                "window": opts.window, "lr": settings.lr, "warmup_steps": settings.warmup_steps,
                "seed": settings.seed, "device": settings.device, "labels": opts.labels,
                "head_decay": opts.head_decay, "features": str(store.folder), "feature_data": asdict(data),
                "train_positions": int(len(features.train_anchors)),
                **data_facts(store, opts.self_distill, step * settings.batch_size,
                             max(1, len(features.train_anchors) // opts.window)),
                "positions_seen": int(sum(r.get("tokens", 0) for r in rows)),
                "last_20_steps": {key: round(sum(r.get(key, 0) for r in last) / max(1, len(last)), 4)
                                  for key in ["loss", "kl"] + [f"acc_h{i}" for i in range(opts.num_heads)]},
                "tokens_seen": rows[-1].get("tokens_seen", 0) if rows else 0,
                "elapsed_s": rows[-1]["elapsed_s"] if rows else None,
                "git_sha": git_sha(), "exported_at": timestamp(),
            },
        }
        export_heads(heads, out_dir, manifest)

    return settings.run_loop(objective, next_batch, cfg, identity, export, out_dir)

