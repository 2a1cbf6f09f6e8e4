"""Run records: one JSONL file per (target, task, method[-tag]), append-only, and everything
about them: the file class (`RunFile`, for runs and reports alike), the turn schema, the tag
grammar, the baseline's name.

Every invocation that writes starts with a `header` record (provenance and the settings),
written together with its first turn; each finished turn is one `turn` record, written and
fsync'd as soon as the turn ends, so an interruption loses at most the turn in flight and
leaves no header without a turn. Rerunning the same command skips finished turns (after
checking that the recorded prompt is the one it would ask). A header whose settings differ
from the file's first header is refused: finished work is never mixed with, or overwritten
by, other settings.

Reading, one rule everywhere (runs, reports, summaries, the grid): a line that is not UTF-8,
not JSON, not an object (bench.core.jsonl), neither a header nor a turn, fails the schema,
or repeats a (question, turn) already read is left out and reported; an unfinished last line
(a write in flight, or one cut by a crash) is left out and reported; nothing else is dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from bench.core.errors import BenchError
from bench.core.files import write_bytes
from bench.core.jsonl import parse_jsonl
from bench.core.provenance import provenance

BASELINE = "ar"  # the method every speedup is measured against; it runs beside every other


# Drafter fields a record carries for the reports (what its manifest says of held-out data),
# derived from the manifest that `manifest_sha` already names: not part of a run's identity.
DRAFTER_NOTES = ("heldout",)


# What a run records of its own settings as resolved, for readers (the report), not as identity:
# draft tokens per round, from --budget or the method's options.
RESOLVED_NOTES = ("draft_budget",)


def identity_of(settings: dict) -> dict:
    """A record header's settings as runs are compared (resume, the grid's revisions, repeats)."""
    settings = {k: v for k, v in settings.items() if k not in RESOLVED_NOTES}
    drafter = settings.get("drafter")
    if not isinstance(drafter, dict) or not any(k in drafter for k in DRAFTER_NOTES):
        return settings
    return dict(settings, drafter={k: v for k, v in drafter.items() if k not in DRAFTER_NOTES})


# What a method run and its baseline must share to be paired (a speedup, an exact match).
PAIRED_SETTINGS = ("target", "target_fingerprint", "task", "max_new_tokens", "sampling", "seed", "device", "dtype")


def pairing_difference(method: dict, base: dict) -> str | None:
    """The first setting a method run and its baseline were recorded with differently, as
    one phrase, or None when they may be paired. A batched run pairs with a batched baseline."""
    for key in (*PAIRED_SETTINGS, "batch_size"):
        ours, theirs = method.get(key), base.get(key)
        if key == "batch_size":
            ours, theirs = ours or 1, theirs or 1
        if ours != theirs:
            return f"{key} {json.dumps(ours)} against the baseline's {json.dumps(theirs)}"
    return None


def prompt_hash(prompt: list[int]) -> str:
    """The short name a turn record gives its prompt's token ids (resume matches on it)."""
    return hashlib.sha1(",".join(map(str, prompt)).encode()).hexdigest()[:12]


def records_path(results_dir: Path, target: str, task: str, method: str, tag: str | None = None) -> Path:
    name = f"{method}-{tag}" if tag else method
    return Path(results_dir) / target / task / f"{name}.jsonl"


# ---------------------------------------------------------------- packed record files
#
# A finished record file may be stored gzip'd beside its name, `<name>.jsonl.gz` (`bench pack`:
# byte for byte, so every rule of reading holds as before). It is still the record file
# `<name>.jsonl` everywhere: found by record_files, read by RunFile, and unpacked by the run
# that claims it to append. Where both exist, the plain file is the live one.

PACKED_SUFFIX = ".gz"


def packed_path(path: Path) -> Path:
    """Where a record file `<name>.jsonl` is kept packed."""
    return Path(path).with_name(Path(path).name + PACKED_SUFFIX)


