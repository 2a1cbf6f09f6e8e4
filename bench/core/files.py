"""Files written whole or not at all: a reader never sees half of one."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, value: object) -> None:
    """`value` as indented JSON at `path`, by rename from a temp file beside it."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def write_bytes(path: Path, data: bytes) -> None:
    """`data` at `path`, fsync'd in a temp file beside it before the rename (record files: a
    crash leaves the old file or the new one, never a part)."""
    path = Path(path)
    tmp = path.with_name("." + path.name + ".partial")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
