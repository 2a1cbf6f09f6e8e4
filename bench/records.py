"""Run records: one JSONL file per (target, task, method[-tag]), append-only.

Line 1 and every resumed invocation that writes start with a `header` record (provenance and the
settings); each finished turn is one `turn` record, written and fsync'd as soon as the
turn ends, so an interruption loses at most the turn in flight. Rerunning the same
command skips finished turns. A header whose settings differ from the file's first
header is refused: finished work is never mixed with, or overwritten by, other settings.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from bench.core.errors import BenchError
from bench.core.provenance import provenance


def records_path(results_dir: Path, target: str, task: str, method: str, tag: str | None = None) -> Path:
    name = f"{method}-{tag}" if tag else method
    return Path(results_dir) / target / task / f"{name}.jsonl"


# Repeat k > 1 of a series is a whole second pass (method and its AR baseline, interleaved
# again) kept in its own files, `<method>-<tag>.rep<k>.jsonl`: finished repeats are never
# appended to, and a report pairs each method turn with the baseline turn of its own repeat.
REPEAT = re.compile(r"^(?:(?P<tag>.+)\.)?rep(?P<repeat>\d+)$")


def repeat_tag(tag: str | None, repeat: int) -> str | None:
    """The tag that repeat `repeat` (1-based) of series `tag` is recorded under."""
    if repeat < 1:
        raise BenchError(f"repeat must be 1 or more, not {repeat}")
    if repeat == 1:
        return tag
    return f"{tag}.rep{repeat}" if tag else f"rep{repeat}"


def split_repeat(tag: str | None) -> tuple[str, int]:
    """(tag of repeat 1, repeat number) of a recorded tag: "grid.rep2" -> ("grid", 2)."""
    match = REPEAT.match(tag or "")
    return (match["tag"] or "", int(match["repeat"])) if match else (tag or "", 1)


_HELD: dict[str, object] = {}  # record-file locks this process holds (bench.records.RunFile.claim)


class RunFile:
    """Append-only JSONL records with resume. `settings` must match across invocations.

    Reading is free; writing turns needs `claim()`, an exclusive lock on `<file>.lock` held
    until the process ends, so two runs can share a finished file (two grids reading one AR
    baseline) but never both append the same turns. The header goes in with the first turn."""

    def __init__(self, path: Path, settings: dict, device: str) -> None:
        self.path = Path(path)
        # Compare settings as they read back from JSON (tuples become lists, keys strings).
        settings = json.loads(json.dumps(settings))
        self.settings = settings
        self.turns: dict[tuple[str, int], dict] = {}
        self._lock = None
        self._device = device
        try:  # fail before any decoding when the results cannot be written
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchError(f"cannot write results to {self.path.parent}: {exc.strerror}") from None
        if self.path.exists():
            self._check_settings(self._load(repair=False))

    def _check_settings(self, first_header: dict | None) -> None:
        if first_header is not None and first_header.get("settings") != self.settings:
            changed = sorted(k for k in set(self.settings) | set(first_header.get("settings", {}))
                             if self.settings.get(k) != first_header["settings"].get(k))
            raise BenchError(f"{self.path} was recorded with other settings ({', '.join(changed)}); "
                             "use --tag to start a separate record file")

    def claim(self) -> None:
        """Take the file for writing (once): lock it, then read back what other runs recorded
        before the lock, so no turn is decoded or written twice."""
        if self._lock is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BenchError(f"cannot write results to {self.path.parent}: {exc.strerror}") from None
        lock_path = self.path.with_name(self.path.name + ".lock")
        key = str(lock_path.resolve())
        if key not in _HELD:  # a second RunFile of this process on the same file shares the lock
            handle = open(lock_path, "w")  # noqa: SIM115 - held open: the lock lives as long as the process
            try:
                import fcntl

                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except ImportError:  # no fcntl (Windows): no guard against a second writer
                pass
            except BlockingIOError:
                handle.close()
                raise BenchError(f"{self.path} is being written by another run right now ({lock_path.name} is "
                                 "held); run again when it is done: finished turns are kept") from None
            _HELD[key] = handle
        self._lock = _HELD[key]
        self.turns = {}
        if self.path.exists():
            self._check_settings(self._load(repair=True))
        # Every invocation that writes leaves its provenance before its turns.
        self._append({"type": "header", "settings": self.settings, "provenance": provenance(self._device)})

    def _load(self, repair: bool) -> dict | None:
        """Read finished turns. An unfinished last line is skipped; with `repair` (only under
        the lock: it may be another run's write in flight otherwise) it is cut off: a crash
        left it."""
        try:
            raw = self.path.read_bytes()
            if raw and not raw.endswith(b"\n"):
                cut = raw.rfind(b"\n") + 1
                if repair:
                    print(f"[bench] {self.path}: dropping an unfinished last record ({len(raw) - cut} bytes)",
                          file=sys.stderr)
                    with open(self.path, "r+b") as handle:
                        handle.truncate(cut)
                raw = raw[:cut]
        except OSError as exc:
            raise BenchError(f"cannot resume {self.path}: {exc.strerror}") from None
        header = None
        for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record.get("type") == "header" and header is None:
                    header = record
                elif record.get("type") == "turn":
                    self.turns[(str(record["question_id"]), int(record["turn"]))] = record
            except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError):
                raise BenchError(f"{self.path}:{number}: corrupt record; move the file away "
                                 "or fix that line") from None
        return header

    def _append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def done(self, question_id: str, turn: int) -> dict | None:
        return self.turns.get((question_id, turn))

    def add_turn(self, record: dict) -> None:
        self.claim()
        record = {"type": "turn", **record}
        key = (str(record["question_id"]), int(record["turn"]))
        if key in self.turns:
            raise BenchError(f"{self.path}: turn {key[1]} of question {key[0]} is already recorded; not appending "
                             "it twice")
        self._append(record)
        self.turns[key] = record


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """(headers, turns) of a record file, for reports and metrics.

    A last line without its newline is a record still being written (or cut by a crash)
    and is skipped, so reports can read a file while a run appends to it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"cannot read records {path}: {getattr(exc, 'strerror', None) or exc}") from None
    lines = text.split("\n")[:-1]  # the piece after the last newline is unfinished (or empty)
    headers, turns = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise BenchError(f"{path}:{number}: corrupt record") from None
        if not isinstance(record, dict):
            raise BenchError(f"{path}:{number}: corrupt record")
        (headers if record.get("type") == "header" else turns).append(record)
    return headers, turns