def record_name(path: Path) -> Path:
    """A record file's own name (`<name>.jsonl`) for the file or its packed copy."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(PACKED_SUFFIX)) if path.name.endswith(".jsonl.gz") else path


def stored_file(path: Path) -> Path | None:
    """The file that holds a record file's lines: itself, else its packed copy; None if neither."""
    return next((p for p in (Path(path), packed_path(path)) if p.exists()), None)


def has_records(path: Path) -> bool:
    return stored_file(path) is not None


def record_files(root: Path, pattern: str = "*") -> list[Path]:
    """The record files under `root` matching `pattern` (a glob without the `.jsonl`), packed
    or not, each once by its own name."""
    root = Path(root)
    return sorted({*root.glob(pattern + ".jsonl"), *(record_name(p) for p in root.glob(pattern + ".jsonl.gz"))})


def record_bytes(path: Path) -> bytes:
    """A record file's lines as stored (unpacked); FileNotFoundError when neither file exists.
    A damaged packed copy raises OSError, as an unreadable file does."""
    import gzip
    import zlib

    stored = stored_file(path)
    if stored is None:
        raise FileNotFoundError(2, "no such file", str(path))
    if stored == Path(path):
        return stored.read_bytes()
    try:
        return gzip.decompress(stored.read_bytes())
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise OSError(f"{stored.name} is not a whole gzip file ({exc})") from None


def pack(path: Path) -> int | None:
    """Store a finished record file gzip'd (`<name>.jsonl.gz`, byte-exact, deterministic, so a
    repack changes nothing) and remove the plain one; returns the bytes saved, or None when
    there was no plain file. Takes the file's lock first: a file a run is writing is refused,
    and so is one whose last line is unfinished (`bench run` again repairs or finishes it), and
    one whose packed copy exists and is not where the plain file began (never packed over)."""
    import gzip
    import zlib

    path = Path(path)
    if not path.exists():
        return None
    key = str(path.with_name(path.name + ".lock").resolve())
    held = key in _HELD
    _lock(path)
    try:
        data = path.read_bytes()
        first = parse_jsonl(data[:data.find(b"\n") + 1]).rows
        if not first or first[0][1].get("type") != "header":
            raise BenchError(f"{path} is not a run record file (its first line is no header)")
        if parse_jsonl(data, growing=True).unfinished:
            raise BenchError(f"{path} ends in an unfinished line (a run cut by a crash); run it again before packing")
        if packed_path(path).exists():  # a run unpacked it and grew it: the packed lines come first
            try:
                before = gzip.decompress(packed_path(path).read_bytes())
            except (EOFError, zlib.error, gzip.BadGzipFile):
                before = None
            if before is None or not data.startswith(before):
                raise BenchError(f"{path} and {packed_path(path).name} hold different lines (not one grown from the "
                                 "other): neither is packed over the other; keep the right one and remove the other")
        packed = gzip.compress(data, compresslevel=9, mtime=0)
        if gzip.decompress(packed) != data:
            raise BenchError(f"internal: {path} did not read back from gzip")
        write_bytes(packed_path(path), packed)
        path.unlink()
    except OSError as exc:
        raise BenchError(f"cannot pack {path}: {exc.strerror or exc}") from None
    finally:
        if not held:  # a lock this call took goes with it: a pack of many files holds one at a time
            os.close(_HELD.pop(key))
    return len(data) - len(packed)


def _unpack(path: Path) -> None:
    """Make a packed record file plain again (under its lock) so a run can append to it."""
    if path.exists() or not packed_path(path).exists():
        return
    try:
        write_bytes(path, record_bytes(path))
        packed_path(path).unlink()
    except OSError as exc:
        raise BenchError(f"cannot unpack {packed_path(path)} to resume it: {exc.strerror or exc}") from None


