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
