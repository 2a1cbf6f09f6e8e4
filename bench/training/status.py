"""Where each training run stands, read from its folder alone (`bench train --status`).

A run that takes days crosses sessions and machines: its checkpoint, log, exported manifest
and kept copies are what is left of it. This reads them without touching the run: the step
against the step count, the data seen, the recent seconds per step and what they leave, the
checkpoint's age, the last held-out numbers, and whether a live process holds the folder.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.core.drafters import heldout_of
from bench.training.features import POOL
from bench.training.loop import CHECKPOINT, LOCK, LOG

STATE = "state.json"
COMMAND = ".train.command"  # the command line of the run's latest start (`bench train` writes it)
SHOWN_POSITIONS = 8  # held-out agreement shown for the first draft positions
RATE_WINDOW = 200  # log rows the recent seconds per step are taken over (exports included)
LOG_TAIL_BYTES = 256 * 1024  # enough for RATE_WINDOW rows of the widest log (EAGLE-3's, ~600 bytes a row)


@dataclass
class RunStatus:
    folder: Path
    method: str
    step: int  # the last logged step (a stopped run resumes from checkpoint_step)
    checkpoint_step: int
    max_steps: int | None  # None where neither the checkpoint nor an export holds the count
    tokens_seen: int
    epochs: float | None
    checkpoint_age_s: float | None
    seconds_per_step: float | None
    pid: int | None  # the live process writing the folder, if any
    command: str | None = None
    heldout_step: int | None = None
    heldout_top1: list[float] = field(default_factory=list)
    predicted_tau: float | None = None
    rounds_tau: dict[str, float] = field(default_factory=dict)  # decode rounds replayed: "whole", "first_128"
    kept: list[int] = field(default_factory=list)  # trained-token counts of the copies in kept/
    checkpointed: bool = True  # False: started (its command is here), no checkpoint yet
    pool: dict = field(default_factory=dict)  # the feature pool the run began on (features.pinned_pool)

    @property
    def finished(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    @property
    def hours_left(self) -> float | None:
        if self.finished or self.max_steps is None or not self.seconds_per_step:
            return None
        return (self.max_steps - self.step) * self.seconds_per_step / 3600


def training_folders(roots: list[Path]) -> list[Path]:
    """Every training folder (one with a checkpoint, or a run's command: a run still extracting
    its features or compiling, or stopped before its first checkpoint) at or below `roots`, sorted."""
    found = set()
    for root in roots:
        root = Path(root)
        if (root / CHECKPOINT / STATE).is_file() or (root / COMMAND).is_file():
            found.add(root)
        elif root.is_dir():
            found.update(p.parent.parent for p in root.glob(f"**/{CHECKPOINT}/{STATE}"))
            found.update(p.parent for p in root.glob(f"**/{COMMAND}"))
    return sorted(found)


def read_status(folder: Path, now: float | None = None) -> RunStatus:
    """One training folder's status; a damaged file leaves its fields unknown, never fails."""
    folder = Path(folder)
    now = time.time() if now is None else now
    state = _json(folder / CHECKPOINT / STATE)
    manifest = _json(folder / "drafter.json")
    training = manifest.get("training") if isinstance(manifest.get("training"), dict) else {}
    # The checkpoint's count first: it is newer than an export's (a resumed run may change it).
    max_steps = next((n for n in (state.get("max_steps"), training.get("max_steps")) if _count(n)), None)
    checkpoint_step = _count(state.get("step"))
    rows = _log_tail(folder / LOG)
    step = max(checkpoint_step, rows[-1]["step"] if rows else 0)
    tokens_seen = max(_count(state.get("tokens_seen")), _count(rows[-1].get("tokens_seen")) if rows else 0)
    epochs = training.get("epochs") if isinstance(training.get("epochs"), float | int) else None
    if epochs is not None and _count(training.get("steps")):  # the export's count, carried to the last step
        epochs = epochs * step / training["steps"]
    heldout = heldout_of(manifest)
    settings = state.get("settings") if isinstance(state.get("settings"), dict) else {}
    command = _text(folder / COMMAND)
    return RunStatus(
        folder=folder, method=str(settings.get("method") or manifest.get("method") or _method_of(command) or "?"),
        step=step, checkpoint_step=checkpoint_step, max_steps=max_steps, tokens_seen=tokens_seen, epochs=epochs,
        checkpoint_age_s=_age(state.get("saved_at"), now), seconds_per_step=_seconds_per_step(rows),
        pid=_live_writer(folder / LOCK), command=command,
        heldout_step=training.get("steps") if heldout else None,
        heldout_top1=list(heldout.get("top1_by_position", [])), predicted_tau=heldout.get("predicted_tau"),
        rounds_tau=replayed_tau(heldout),
        kept=sorted(int(p.name.split("-")[0]) for p in (folder / "kept").glob("*-tokens")
                    if p.name.split("-")[0].isdigit() and (p / "drafter.json").is_file()),
        checkpointed=bool(state) or (folder / CHECKPOINT / STATE).exists(),
        pool=_json(folder / POOL))