# ---------------------------------------------------------------- tag grammar
#
# A record file is `<method>[-<tag>].jsonl`; a tag is `<series>[.r<N>][.rep<k>]`:
# - `.r<N>` (N >= 2): revision N of the series, started by bench.grid when settings or drafter
#   changed instead of touching finished records; a report shows the newest revision.
# - `.rep<k>` (k >= 2): repeat k, a whole second pass (method and its AR baseline, interleaved
#   again) of `bench run --repeats`, kept in its own files; a report pools the repeats of a
#   series and pairs each method turn with the baseline turn of its own repeat.
# Only canonical suffixes count (no r1, rep1, leading zeros), so every tag names one
# (series, revision, repeat). Users may not end a tag in either suffix (check_tag).

REPEAT = re.compile(r"^(?:(?P<tag>.+)\.)?rep(?P<repeat>[2-9]|[1-9]\d+)$")
REVISION = re.compile(r"^(?P<series>.+)\.r(?P<rev>[2-9]|[1-9]\d+)$")
RESERVED = re.compile(r"(?:^|\.)rep\d+$")
RESERVED_REVISION = re.compile(r"\.r\d+$")


def repeat_tag(tag: str | None, repeat: int) -> str | None:
    """The tag that repeat `repeat` (1-based) of series `tag` is recorded under."""
    if repeat < 1:
        raise BenchError(f"repeat must be 1 or more, not {repeat}")
    if repeat == 1:
        return tag
    return f"{tag}.rep{repeat}" if tag else f"rep{repeat}"


def revision_tag(tag: str, revision: int) -> str:
    """The tag of revision `revision` (1-based) of series `tag`."""
    return tag if revision == 1 else f"{tag}.r{revision}"


def split_repeat(tag: str | None) -> tuple[str, int]:
    """(tag of repeat 1, repeat number) of a recorded tag: "grid.rep2" -> ("grid", 2)."""
    match = REPEAT.match(tag or "")
    return (match["tag"] or "", int(match["repeat"])) if match else (tag or "", 1)


def split_revision(tag: str) -> tuple[str, int]:
    """(series, revision) of a tag without its repeat: "grid.r2" -> ("grid", 2)."""
    match = REVISION.match(tag)
    return (match["series"], int(match["rev"])) if match else (tag, 1)


# The scaling runs (scripts/scaling_runs.py): a drafter kept at N trained tokens runs under
# `scale-<N>-<run>`, <run> naming its training run (a hash of what fixes the run), so two runs
# whose copies saw the same token counts keep apart; `scale-<N>` is the older form.
SCALING_TAG = re.compile(r"^scale-(?P<tokens>\d+)(?:-(?P<run>[0-9a-f]{8}))?$")


def scaling_tag(tokens: int, run: str) -> str:
    return f"scale-{tokens}-{run}"


def scaling_tokens(series: str) -> int | None:
    """The training tokens a scaling series names (scaling_runs tags each drafter with its manifest's count)."""
    match = SCALING_TAG.match(series)
    return int(match["tokens"]) if match else None


def scaling_run(series: str) -> str | None:
    """The training run a scaling series names (None: not a scaling series, or the older form)."""
    match = SCALING_TAG.match(series)
    return match["run"] if match else None


def parse_tag(tag: str | None) -> tuple[str, int, int]:
    """(series, revision, repeat) of a recorded tag: "grid.r2.rep3" -> ("grid", 2, 3)."""
    rest, repeat = split_repeat(tag)
    series, revision = split_revision(rest)
    return series, revision, repeat


def check_tag(tag: str | None, revision_ok: bool = True) -> None:
    """Refuse a user's tag that the grammar would read as a repeat (or, unless `revision_ok`,
    a revision) of another series, or that is not a plain file-name part."""
    if tag is None:
        return
    if not tag or tag.startswith(".") or any(c in tag for c in "/\\\0") or tag != tag.strip():
        raise BenchError(f"tag '{tag}' cannot be part of a file name (no '/', no leading '.', not empty)")
    if RESERVED.search(tag):
        raise BenchError(f"tag '{tag}' ends in 'rep<k>', which marks repeat k of another series "
                         "(bench run --repeats makes those); choose another tag")
    if not revision_ok and RESERVED_REVISION.search(tag):
        raise BenchError(f"tag '{tag}' ends in '.r<N>', which marks revision N of another series "
                         "(the grid makes those); choose another tag")


