"""A small, generic training loop for drafters: AdamW, warmup + cosine LR, gradient
clipping, a JSONL log, periodic atomic checkpoints and exact resume.

The loop knows nothing about the model. An Objective supplies the trainable parameters
and the loss of one batch; a `next_batch(cursor)` function supplies the data, where the
cursor (an int saved in the checkpoint) says where the data stream stands. Given the same
seed, a run interrupted and resumed sees the same batches and computes the same losses
as an uninterrupted one.

Checkpoint folder layout (out_dir/checkpoint/, replaced atomically):
  params.safetensors     trainable parameters (fp32, by name)
  optimizer.safetensors  optimizer state tensors, keyed "<param name>.<state key>"
  state.json             step, data cursor, elapsed time, settings, the stretches (which steps
                         ran on which machine and thread count: a run resumes across machines)
  rng.safetensors        torch CPU RNG state (and CUDA's, for a CUDA run)
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from bench.core.errors import BenchError
from bench.core.provenance import training_machine
from bench.training.memory import MemoryCap

CHECKPOINT = "checkpoint"
LOG = "log.jsonl"


@dataclass
class LoopConfig:
    max_steps: int = 200
    lr: float = 5e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    checkpoint_every_s: float = 300.0
    checkpoint_every_steps: int = 0  # 0 = only by time (and at the end)
    # on_checkpoint (the drafter's export, with its held-out evaluation: tens of seconds on a
    # CPU) runs at most this often, and at the end; checkpoints stay as frequent as above.
    # None: six checkpoint intervals (30 minutes at the default 5; every checkpoint at 0).
    export_every_s: float | None = None
    # Wall-clock time (time.time()) at which this invocation stops early (export, checkpoint,
    # return), so a run fits a lent machine's call or a session; the next one resumes. None: never.
    stop_at: float | None = None
    seed: int = 0


class Objective(Protocol):
    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """The trainable parameters, with stable names (checkpoint keys)."""

    def loss(self, batch: Any) -> tuple[Tensor, dict[str, float]]:
        """Scalar loss to minimise for one batch, plus metrics to log (floats)."""


def learning_rate(step: int, cfg: LoopConfig) -> float:
    """Linear warmup, then cosine down to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ------------------------------------------------------------------ checkpoints
def _optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, Tensor], dict]:
    """Split optimizer state into tensors (for safetensors) and JSON-able values."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"{names[index]}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{names[index]}.{key}"] = value
    groups = [{k: v for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"scalars": scalars, "param_groups": groups}


def _load_optimizer(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, Tensor],
                    extra: dict) -> None:
    state: dict[int, dict] = {}
    for index, name in enumerate(names):
        prefix = name + "."
        entry = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        entry.update({k[len(prefix):]: v for k, v in extra["scalars"].items() if k.startswith(prefix)})
        if entry:
            state[index] = entry
    groups = extra["param_groups"]
    for group in groups:
        group["betas"] = tuple(group["betas"]) if "betas" in group else group.get("betas")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(out_dir: Path, objective: Objective, optimizer: torch.optim.Optimizer,
                    step: int, cursor: int, elapsed: float, settings: dict, tokens_seen: int = 0,
                    max_steps: int | None = None, stretches: list[dict] | None = None) -> None:
    """Write out_dir/checkpoint atomically: a temp folder renamed over the old one. max_steps:
    the run's step count as it stands (not part of its identity: `bench train --status` reads it);
    stretches: which steps ran where ({from_step, to_step, machine, elapsed_s}), for the manifest."""
    named = objective.named_parameters()
    names = [n for n, _ in named]
    final = out_dir / CHECKPOINT
    tmp = out_dir / f".{CHECKPOINT}.tmp"
    old = out_dir / f".{CHECKPOINT}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: p.detach().float().cpu().contiguous() for n, p in named}, str(tmp / "params.safetensors"))
    tensors, extra = _optimizer_tensors(optimizer, names)
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a CUDA run draws there too (DFlash's anchors)
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "cursor": cursor, "elapsed_s": elapsed, "tokens_seen": tokens_seen, "max_steps": max_steps,
        "stretches": stretches or [], "optimizer": extra,
        "settings": settings,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
    # Swap in two renames; a crash in between leaves .old, which load_checkpoint falls back to.
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(out_dir: Path) -> Path | None:
    for folder in (out_dir / CHECKPOINT, out_dir / f".{CHECKPOINT}.old"):
        if (folder / "state.json").exists():
            return folder
    return None


def load_checkpoint(folder: Path, objective: Objective, optimizer: torch.optim.Optimizer) -> dict:
    """Restore parameters, optimizer and RNG; returns state.json's content."""
    try:
        state = json.loads((folder / "state.json").read_text())
        params = load_file(str(folder / "params.safetensors"))
        optim = load_file(str(folder / "optimizer.safetensors"))
        rng = load_file(str(folder / "rng.safetensors"))
    except Exception as exc:
        raise BenchError(f"cannot resume from {folder}: {exc}") from None
    named = objective.named_parameters()
    missing = [n for n, _ in named if n not in params]
    if missing:
        raise BenchError(f"checkpoint {folder} does not match the model (missing {missing[0]})")
    with torch.no_grad():
        for name, p in named:
            p.copy_(params[name])
    _load_optimizer(optimizer, [n for n, _ in named], optim, state["optimizer"])
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return state


