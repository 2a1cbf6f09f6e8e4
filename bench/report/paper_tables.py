"""The papers' tables beside ours: each published table re-shaped with our measured value in
every cell it has, from the kept records of the series run at the paper's setting.

The published numbers are data (bench/report/paper_tables.json: each table's source, the paper's
target, hardware and setting, each cell's value) and the cells we measure come from the
records of the series named there (the grid's for greedy tables; `make paper-tables` runs
the settings the grid does not, such as DSpark's T = 1 at block 7), each cell naming the
record file that made it. What differs (target, hardware, training data) is said per table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.core.errors import BenchError

PAPER_TABLES = Path(__file__).with_name("paper_tables.json")


@dataclass(frozen=True)
class PaperTable:
    key: str
    title: str
    source: str
    theirs: str  # the paper's target, hardware, setting
    series: str  # our series at the matched setting
    ours: str  # what differs on our side
    cells: tuple[dict, ...]  # {method, task, metric ("tau" | "speedup"), published, checked}


def load_paper_tables(path: Path = PAPER_TABLES) -> list[PaperTable]:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        return [PaperTable(t["key"], t["title"], t["source"], t["theirs"], t["series"], t["ours"],
                           tuple(t["cells"])) for t in raw["tables"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"unreadable paper tables {path}: {exc}") from None


def measured(per_task: pd.DataFrame | None, runs: dict[tuple[str, str], str], method: str, task: str,
             metric: str) -> tuple[float, str]:
    """Our value of one cell and the record file it comes from (nan, "" where not run)."""
    if per_task is None or per_task.empty:
        return float("nan"), ""
    rows = per_task[(per_task["method"] == method) & (per_task["task"] == task)]
    if rows.empty or metric not in rows:
        return float("nan"), ""
    return float(rows[metric].iloc[0]), runs.get((method, task), "")


def paper_table(table: PaperTable, per_task: pd.DataFrame | None, runs: dict[tuple[str, str], str]) -> pd.DataFrame:
    """One row per published cell: theirs, ours, the record file behind ours."""
    rows = []
    for cell in table.cells:
        ours, where = measured(per_task, runs, cell["method"], cell["task"], cell["metric"])
        unit = "x" if cell["metric"] == "speedup" else ""
        rows.append({"method": cell["method"], "task": cell["task"], "metric": "τ" if cell["metric"] == "tau"
                     else "speedup", "published": f"{cell['published']:g}{unit}",
                     "ours": "not run" if ours != ours else f"{ours:.2f}{unit}",
                     "our record": where or "-", "published number checked": cell.get("checked", "no")})
    return pd.DataFrame(rows)
