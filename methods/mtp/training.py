"""`bench train --method mtp [--option variant=parallel]`: MTP modules distilled from the target.

Soft cross-entropy against the target's own next-token distribution (KL(p || q), the
fused loss of methods/mtp/loss.py), only where the predicted token is an assistant-reply
token and inside one conversation; steps / heads weighted step_decay^(k-1) (EAGLE-3's
0.8), each averaged over its valid rows. Inputs are the cached target features
(bench.training.features); the sequential module unrolls its chain `ttt_steps` times
(methods/mtp/model.chained_outputs). The drafter folder holds the trainable weights
(bf16) and drafter.json; the parallel variant is trained into
`.../drafters/<target>/mtp-parallel` (the manifest says method "mtp", variant "parallel"),
so `bench run --method mtp --option variant=parallel` finds it. Options: see MtpSettings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.drafters import WEIGHTS, read_manifest, user_dir, write_drafter
from bench.core.errors import BenchError
from methods.mtp.loss import distill_loss
from methods.mtp.model import FUSE_ORDERS, VARIANTS, LayerShape, Rope, chained_outputs, new_model
from methods.mtp.store import FORMAT, METHOD, drafter_key

if TYPE_CHECKING:
    from bench.core.target import Target
    from bench.training import TrainSettings
    from bench.training.features import FeatureData


@dataclass
class MtpSettings:
    """`bench train --method mtp --option k=v` options."""

    variant: str = "sequential"
    # sequential: halves of the fused input, "embedding_first" (DeepSeek-V3) or "hidden_first"
    # (MiMo; our drafters trained before the default changed); methods/mtp/model.FUSE_ORDERS
    fuse_order: str = "embedding_first"
    ttt_steps: int = 2  # sequential: recursion depth trained (EAGLE-3 TTT); 1 = plain MTP-1
    heads: int = 3  # parallel: heads (x_{t+2}..x_{t+1+heads})
    tap: int | None = None  # parallel trunk tap (default L-2: in the shared feature cache)
    init: str = "target"  # "target": decoder layers copied from the target (init_layer); "random"
    init_layer: int | None = None  # default: last layer (sequential), the trunk tap's layer (parallel)
    step_decay: float = 0.8  # loss weight of step/head k: step_decay^(k-1)
    head_dtype: str = "bfloat16"  # lm_head matmuls in the loss (teacher and student)
    loss_chunk: int = 128  # rows per lm_head chunk in the fused loss (128 measured fastest)
    holdout: int = 16  # last N conversations of the feature cache: held out for evaluation
    eval_rows: int = 2000  # held-out reply positions evaluated at each export
    eval_steps: int = 4  # sequential: chain steps evaluated (parallel: every head)
    feature_tokens: int | None = None  # FeatureData.max_tokens (default: the shared cache's)
    feature_len: int | None = None  # FeatureData.max_len
    self_distill: bool = False  # FeatureData.self_distill

    @classmethod
    def parse(cls, options: dict) -> MtpSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise BenchError(f"unknown mtp training option '{unknown[0]}' (known: {', '.join(sorted(known))})")
        settings = cls(**options)
        if settings.variant not in VARIANTS:
            raise BenchError(f"mtp variant '{settings.variant}' unknown (choose from {', '.join(VARIANTS)})")
        if settings.fuse_order not in FUSE_ORDERS:
            raise BenchError(f"mtp fuse_order '{settings.fuse_order}' unknown (choose from {', '.join(FUSE_ORDERS)})")
        if settings.init not in ("target", "random"):
            raise BenchError(f"mtp init '{settings.init}' unknown (target | random)")
        if settings.ttt_steps < 1 or settings.heads < 1 or settings.eval_steps < 1:
            raise BenchError("mtp ttt_steps, heads and eval_steps must be >= 1")
        return settings

    def trunk_tap(self, num_layers: int) -> int:
        tap = num_layers - 2 if self.tap is None else int(self.tap)
        if not 0 <= tap < num_layers:
            raise BenchError(f"mtp parallel tap must be in 0..{num_layers - 1} (a layer input), got {tap}")
        return tap

    def feature_data(self, data_path: Path | None) -> FeatureData:
        from bench.training.features import FeatureData

        values = {"self_distill": self.self_distill}
        if self.feature_tokens is not None:
            values["max_tokens"] = int(self.feature_tokens)
        if self.feature_len is not None:
            values["max_len"] = int(self.feature_len)
        if data_path is not None:
            values["data_path"] = str(data_path)
        return FeatureData(**values)


def init_model(target: Target, settings: MtpSettings) -> nn.Module:
    """A fresh module; decoder layers copied from a target layer for init=target.

    Why the last layer for the sequential module: its output is read by the final norm and
    lm_head, so the copied layer already writes a "next token" readout; earlier layers
    expect a mid-network residual stream (for the SpS draft, a copied late layer fed
    embeddings started far from the target, see bench/training/draft_lm.init_layers)."""
    engine = target.engine
    shape = LayerShape.of(engine)
    model = new_model(settings.variant, shape, settings.heads, settings.fuse_order)
    if settings.init == "random":
        return model
    if settings.variant == "sequential":
        index = engine.num_layers - 1 if settings.init_layer is None else int(settings.init_layer)
        layers = [model.layer]
        norms = [model.final_norm]
    else:
        tap = settings.trunk_tap(engine.num_layers)
        index = tap if settings.init_layer is None else int(settings.init_layer)
        layers = [head.layer for head in model.heads]
        norms = [head.final_norm for head in model.heads]
    if not 0 <= index < engine.num_layers:
        raise BenchError(f"mtp init_layer must be in 0..{engine.num_layers - 1}, got {index}")
    settings.init_layer = index
    for layer in layers:
        layer.copy_from({k: v.float().cpu() for k, v in engine.layers[index].items() if v is not None})
    with torch.no_grad():
        for norm in norms:
            norm.copy_(engine.final_norm.float())
    return model


def windows_of(offsets: list[int], max_len: int) -> list[tuple[int, int, int]]:
    """(sequence start, a, b): each conversation cut into windows of <= max_len tokens that
    overlap by one token, so every row (predicted position) is in exactly one window."""
    out = []
    for start, end in zip(offsets[:-1], offsets[1:]):
        a = start
        while end - a >= 2:
            b = min(end, a + max_len)
            out.append((start, a, b))
            if b == end:
                break
            a = b - 1
    return out


class MtpObjective:
    """bench.training.loop Objective over the cached features; batches are window lists."""

    def __init__(self, target: Target, model: nn.Module, settings: MtpSettings, features: dict[str, Tensor],
                 device: str | torch.device = "cpu") -> None:
        engine = target.engine
        self.settings = settings
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.variant = settings.variant
        self.last = engine.num_layers
        self.trunk = settings.trunk_tap(self.last) if self.variant == "parallel" else self.last
        self.features = features
        self.embed = engine.embed.detach().to(self.device, torch.float32)
        self.lm_head = engine.lm_head.detach().to(self.device, torch.float32)
        self.rope = Rope(engine, torch.float32, self.device)
        from bench.core.target import parse_dtype

        self.head_dtype = parse_dtype(settings.head_dtype)
        self.train_steps = settings.ttt_steps if self.variant == "sequential" else settings.heads
        weights = torch.tensor([settings.step_decay ** k for k in range(max(self.train_steps, settings.eval_steps,
                                                                            settings.heads))])
        self.step_weights = weights.to(self.device)

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def _window(self, window: tuple[int, int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        start, a, b = window
        f = self.features
        tokens = f["tokens"][a:b].to(self.device)
        mask = f["loss_mask"][a:b].to(self.device)
        final = f[f"h{self.last}"][a:b].to(self.device, torch.float32)
        trunk = final if self.trunk == self.last else f[f"h{self.trunk}"][a:b].to(self.device, torch.float32)
        positions = torch.arange(a - start, b - start, device=self.device)
        return tokens, mask, final, trunk, positions

    def pairs(self, windows: list[tuple[int, int, int]], steps: int) -> tuple[Tensor, Tensor, Tensor]:
        """Student outputs [steps, R, d], teacher features [R, d] and validity [steps, R]
        over every row of the windows (see methods/mtp/__init__.py for the offsets)."""
        students, teachers, valids = [], [], []
        for window in windows:
            tokens, mask, final, trunk, positions = self._window(window)
            n = tokens.shape[0]
            if self.variant == "sequential":
                # rows r = 0..n-2 are rows j = r+1: input (h_{j-1}, x_j), teacher h_j; RoPE at
                # j-1, the position of the feature (DeepSeek-V3 / vLLM / speculators)
                cos, sin = self.rope(positions[:-1])
                outs = chained_outputs(self.model, final[:-1], self.embed[tokens[1:]], cos, sin, steps)
                rows = torch.arange(n - 1, device=self.device)
                students.append(outs)
                teachers.append(final[1:])
                valids.append(mask[1:][None] & (rows[None] >= torch.arange(steps, device=self.device)[:, None]))
            else:
                # teacher row j (position j); head k's row j-k predicts the token after j
                cos, sin = self.rope(positions)
                rows = torch.arange(n, device=self.device)
                outs, valid = [], []
                for k, head in enumerate(self.model.heads[:steps], start=1):
                    out = head.out(head.layer.causal(trunk[None], cos, sin)[0])
                    outs.append(torch.cat([out[:1].expand(min(k, n), -1), out[: max(0, n - k)]]))
                    valid.append(mask & (rows >= k))
                students.append(torch.stack(outs))
                teachers.append(final)
                valids.append(torch.stack(valid))
        return torch.cat(students, dim=1), torch.cat(teachers), torch.cat(valids, dim=1)

    def _loss(self, windows: list[tuple[int, int, int]], steps: int) -> tuple[Tensor, Tensor]:
        student, teacher, valid = self.pairs(windows, steps)
        keep = valid.any(0)
        student, teacher, valid = student[:, keep], teacher[keep], valid[:, keep]
        # step k weighs step_decay^(k-1), averaged over its valid rows; weights sum to 1
        lam = self.step_weights[:steps]
        weight = valid.float() * (lam / valid.sum(1).clamp(min=1) / lam.sum())[:, None]
        return distill_loss(student, teacher, weight, self.lm_head, self.settings.loss_chunk, self.head_dtype)

    def loss(self, batch: list[tuple[int, int, int]]) -> tuple[Tensor, dict[str, float]]:
        loss, stats = self._loss(batch, self.train_steps)
        rows = stats[:, 3].clamp(min=1)
        metrics = {"tokens": float(stats[0, 3])}
        for k in range(stats.shape[0]):
            metrics[f"kl{k + 1}"] = float(stats[k, 0] / rows[k])
            metrics[f"acc{k + 1}"] = float(stats[k, 1] / rows[k])
        metrics["acc"] = metrics["acc1"]
        metrics["kl"] = metrics["kl1"]
        return loss, metrics

    @torch.no_grad()
    def evaluate(self, windows: list[tuple[int, int, int]]) -> dict:
        """Teacher-forced top-1 agreement with the target per chain step / head on held-out
        windows: step k drafts from the target feature k-1 positions back, fed the data's
        tokens (a proxy of greedy acceptance at depth k given the earlier drafts were right)."""
        steps = self.settings.eval_steps if self.variant == "sequential" else len(self.model.heads)
        total = torch.zeros(steps, 4)
        for i in range(0, len(windows), 4):
            _, stats = self._loss(windows[i: i + 4], steps)
            total += stats.cpu()
            if total[0, 3] >= self.settings.eval_rows:
                break
        rows = total[:, 3].clamp(min=1)
        found = {"acc": [round(float(v), 4) for v in total[:, 1] / rows],
                 "accept": [round(float(v), 4) for v in total[:, 2] / rows],
                 "kl": [round(float(v), 4) for v in total[:, 0] / rows], "rows": int(total[0, 3])}
        if self.variant != "sequential":
            return found
        from bench.training import GRID_REPLY_TOKENS, rounds_prediction

        replayed = self.rounds_windows(windows)
        return dict(found, **rounds_prediction(*self.round_counts(replayed, steps)),
                    **{f"first_{GRID_REPLY_TOKENS}": self.first_reply_rounds(replayed, steps, GRID_REPLY_TOKENS)})

    def rounds_windows(self, windows: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """The held-out windows rounds are replayed on, whole and cut alike: the first ones that
        hold eval_rows reply rows."""
        mask, seen = self.features["loss_mask"], 0
        for i, (_, a, b) in enumerate(windows):
            seen += int(mask[a + 1: b].sum())
            if seen >= self.settings.eval_rows:
                return windows[: i + 1]
        return windows

    def first_reply_rounds(self, windows: list[tuple[int, int, int]], steps: int, keep: int) -> dict:
        """round_counts with each held-out reply cut to its first `keep` tokens (as the grid's turns)."""
        from bench.training import first_reply_tokens, rounds_prediction

        whole = self.features
        self.features = dict(whole, loss_mask=first_reply_tokens(whole["loss_mask"], windows[0][1], keep))
        try:
            kept = [w for w in windows if bool(self.features["loss_mask"][w[1] + 1: w[2]].any())]
            return rounds_prediction(*self.round_counts(kept, steps))
        finally:
            self.features = whole

    @torch.no_grad()
    def round_counts(self, windows: list[tuple[int, int, int]], steps: int) -> tuple[int, int, int]:
        """Greedy decode rounds simulated on the windows (bench.training.simulated_rounds: rounds,
        accepted drafts, rounds whose first draft was accepted); the chain a round starts at row s
        drafts its k-th token at row s+k."""
        from bench.training import simulated_rounds

        head = self.lm_head.to(self.head_dtype)
        total = [0, 0, 0]
        for window in windows:
            student, teacher, valid = self.pairs([window], steps)
            best = F.linear(teacher.to(self.head_dtype), head).argmax(-1)
            ok = torch.stack([F.linear(student[k].to(self.head_dtype), head).argmax(-1) == best
                              for k in range(steps)]) & valid
            n, flags = ok.shape[1], ok.tolist()
            hit = [[k + s < n and flags[k][k + s] for s in range(n)] for k in range(steps)]
            counts = simulated_rounds(hit, valid[0].tolist())
            total = [a + b for a, b in zip(total, counts)]
        return tuple(total)

    def export(self, folder: Path, manifest: dict) -> None:
        write_drafter(folder, {n: p.to(torch.bfloat16) for n, p in self.model.named_parameters()}, manifest)


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else None


def train_mtp(target: Target, settings: TrainSettings) -> dict:
    """`bench train --method mtp`: train the MTP module(s) on cached target features into
    settings.out_dir (resuming from a checkpoint there); exports the drafter at every
    checkpoint with its held-out agreement per step."""
    from bench.core.provenance import git_sha, timestamp
    from bench.training import heldout_prediction, loop
    from bench.training.features import data_facts, ensure_features

    opts = MtpSettings.parse(dict(settings.options))
    num_layers = target.engine.num_layers
    out_dir = Path(settings.out_dir)
    if opts.variant != "sequential" and out_dir == user_dir(target.name, METHOD):
        out_dir = user_dir(target.name, drafter_key(opts.variant))  # where build() looks for it
    trunk = opts.trunk_tap(num_layers) if opts.variant == "parallel" else num_layers
    taps = tuple(sorted({num_layers, trunk}))
    data = opts.feature_data(settings.data_path)
    store = ensure_features(target, taps, data, progress=settings.progress, run_dir=out_dir)
    features = store.load(taps)
    offsets = features["offsets"].tolist()
    held = min(opts.holdout, max(0, len(offsets) - 2))  # keep at least one training conversation
    train_offsets, held_offsets = offsets[: len(offsets) - held], offsets[len(offsets) - held - 1:]
    if settings.data_limit:
        train_offsets = train_offsets[: settings.data_limit + 1]
    mask = features["loss_mask"]

    def useful(windows: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:  # windows with reply rows
        return [w for w in windows if bool(mask[w[1] + 1: w[2]].any())]

    train_windows = useful(windows_of(train_offsets, settings.max_len))
    held_windows = useful(windows_of(held_offsets, settings.max_len)) if held else []
    if not train_windows:
        raise BenchError(f"feature cache {store.folder} has no training conversations")

    torch.manual_seed(settings.seed)  # the module's random parts (proj, init=random)
    model = init_model(target, opts)
    objective = MtpObjective(target, model, opts, features, settings.device)
    epoch_order: dict[int, list[int]] = {}

    def next_batch(cursor: int) -> tuple[list[tuple[int, int, int]], int]:
        batch = []
        for index in range(cursor, cursor + settings.batch_size):
            epoch, i = divmod(index, len(train_windows))
            if epoch not in epoch_order:  # a fresh shuffle per epoch, fixed by the seed
                epoch_order.clear()
                generator = torch.Generator().manual_seed(settings.seed * 100_003 + epoch)
                epoch_order[epoch] = torch.randperm(len(train_windows), generator=generator).tolist()
            batch.append(train_windows[epoch_order[epoch][i]])
        return batch, cursor + settings.batch_size

    target_info = {"name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}
    identity = {"method": METHOD, "target": target_info, "batch_size": settings.batch_size,
                "max_len": settings.max_len, "data_limit": settings.data_limit, "features": data.key(),
                "mtp": asdict(opts)}
    cfg = settings.loop_config(len(train_windows))
    architecture = dict(asdict(LayerShape.of(target.engine)), kind=opts.variant)
    if opts.variant == "parallel":
        architecture["heads"] = opts.heads
    keys = ("kl", "acc") + tuple(f"acc{k + 1}" for k in range(objective.train_steps))

    def export(step: int) -> None:
        rows = loop.read_log(out_dir)
        heldout = objective.evaluate(held_windows) if held_windows else {}
        manifest = {
            "format": FORMAT, "method": METHOD, "variant": opts.variant, "target": target_info, "weights": WEIGHTS,
            "architecture": architecture, "tap": trunk, "teacher_tap": num_layers,
            **({"fuse_order": opts.fuse_order} if opts.variant == "sequential" else {}),
            "shared": ["embedding", "lm_head"], "mtp_settings": asdict(opts),
            "training": {
                "steps": step, "max_steps": cfg.max_steps, "batch_size": settings.batch_size,
                "max_len": settings.max_len, "lr": settings.lr, "warmup_steps": settings.warmup_steps,
                "seed": settings.seed, "device": settings.device, "features": str(store.folder),
                "feature_data": asdict(data), "train_windows": len(train_windows),
                **data_facts(store, opts.self_distill, step * settings.batch_size, len(train_windows)),
                "heldout_conversations": held, "reply_rows_seen": int(sum(r.get("tokens", 0) for r in rows)),
                "first_10_steps": {k: _mean(rows[:10], k) for k in keys},
                "last_10_steps": {k: _mean(rows[-10:], k) for k in keys},
                "heldout": dict(heldout, **heldout_prediction(heldout["acc"])) if heldout else {},
                "tokens_seen": rows[-1].get("tokens_seen", 0) if rows else 0,
                "elapsed_s": rows[-1]["elapsed_s"] if rows else None,
                "git_sha": git_sha(), "exported_at": timestamp(),
            },
        }
        objective.export(out_dir, manifest)

    summary = settings.run_loop(objective, next_batch, cfg, identity, export, out_dir)
    summary["heldout"] = read_manifest(out_dir).get("training", {}).get("heldout")
    return summary
