"""One way to read JSONL, line by line, for every JSONL file the project reads (task
questions, run records).

One rule: a line that is not UTF-8, not JSON, or not a JSON object is left out and named
(line number and why); every other line is kept, and blank lines are ignored. What a caller
does with the lines left out is its policy: a question file is bad input (tasks refuses
it), a record file is read around them and reports them (bench.records). Lines end at b"\\n"
only, so a U+2028 inside a JSON string never splits a record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class JsonLines:
    rows: list[tuple[int, dict]] = field(default_factory=list)  # (line number, object)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, why it was left out)
    unfinished: int = 0  # bytes after the last newline of a growing file: a write in flight, left out


def parse_jsonl(data: bytes, growing: bool = False) -> JsonLines:
    """The lines of `data`. `growing`: the file may be appended to while it is read (run
    records), so a last line without its newline is a record still being written (or cut
    by a crash), counted in `unfinished` and left out."""
    result = JsonLines()
    if growing:
        cut = data.rfind(b"\n") + 1
        data, result.unfinished = data[:cut], len(data) - cut
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            result.skipped.append((number, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"))
            continue
        except json.JSONDecodeError as exc:
            result.skipped.append((number, f"malformed JSON ({exc.msg})"))
            continue
        if isinstance(row, dict):
            result.rows.append((number, row))
        else:
            result.skipped.append((number, "not a JSON object"))
    return result


def read_jsonl(path: Path, growing: bool = False) -> JsonLines:
    """parse_jsonl of a file's bytes; OSError is the caller's to word."""
    return parse_jsonl(Path(path).read_bytes(), growing)