def replayed_tau(heldout: dict) -> dict[str, float]:
    """The τ of the decode rounds a trainer replayed on held-out replies: over whole replies
    ("whole") and cut to their first N tokens ("first_N"), where it reports them."""
    found = {"whole": heldout["rounds_tau"]} if "rounds_tau" in heldout else {}
    found.update({k: v["rounds_tau"] for k, v in heldout.items()
                  if k.startswith("first_") and isinstance(v, dict) and "rounds_tau" in v})
    return found


def describe(run: RunStatus) -> str:
    """A run in a few lines: where, how far, how fast, what it predicts."""
    if run.pid is not None:
        state = f"running (pid {run.pid})" + ("" if run.checkpointed else
                                               ", no checkpoint yet (extracting features, compiling or early steps)")
    elif run.finished:
        state = "finished"
    elif not run.checkpointed:
        state = ("stopped before its first checkpoint; starts at step 0 when its command runs again "
                 "(a feature extraction goes on where it stopped)")
    else:
        state = f"stopped; resumes from step {run.checkpoint_step} when its command runs again"
    total = f"/{run.max_steps} ({100 * run.step / run.max_steps:.0f}%)" if run.max_steps else "/?"
    lines = [f"{run.method} in {run.folder}: {state}"]
    if run.checkpointed or run.step:
        lines.append(f"  step {run.step}{total}, {run.tokens_seen / 1e6:.2f}M tokens seen"
                     + (f", {run.epochs:.2f} epochs" if run.epochs is not None else ""))
    if isinstance(run.pool.get("tokens"), int) and run.pool.get("cache"):
        lines.append(f"  pool: {run.pool['tokens'] / 1e6:.2f}M tokens of feature cache {run.pool['cache']} "
                     "(what it began on, and keeps)")
    pace = []
    if run.seconds_per_step:
        pace.append(f"{run.seconds_per_step:.1f} s/step lately")
    if run.hours_left is not None:
        pace.append(f"{run.hours_left:.1f} h left at that pace")
    if run.checkpoint_age_s is not None:
        pace.append(f"checkpoint at step {run.checkpoint_step}, {_duration(run.checkpoint_age_s)} old")
    if pace:
        lines.append("  " + "; ".join(pace))
    if run.predicted_tau is not None:
        top1 = " / ".join(f"{a:.2f}" for a in run.heldout_top1[:SHOWN_POSITIONS])
        top1 += " / ..." if len(run.heldout_top1) > SHOWN_POSITIONS else ""
        replayed = "".join(f"; replayed rounds tau {tau:.2f}" if cut == "whole" else
                           f"; over their first {cut[len('first_'):]} tokens {tau:.2f}"
                           for cut, tau in run.rounds_tau.items())
        lines.append(f"  held out at step {run.heldout_step}: top-1 by draft position {top1}; "
                     f"predicted tau {run.predicted_tau:.2f}{replayed}")
    if run.kept:
        lines.append("  kept copies: " + ", ".join(f"{t / 1e6:.2g}M tokens" for t in run.kept))
    if run.command and not run.finished:
        lines.append(f"  command: {resume_command(run.command, run.folder)}")
    return "\n".join(lines)


def resume_command(command: str, folder: Path) -> str:
    """The run's command with `--out` naming this folder: a folder moved since the run started
    (set aside, or brought from another machine) resumes only where --out points."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        return command
    for i, word in enumerate(words[:-1]):
        if word == "--out" and Path(words[i + 1]).expanduser().resolve() != Path(folder).resolve():
            return shlex.join(words[:i + 1] + [str(folder)] + words[i + 2:]) + f"  (moved here from {words[i + 1]})"
    return command


def _method_of(command: str | None) -> str | None:
    """`--method X` of a run's command line (a run before its first checkpoint has no other record)."""
    import shlex

    try:
        words = shlex.split(command or "")
    except ValueError:
        return None
    return next((words[i + 1] for i, word in enumerate(words[:-1]) if word == "--method"), None)


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _count(value) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _age(stamp: str | None, now: float) -> float | None:
    try:
        return max(0.0, now - datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    except (AttributeError, ValueError):
        return None


def _log_tail(log: Path) -> list[dict]:
    """The log's last RATE_WINDOW rows of increasing steps (the loop trims the log to the
    checkpoint when it resumes; an older log may still repeat steps)."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = handle.read().decode(errors="replace").splitlines()[1:]
    except OSError:
        return []
    rows = []
    for line in tail:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("elapsed_s"), float | int):
            rows.append(row)
    start = len(rows) - 1  # the last stretch of increasing steps (a log kept across a resume may repeat some)
    while start > 0 and len(rows) - start < RATE_WINDOW and rows[start - 1]["step"] < rows[start]["step"]:
        start -= 1
    return rows[start:]


def _seconds_per_step(rows: list[dict]) -> float | None:
    """Over the logged rows: elapsed_s is carried across resumes, so a stopped stretch does not count."""
    steps = rows[-1]["step"] - rows[0]["step"] if len(rows) > 1 else 0
    seconds = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] if steps else 0
    return seconds / steps if steps > 0 and seconds > 0 else None


def _live_writer(lock: Path) -> int | None:
    """The pid in the folder's lock file when that process still runs a training (the lock is
    advisory; its pid stays in the file after the process ends)."""
    try:
        pid = int(lock.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"train" in cmdline else None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