# ---------------------------------------------------------------- schema


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _number_or_none(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(_int(v) for v in value)


def _utilization(value: object) -> bool:
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    return (isinstance(value.get("kind", ""), str) and _number_or_none(value.get("util_mean"))
            and all(value.get(k) is None or _int(value[k]) and value[k] > 0 for k in ("threads", "cpus"))
            and isinstance(value.get("series", []), list)
            and all(isinstance(p, list) and len(p) == 2 and all(_number_or_none(x) and x is not None for x in p)
                    for p in value.get("series", [])))


# What a turn record holds, one check per field: every reader (resume, report, summary, grid)
# leaves out a turn that fails it, and RunFile never writes one.
TURN_SCHEMA = {
    "question_id": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "turn": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "prompt_hash": (lambda v: isinstance(v, str), "a string"),
    "tokens": (_ints, "a list of integers"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "ttft": (_seconds, "seconds (a finite number >= 0)"),
    "decode_time": (_seconds, "seconds (a finite number >= 0)"),
    "draft_time": (_seconds, "seconds (a finite number >= 0)"),
    "verify_time": (_seconds, "seconds (a finite number >= 0)"),
    "proposed_lengths": (_ints, "a list of integers"),
    "accept_lengths": (_ints, "a list of integers"),
    "tree_sizes": (_ints, "a list of integers"),
}
PAIRED_FIELDS = ("ttft", "decode_time", "draft_time", "verify_time", "tokens", "proposed_lengths",
                 "accept_lengths", "tree_sizes")


def _paired_baseline(value: object) -> bool:
    """A method turn's re-timed baseline turn (bench.run: Side.retime): a turn's timing and
    round fields, its utilization, and whether it decoded the recorded tokens."""
    return (isinstance(value, dict) and all(k in value and TURN_SCHEMA[k][0](value[k]) for k in PAIRED_FIELDS)
            and "utilization" in value and _utilization(value["utilization"])
            and isinstance(value.get("same_tokens"), bool))


OPTIONAL_SCHEMA = {
    "category": (lambda v: isinstance(v, str), "a string"),
    "prompt_len": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "stop_reason": (lambda v: isinstance(v, str), "a string"),
    "rounds": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "repeat": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "utilization": (_utilization, "null or {kind, util_mean, threads, cpus, series}"),
    "exact_match": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "near_tie": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "first_divergence": (lambda v: v is None or _int(v), "an integer or null"),
    "divergence_margin": (_number_or_none, "a number or null"),
    "imported_from": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "method": (lambda v: isinstance(v, str) and v != "", "a method name"),
    "new_tokens": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "wall_time": (_seconds, "seconds (a finite number >= 0)"),
    "paired_baseline": (_paired_baseline, "{ttft, decode_time, draft_time, verify_time, tokens, "
                                          "proposed_lengths, accept_lengths, tree_sizes, utilization, same_tokens}"),
}

# A turn imported from another harness's answer file (bench.specbench; it says `imported_from`)
# holds what that file says and nothing invented: these fields may be null there. Such a file
# gives a turn's token count and its whole time, so `new_tokens` stands in for the token ids
# and `wall_time` for TTFT + decode time (bench.metrics.new_tokens, total_time).
IMPORTED_UNKNOWN = ("prompt_hash", "tokens", "ttft", "decode_time", "draft_time", "verify_time",
                    "proposed_lengths", "accept_lengths", "tree_sizes")


def turn_problem(record: dict) -> str | None:
    """Why `record` is not a valid turn record (missing or mistyped fields), or None."""
    missing = [k for k in TURN_SCHEMA if k not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    imported = "imported_from" in record
    unknown = {k for k in IMPORTED_UNKNOWN if imported and record[k] is None}
    wrong = [f"{k} is not {what}" for schema in (TURN_SCHEMA, OPTIONAL_SCHEMA) for k, (ok, what) in schema.items()
             if k in record and k not in unknown and not ok(record[k])]
    if "tokens" in unknown and "new_tokens" not in record:
        wrong.append("tokens is null without new_tokens")
    if unknown & {"ttft", "decode_time"} and "wall_time" not in record:
        wrong.append("ttft or decode_time is null without wall_time")
    if not wrong and _decoded_in_no_time(record, unknown):
        wrong.append("tokens decoded in zero seconds")
    return "; ".join(wrong) or None


def _decoded_in_no_time(record: dict, unknown: set[str]) -> bool:
    """A turn with tokens and no time at all: its tok/s would be infinite."""
    tokens = record["tokens"] if "tokens" not in unknown else [None] * int(record.get("new_tokens", 0))
    if not tokens:
        return False
    if unknown & {"ttft", "decode_time"}:
        return not record.get("wall_time", 0) > 0
    return not record["ttft"] + record["decode_time"] > 0


@dataclass
class Problem:
    """Something left out, missing or partial, shown in the report's "missing / partial"
    section (and by bench.report.summary, bench run as warnings)."""
    kind: str
    where: str
    detail: str


# ---------------------------------------------------------------- the record file

_HELD: dict[str, int] = {}  # record-file locks this process holds: lock path -> open descriptor


def _lock(path: Path) -> None:
    """Take `<file>.lock` for this process (once; held until it ends), or a one-line error."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        key = str(lock_path.resolve())
        if key in _HELD:  # a second RunFile of this process on the same file shares the lock
            return
        handle = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BenchError(f"cannot write results to {path.parent}: {exc.strerror}") from None
    try:
        import fcntl

        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # no fcntl (Windows): no guard against a second writer
        pass
    except BlockingIOError:
        os.close(handle)
        raise BenchError(f"{path} is being written by another run right now ({lock_path.name} is "
                         "held); run again when it is done: finished turns are kept") from None
    _HELD[key] = handle


def lock_unfinished(path: Path, keys: set[tuple[str, int]]) -> None:
    """Take the lock of a record file that still lacks some of the (question, turn) `keys`,
    before anything loads, so a second writer is refused at once; a file that holds them all
    stays free to read for others."""
    if not keys <= RunFile(path).keys:
        _lock(Path(path))


class RunFile:
    """One record file, `<results>/<target>/<task>/<method>[-<tag>].jsonl`.

    Opening reads it (the module's one rule: every line left out is in `problems`). Given
    the `settings` of a run, it is also the run's file: those must match the file's first
    header, and writing turns needs `claim()`, an exclusive lock on `<file>.lock` held until
    the process ends, so two runs can share a finished file (two grids reading one AR
    baseline) but never both append the same turns."""

    def __init__(self, path: Path, settings: dict | None = None, device: str = "cpu",
                 sink: Callable[[list[dict]], None] | None = None, content: bytes = b"") -> None:
        """`sink`: where written lines go instead of the file, which is then neither read
        nor locked: its `content` is what another process (bench.grid_ray's driver, which
        holds the lock) read from it, and that process appends the lines (add_lines)."""
        self.path = record_name(path)  # a packed file is read as the record file it holds
        self.target, self.task = self.path.parent.parent.name, self.path.parent.name
        # Compare settings as they read back from JSON (tuples become lists, keys strings).
        self._wanted = None if settings is None else json.loads(json.dumps(settings))
        self._device = device
        self._sink, self._content = sink, content
        self._claimed = False
        self._header_due = True  # an invocation's header goes in with its first turn
        if self._wanted is not None and sink is None:
            try:  # fail before any decoding when the results cannot be written
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise BenchError(f"cannot write results to {self.path.parent}: {exc.strerror}") from None
        self._read(repair=False, missing_ok=self._wanted is not None)
        if self._wanted is not None:
            self._check_settings()
            self._warn()

    # -- naming

    @cached_property
    def method(self) -> str:
        stem = self.path.stem
        method = self.headers[0]["settings"].get("method") if self.headers else None
        if not isinstance(method, str) or not method or (stem != method and not stem.startswith(method + "-")):
            method = stem.split("-", 1)[0]
        return method

    @property
    def tag(self) -> str:
        """"" when untagged."""
        return self.path.stem[len(self.method) + 1:]

    @property
    def series(self) -> str:
        return parse_tag(self.tag)[0]

    @property
    def revision(self) -> int:
        return parse_tag(self.tag)[1]

    @property
    def repeat(self) -> int:
        """1, or k for a file of tag `<tag>.rep<k>`."""
        return parse_tag(self.tag)[2]

    @property
    def settings(self) -> dict:
        """The run's settings, or (read only) those the file was started with."""
        if self._wanted is not None:
            return self._wanted
        return self.headers[0]["settings"] if self.headers else {}

    @cached_property
    def draft_budget(self) -> int | None:
        """Draft tokens per round as run (None: adaptive, not fixed, or no drafts). Records from
        before runs wrote it down are resolved from their options by today's method code."""
        settings = self.settings
        if "draft_budget" in settings:
            return settings["draft_budget"]
        from bench.registry import recorded_budget

        return recorded_budget(settings)

    @property
    def keys(self) -> set[tuple[str, int]]:
        return set(self._done)

    @cached_property
    def pooled(self) -> list[dict]:
        """The turns as reports pool them over tasks and repeats: the question id prefixed
        with the task (ids repeat across suites: gsm8k and specbench both count from 1) and the
        repeat from the file (bench.metrics pairs a turn with the baseline turn of the same
        question, turn and repeat), and `_threads`, the torch threads of the invocation that
        recorded it (bench.report.tables.contended_turns)."""
        return [{**t, "question_id": f"{self.task}/{t['question_id']}", "repeat": self.repeat,
                 "_threads": self._threads.get((t["question_id"], t["turn"]))} for t in self.turns]

    # -- reading

    def _read(self, repair: bool, missing_ok: bool = False) -> None:
        """Read headers and turns. With `repair` (only under the lock: it may be another run's
        write in flight otherwise) an unfinished last line is cut off: a crash left it."""
        self.headers: list[dict] = []
        self.turns: list[dict] = []
        self.problems: list[Problem] = []
        self._done: dict[tuple[str, int], dict] = {}
        self._threads: dict[tuple[str, int], object] = {}
        self.__dict__.pop("pooled", None)
        self.__dict__.pop("method", None)
        try:
            raw = self._content if self._sink is not None else record_bytes(self.path)
        except FileNotFoundError:
            if missing_ok:
                return
            self.problems.append(Problem("unreadable", str(self.path), "no such file"))
            return
        except OSError as exc:
            if self._wanted is not None:
                raise BenchError(f"cannot resume {self.path}: {exc.strerror or exc}") from None
            self.problems.append(Problem("unreadable", str(self.path), exc.strerror or str(exc)))
            return
        if self._sink is None and self.path.exists() and packed_path(self.path).exists():
            self.problems.append(Problem("packed copy", str(packed_path(self.path)), f"beside {self.path.name}, "
                                         "which is the file read; the packed copy is left out"))
        lines = parse_jsonl(raw, growing=True)
        if lines.unfinished:
            if repair:
                print(f"[bench] {self.path}: dropping an unfinished last record ({lines.unfinished} bytes)",
                      file=sys.stderr)
                try:
                    with open(self.path, "r+b") as handle:
                        handle.truncate(len(raw) - lines.unfinished)
                except OSError as exc:
                    raise BenchError(f"cannot repair {self.path}: {exc.strerror}") from None
            else:
                self.problems.append(Problem("unfinished", str(self.path), "last line has no newline (a run still "
                                             "writing, or one cut by a crash); that record is left out"))
        for number, why in lines.skipped:
            self.problems.append(Problem("corrupt", f"{self.path}:{number}", f"{why}; line left out"))
        for number, record in lines.rows:
            where = f"{self.path}:{number}"
            kind = record.get("type")
            if kind == "header":
                if isinstance(record.get("settings"), dict) and isinstance(record.get("provenance", {}), dict):
                    self.headers.append(record)
                else:
                    self.problems.append(Problem("corrupt", where, "a header without its settings; line left out"))
            elif kind == "turn":
                why = turn_problem(record)
                key = None if why else (record["question_id"], record["turn"])
                foreign = None if why else self._foreign(record)
                if why:
                    self.problems.append(Problem("malformed turn", where, f"{why}; turn left out"))
                elif foreign:
                    self.problems.append(Problem("foreign turn", where, f"{foreign}; turn left out"))
                elif key in self._done:
                    self.problems.append(Problem(
                        "duplicate", where, f"turn {key[1]} of question {key[0]} again (repeat {self.repeat}); "
                        "the first is kept, this line left out"))
                else:
                    self._done[key] = record
                    self._threads[key] = self._header_threads()
                    self.turns.append(record)
            else:
                self.problems.append(Problem("corrupt", where, "neither a header nor a turn; line left out"))

    def _foreign(self, record: dict) -> str | None:
        """Why a well-formed turn line does not belong to this file: it names another method,
        or it drafted in the baseline's file (AR verifies one token a round, drafting none)."""
        named = record.get("method")
        if named is not None and named != self.method:
            return f"a {named} turn in {self.method}'s file"
        if self.method == BASELINE and any(record.get("proposed_lengths") or []):
            return "a turn that drafted tokens, in the AR baseline's file"
        return None

    def _header_threads(self) -> object:
        """Torch threads of the invocation (the last header) a turn is recorded under."""
        return (self.headers[-1].get("provenance") or {}).get("torch_threads") if self.headers else None

    def _warn(self) -> None:
        for problem in self.problems:
            print(f"[bench] {problem.kind}: {problem.where}: {problem.detail}", file=sys.stderr)

    def _check_settings(self) -> None:
        if not self.headers or identity_of(self.headers[0]["settings"]) == identity_of(self._wanted):
            return
        first, wanted = identity_of(self.headers[0]["settings"]), identity_of(self._wanted)
        changed = sorted(k for k in set(wanted) | set(first) if wanted.get(k) != first.get(k))
        raise BenchError(f"{self.path} was recorded with other settings ({', '.join(changed)}); "
                         "use --tag to start a separate record file")

    # -- resume and writing

    def done(self, question_id: str, turn: int, prompt_hash: str | None = None) -> dict | None:
        """The recorded turn, if any. With `prompt_hash`, a turn recorded for another prompt
        (another question file of the same name, an edited question) is refused."""
        record = self._done.get((question_id, turn))
        if record is not None and prompt_hash is not None and record["prompt_hash"] != prompt_hash:
            raise BenchError(f"{self.path}: turn {turn} of question {question_id} was recorded for another prompt "
                             f"(prompt hash {record['prompt_hash']}, now {prompt_hash}): the question changed; "
                             "use --tag to start a separate record file")
        return record

    def claim(self) -> None:
        """Take the file for writing (once): lock it, then read back what other runs recorded
        before the lock, so no turn is decoded or written twice."""
        if self._claimed:
            return
        if self._sink is not None:  # the process that appends a sink's lines holds the file
            self._claimed = self._header_due = True
            return
        _lock(self.path)
        _unpack(self.path)
        self._claimed = True
        self._read(repair=True, missing_ok=True)
        self._check_settings()
        self._header_due = True

    def add_turn(self, record: dict, header_provenance: dict | None = None) -> None:
        """Record a finished turn (and, first, the invocation's header: `header_provenance`
        when another process decoded it, else this one's)."""
        if self._wanted is None:
            raise BenchError(f"{self.path} was opened for reading only")
        self.claim()
        record = {"type": "turn", "method": self.method, **record}  # a line says whose it is
        why = turn_problem(record) or self._foreign(record)
        if why:
            raise BenchError(f"{self.path}: refusing to record a malformed turn ({why})")
        key = (record["question_id"], record["turn"])
        if key in self._done:
            raise BenchError(f"{self.path}: turn {key[1]} of question {key[0]} is already recorded; not appending "
                             "it twice")
        lines = [record]
        if self._header_due:  # every invocation that writes leaves its provenance before its turns
            lines.insert(0, {"type": "header", "settings": self._wanted,
                             "provenance": header_provenance or provenance(self._device)})
        (self._sink or self._append)(lines)
        self._header_due = False
        if len(lines) == 2:
            self.headers.append(lines[0])
        self._done[key] = record
        self._threads[key] = self._header_threads()
        self.turns.append(record)
        self.__dict__.pop("pooled", None)

    def add_lines(self, lines: list[dict]) -> None:
        """Append what another process's sink received (headers, each followed by its turns)
        as if decoded here: each header must carry this run's settings, and its provenance
        heads its turns in the file."""
        header = None
        for line in lines:
            if line.get("type") == "header":
                if json.loads(json.dumps(line.get("settings"))) != self._wanted:
                    raise BenchError(f"{self.path}: the turns came back recorded with other settings than this "
                                     "run's; not appending them")
                header, self._header_due = line, True
            else:
                self.add_turn(line, header and header.get("provenance"))

    def _append(self, records: list[dict]) -> None:
        """Whole lines or nothing: one write, fsync'd; on a failure the file is cut back."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        try:
            handle = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise BenchError(f"cannot write results to {self.path}: {exc.strerror}") from None
        try:
            size = os.fstat(handle).st_size
            written = 0
            while written < len(data):
                written += os.write(handle, data[written:])
            os.fsync(handle)
        except OSError as exc:
            try:
                os.ftruncate(handle, size)
                kept = "the file is as it was"
            except OSError:
                kept = "a partial last line may remain: the next run drops it"
            raise BenchError(f"cannot append to {self.path}: {exc.strerror}; this turn was not recorded "
                             f"({kept}); finished turns are kept") from None
        finally:
            os.close(handle)


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """(headers, turns) of a record file, read by the module's rule (what it leaves out is in
    RunFile(path).problems)."""
    run = RunFile(path)
    if any(p.kind == "unreadable" for p in run.problems):
        raise BenchError(f"cannot read records {path}: {run.problems[0].detail}")
    return run.headers, run.turns


def read_run(path: Path, problems: list[Problem]) -> RunFile | None:
    """A record file for reports and summaries, its problems added to `problems`; None (a
    problem says why) when it has no header or no finished turn: such a file has no row."""
    run = RunFile(path)
    problems += run.problems
    if not run.headers:
        if not any(p.kind == "unreadable" for p in run.problems):
            problems.append(Problem("no header", str(path), "no settings or provenance recorded; file left out"))
        return None
    if not run.turns:
        problems.append(Problem("empty", str(path), "header only: no finished turn (a run stopped in its first "
                                "turn, or every turn was left out); file left out"))
        return None
    first = run.headers[0]["settings"]
    others = [i for i, h in enumerate(run.headers[1:], start=2) if h["settings"] != first]
    if others:  # RunFile refuses this; a hand-edited file could still hold it
        problems.append(Problem("mixed settings", str(path), f"headers {others} differ from the first; "
                                "numbers pool runs of different settings"))
    return run


def pool_repeats(runs: list[RunFile]) -> tuple[list[RunFile], list[Problem]]:
    """The repeats of one series (one method, task, revision) that may be pooled: those
    recorded with the settings of the lowest repeat; any other is left out, as a problem."""
    if not runs:
        return [], []
    runs = sorted(runs, key=lambda r: r.repeat)
    first = runs[0].settings
    kept, problems = [runs[0]], []
    for run in runs[1:]:
        if identity_of(run.settings) == identity_of(first):
            kept.append(run)
            continue
        changed = sorted(k for k in set(first) | set(run.settings) if first.get(k) != run.settings.get(k))
        problems.append(Problem("mixed settings", str(run.path), f"repeat {run.repeat} was recorded with other "
                                f"settings ({', '.join(changed)}) than {runs[0].path.name}; left out of the pool"))
    return kept, problems