# ------------------------------------------------------------------------ loop
class _NamedParams:
    def __init__(self, named: list[tuple[str, Tensor]]) -> None:
        self.named = named

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        return self.named


def _trim_log(path: Path, last_step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be redone)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError):
            pass  # a line cut short by the interruption
    path.write_text("".join(line + "\n" for line in kept))


# Loop settings that may change between an interrupted run and its resumption.
RESUMABLE_CHANGES = ("max_steps", "checkpoint_every_s", "checkpoint_every_steps", "export_every_s", "stop_at")


LOCK = ".train.lock"


@contextmanager
def exclusive_folder(out_dir: Path) -> Iterator[None]:
    """Hold out_dir for one training run: a second run into the same folder (which would
    interleave checkpoints and log lines with the first) stops with a one-line error instead.
    An advisory lock the kernel drops when the process dies, so a killed run never leaves it held."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise BenchError(f"another training run (pid {holder}) is writing to {out_dir}: "
                             "wait for it, stop it, or use another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield  # closing the file releases the lock


def _identity(identity: dict | None, cfg: LoopConfig) -> dict:
    loop = {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_CHANGES}
    return json.loads(json.dumps(dict(identity or {}, loop=loop), default=str))


def train(objective: Objective, next_batch: Callable[[int], tuple[Any, int]], cfg: LoopConfig,
          out_dir: Path, identity: dict | None = None, progress: bool = True,
          on_checkpoint: Callable[[int], None] | None = None,
          milestones: tuple[int, ...] = (), on_milestone: Callable[[int, int], None] | None = None) -> dict:
    """Train until cfg.max_steps, resuming from out_dir/checkpoint when present.

    next_batch(cursor) -> (batch, next cursor). `identity`: what must be equal to resume
    (model shape, data settings, ...); a checkpoint made with other settings is refused.
    on_checkpoint(step) runs after a checkpoint (e.g. to export the drafter): after a step-count
    checkpoint, after a timed one once export_every_s have passed since the last export, and at
    the end just before the last checkpoint (so a run stopped during that export exports again).
    An objective whose metrics carry "tokens" (trained positions in the batch) gets a running
    `tokens_seen` in the log and the checkpoint; on_milestone(tokens, step) runs once when
    tokens_seen first reaches each of `milestones` (e.g. to keep a drafter for the scaling
    figure), just before a checkpoint: a resumed run never skips one (a crash between the two
    redoes the steps and calls it again with the same weights).
    Returns a summary: steps, resumed_from, first/last logged metrics, elapsed seconds.
    The log is out_dir/log.jsonl, one line per step with the objective's metrics, lr and
    grad norm."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = _identity(identity, cfg)
    # Matrices get weight decay, norms and biases do not. The optimizer indexes params
    # group by group, so checkpoints name them in that same order.
    named = objective.named_parameters()
    named = [(n, p) for n, p in named if p.dim() >= 2] + [(n, p) for n, p in named if p.dim() < 2]
    params = [p for _, p in named]
    torch.manual_seed(cfg.seed)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=cfg.betas)
    ordered = _NamedParams(named)
    step, cursor, elapsed, tokens_seen = 0, 0, 0.0, 0
    resumed_from = None
    stretches: list[dict] = []
    log_path = out_dir / LOG
    found = find_checkpoint(out_dir)
    if found is not None:
        try:
            saved = json.loads((found / "state.json").read_text())["settings"]
        except (OSError, ValueError, KeyError) as exc:
            raise BenchError(f"cannot resume from {found}: {exc}") from None
        if saved != settings:
            changed = next(k for k in sorted(set(settings) | set(saved)) if settings.get(k) != saved.get(k))
            raise BenchError(f"checkpoint in {out_dir} was made with other settings ({changed}): "
                             "use another output folder or delete it")
        state = load_checkpoint(found, ordered, optimizer)
        step, cursor, elapsed = state["step"], state["cursor"], state["elapsed_s"]
        tokens_seen = int(state.get("tokens_seen", 0))
        resumed_from = step
        # A checkpoint from before stretches were kept does not say where its steps ran.
        stretches = state.get("stretches") or ([{"from_step": 0, "to_step": step, "machine": None}] if step else [])
        _trim_log(log_path, step)
    elif log_path.exists():
        log_path.unlink()

    first = last = None
    stopped = False
    last_save = last_export = time.monotonic()
    started = time.monotonic() - elapsed
    # max_steps: the schedule this stretch ran under (a resumed run may be lengthened; its cosine then restarts higher).
    here = {"from_step": step, "to_step": step, "machine": training_machine(str(params[0].device)), "elapsed_s": 0.0,
            "max_steps": cfg.max_steps}
    if step < cfg.max_steps:
        stretches.append(here)
    invoked = time.monotonic()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", disable=not progress)
    memory = MemoryCap()
    with log_path.open("a") as log:
        while step < cfg.max_steps:
            lr = learning_rate(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch, cursor = next_batch(cursor)
            loss, metrics = objective.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            optimizer.step()
            memory.after_step()
            step += 1
            before = tokens_seen
            tokens_seen += int(metrics.get("tokens", 0))
            row = {"step": step, "loss": float(loss.detach()), **metrics, "lr": lr, "grad_norm": float(grad_norm),
                   "elapsed_s": round(time.monotonic() - started, 2)}
            if "tokens" in metrics:
                row["tokens_seen"] = tokens_seen
            if memory.purges:
                row["memory_purges"] = memory.purges  # this process's, since it started
            reached = [m for m in milestones if before < m <= tokens_seen]
            log.write(json.dumps(row) + "\n")
            log.flush()
            first = first or row
            last = row
            bar.update(1)
            bar.set_postfix({k: f"{v:.3g}" for k, v in row.items() if k in ("loss", "acc", "kl")})
            due_time = time.monotonic() - last_save >= cfg.checkpoint_every_s
            due_step = cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0
            for milestone in reached if on_milestone is not None else ():
                on_milestone(milestone, step)  # before the checkpoint: a crash in between redoes it
                last_export = time.monotonic()  # the milestone exported the drafter
            final = step == cfg.max_steps
            stopped = not final and cfg.stop_at is not None and time.time() >= cfg.stop_at
            final = final or stopped  # a stop exports and checkpoints as the end does
            if final and on_checkpoint is not None:
                on_checkpoint(step)  # before the last checkpoint, as a milestone: a run stopped in between redoes
                last_export = time.monotonic()  # its last steps and exports again (after it, nothing would)
            if due_time or due_step or reached or final:
                here.update(to_step=step, elapsed_s=round(time.monotonic() - invoked, 1))
                save_checkpoint(out_dir, ordered, optimizer, step, cursor, time.monotonic() - started, settings,
                                tokens_seen, cfg.max_steps, stretches)
                export_every = cfg.export_every_s if cfg.export_every_s is not None else 6 * cfg.checkpoint_every_s
                export_due = time.monotonic() - last_export >= export_every and not reached
                if on_checkpoint is not None and not final and (export_due or due_step):
                    on_checkpoint(step)
                    last_export = time.monotonic()
                last_save = time.monotonic()
            if stopped:
                break
    bar.close()
    return {"steps": step, "max_steps": cfg.max_steps, "stopped": stopped, "resumed_from": resumed_from,
            "first": first, "last": last, "tokens_seen": tokens_seen, "stretches": stretches,
            "elapsed_s": round(time.monotonic() - started, 1), "log": str(log_path)}


def read_log(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
