"""`bench check`: every record file read and checked, nothing trusted.

Per file it names what is malformed (lines that are not whole, schema-valid records),
duplicated (a turn recorded twice: the earlier line is the one counted), foreign (a turn of
another method, or a drafting turn in the baseline's file), unpaired (a method run without a
baseline of the same settings beside it), inconsistent (headers that disagree, a plain and a
packed copy side by side, a stored exact-match flag the token ids contradict, a greedy turn
recorded for another prompt than its baseline's). Anything of
these makes the command exit 1; what only describes a series (an older revision, a run not
finished, a method not run on a machine) is listed as a note. `bench report` shows the same
findings in its "Missing and partial" section.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bench import metrics
from bench.records import BASELINE, Problem, pairing_difference, read_run, record_files

DAMAGE = {"corrupt": "malformed", "malformed turn": "malformed", "unfinished": "malformed",
          "unreadable": "malformed", "no header": "malformed", "duplicate": "duplicated",
          "foreign turn": "foreign", "unpaired": "unpaired", "no baseline": "unpaired",
          "mixed settings": "inconsistent", "packed copy": "inconsistent", "flag disagrees": "inconsistent",
          "other prompts": "inconsistent"}


def check(results_dir: Path) -> list[Problem]:
    """Every finding under results_dir, file by file (all series, all revisions, all repeats)."""
    problems: list[Problem] = []
    runs = []
    for path in record_files(Path(results_dir), "*/*/*"):
        found: list[Problem] = []
        run = read_run(path, found)
        problems += found
        if run is not None:
            runs.append(run)
    by_key = {(r.target, r.task, r.tag, r.method): r for r in runs}
    for run in runs:
        if run.method == BASELINE:
            continue
        base = by_key.get((run.target, run.task, run.tag, BASELINE))
        if base is None:
            if run.settings.get("lossless", True) is not False and not _imported(run):
                problems.append(Problem("no baseline", str(run.path), f"no {BASELINE} records of tag "
                                        f"'{run.tag or '(untagged)'}' beside it"))
            continue
        problems += pair_findings(run, base)
    return problems


def pair_findings(run, base) -> list[Problem]:
    """What is wrong between a method run and its baseline of the same tag: other settings
    (never paired), stored exact-match flags the token ids contradict, greedy turns recorded
    for another prompt than the baseline's (bench report lists the same)."""
    why = pairing_difference(run.settings, base.settings)
    if why:
        return [Problem("unpaired", str(run.path), f"recorded with {why}: not compared with that baseline "
                        "(no speedup, no exact match)")]
    found = []
    wrong = [c for c in metrics.exact_matches(run.turns, base.turns) if c["exact"] != c["stored"]]
    if wrong:
        found.append(Problem("flag disagrees", str(run.path), f"{len(wrong)} turn(s) whose stored exact_match the "
                             "token ids contradict (the reports read the token ids)"))
    if float((run.settings.get("sampling") or {}).get("temperature", 0.0)) > 0:
        return found  # sampled: a later turn's prompt holds the earlier sampled replies, its own
    prompts = {(t["question_id"], t["turn"]): t.get("prompt_hash") for t in base.turns}
    other = [t for t in run.turns if prompts.get((t["question_id"], t["turn"]), t.get("prompt_hash"))
             not in (t.get("prompt_hash"), None) and t.get("prompt_hash") is not None]
    if other:
        found.append(Problem("other prompts", str(run.path), f"{len(other)} turn(s) recorded for another prompt "
                             "than the baseline's turn of the same question"))
    return found


def _imported(run) -> bool:
    return any("imported_from" in t for t in run.turns)


def summary(problems: list[Problem]) -> tuple[dict[str, list[Problem]], list[Problem]]:
    """(damage by file, notes)."""
    damaged: dict[str, list[Problem]] = defaultdict(list)
    notes = []
    for problem in problems:
        if problem.kind in DAMAGE:
            damaged[problem.where.split(":")[0]].append(problem)
        else:
            notes.append(problem)
    return dict(damaged), notes
