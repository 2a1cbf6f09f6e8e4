"""`python -m bench.grid --ray auto|ADDRESS`: the grid's cells as Ray tasks.

The driver (bench.grid) keeps every decision and every file: it plans the cells, picks
their tags, skips what is up to date, holds the record files' locks and appends what
comes back through RunFile, so the resume, skip and revision rules are the in-process
grid's. A worker needs no results folder: it gets the cell's settings, its questions and
the contents of its record files (what they hold tells it the turns still to do, and
carries the earlier turns a later one continues), decodes those turns
(bench.run.decode_pass into a sink) and returns the lines `bench run` would have appended.

Resources: `cpus_per_cell` cores per cell, which are also its torch threads (default: this
process's threads, 1 on CUDA), and one GPU when the device is CUDA. The cells of one task
and tag share an AR baseline file: while it lacks turns they run one at a time (the first
records the baseline, interleaved with its method as in `bench run`); once it is whole,
all at once.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from bench.core.errors import BenchError
from bench.records import BASELINE, RunFile, has_records, record_bytes
from bench.run import RunSettings, decode_pass
from tasks import Question

CONNECT_TIMEOUT_S = 5.0  # ray.init itself retries a dead address for minutes, then exits


def _first_line(exc: BaseException) -> str:
    """Ray's messages run to many lines; an error here is one."""
    return next(iter(str(exc).strip().splitlines()), type(exc).__name__)


def check_address(address: str) -> str:
    """The cluster's address (`auto`: the one `ray start` recorded here, or $RAY_ADDRESS),
    after something answered there; else a one-line error. Loads and writes nothing."""
    resolved = address
    if not address.startswith("ray://"):  # a Ray Client address is taken as given
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            resolved = canonicalize_bootstrap_address_or_die(address)
        except (ConnectionError, ValueError) as exc:
            raise BenchError(f"no Ray cluster at '{address}': {_first_line(exc)}") from None
    host, _, port = resolved.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        where = address if resolved == address else f"{address} ({resolved})"
        raise BenchError(f"no Ray cluster answers at {where}: {getattr(exc, 'strerror', None) or exc}; start one "
                         "with `ray start --head` or pass its address") from None
    return resolved


@dataclass
class CellJob:
    """One cell as the driver hands it out: its settings (tag chosen), its questions, and
    for each side (method, baseline) the record file and the settings it records."""
    settings: RunSettings
    questions: list[Question]
    paths: dict[str, Path]
    wanted: dict[str, dict]

    @cached_property
    def keys(self) -> set[tuple[str, int]]:
        return {(q.question_id, t) for q in self.questions for t in range(1, len(q.turns) + 1)}

    def whole(self, side: str) -> bool:
        path = self.paths[side]
        return has_records(path) and self.keys <= RunFile(path).keys


def decode_cell(settings: RunSettings, questions: list[Question], content: dict[str, bytes],
                threads: int) -> tuple[dict[str, list[dict]], str | None]:
    """On a worker: decode the turns the records (`content`, per side) lack. Returns the lines
    per side, and the error that stopped the pass, if any (the turns before it count, as in
    `bench run`)."""
    import torch

    torch.set_num_threads(threads)
    lines: dict[str, list[dict]] = {}
    try:
        decode_pass(settings, questions, lambda side, new: lines.setdefault(side, []).extend(new), content)
    except BenchError as exc:
        return lines, str(exc)
    return lines, None


class RayCells:
    """A connection to a cluster, and the cells queued on it until `run`."""

    def __init__(self, address: str, device: str, cpus_per_cell: int | None = None) -> None:
        import ray
        import torch

        self.ray = ray
        self.device = torch.device(device).type  # a worker's own GPU is its cuda:0
        self.threads = cpus_per_cell or (1 if self.device == "cuda" else torch.get_num_threads())
        try:
            ray.init(address=address, log_to_driver=False)
        except (Exception, SystemExit) as exc:  # SystemExit: ray exits when the cluster never answers
            raise BenchError(f"cannot connect to the Ray cluster at {address}: {_first_line(exc)}") from None
        self.remote = ray.remote(decode_cell).options(
            num_cpus=self.threads, num_gpus=1 if self.device == "cuda" else 0)
        self.queue: list[tuple[CellJob, Callable[[str], None]]] = []

    def submit(self, job: CellJob, done: Callable[[str], None]) -> None:
        """Queue a cell; `done(status)` is called once its turns are appended."""
        self.queue.append((job, done))

    def close(self) -> None:
        self.ray.shutdown()

    def run(self) -> None:
        """Run the queued cells, appending each one's turns as it finishes."""
        waiting, running = list(self.queue), {}
        self.queue = []
        while waiting or running:
            for job, done in list(waiting):
                base = job.paths[BASELINE]
                if any(other.paths[BASELINE] == base for other, *_ in running.values()) and not job.whole(BASELINE):
                    continue  # its baseline is being recorded by another cell of the task
                waiting.remove((job, done))
                try:
                    started = self._start(job)
                except BenchError as exc:  # e.g. a file another run is writing
                    done(f"failed: {exc}")
                    continue
                if started is None:
                    done("up to date (skipped)")  # another cell recorded the baseline it lacked
                else:
                    running[started[0]] = (job, done, started[1])
            if running:
                ready, _ = self.ray.wait(list(running), num_returns=1)
                job, done, files = running.pop(ready[0])
                done(self._finish(ready[0], files))

    def _start(self, job: CellJob) -> tuple[object, dict[str, RunFile]] | None:
        """Take the record files that lack turns (as `bench run` does) and send a worker the
        cell; None when they hold every turn."""
        files = {side: RunFile(path, job.wanted[side], self.device) for side, path in job.paths.items()}
        if all(job.keys <= run_file.keys for run_file in files.values()):
            return None
        for run_file in files.values():
            if not job.keys <= run_file.keys:
                run_file.claim()  # locked until this process ends; a crashed run's cut line is dropped first
        content = {side: record_bytes(path) if has_records(path) else b"" for side, path in job.paths.items()}
        # The worker names the records by the task's recorded name (its folder): a custom task file is not there.
        settings = replace(job.settings, device=self.device, task=job.paths[BASELINE].parent.name)
        return self.remote.remote(settings, job.questions, content, self.threads), files

    def _finish(self, ref, files: dict[str, RunFile]) -> str:
        """Append a finished cell's lines; its status."""
        try:
            lines, error = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError:
            raise  # a bug in the decode: as in-process, it stops the grid
        except self.ray.exceptions.RayError as exc:  # the worker or its node was lost
            return f"failed: {type(exc).__name__}: {_first_line(exc)}"
        try:
            for side, new in lines.items():
                files[side].add_lines(new)
        except BenchError as exc:
            error = error or str(exc)
        return f"failed: {error}" if error else "ran"
