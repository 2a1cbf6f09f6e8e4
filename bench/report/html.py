"""One self-contained HTML file: tables, figures (base64 PNG), what is missing, the papers'
numbers, and the provenance and settings of every run. Inline CSS, no script, no external
URL, so it reads offline from a single file path."""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

import pandas as pd

from bench.core.provenance import git_sha
from bench.report.plots import Figured, Skipped
from bench.report.revisions import display_revisions, revisions_table
from bench.report.tables import BASELINE_AGE_MINUTES, Records, Tables, display_table

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: 12.5px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f0f3f7; } tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #e4e4e4; }
figcaption { font-size: 12.5px; color: #555; max-width: 900px; }
.note { color: #555; font-size: 13px; }
.warn { background: #fff6e0; border-left: 4px solid #e0a800; padding: .4em .8em; }
.ref { background: #eef4ff; border-left: 4px solid #4a78c2; padding: .4em .8em; }
pre { font-size: 11.5px; background: #f6f6f6; padding: .6em; overflow-x: auto; max-width: 1150px; }
nav a { margin-right: 1em; } .scroll { overflow-x: auto; max-width: 100%; }
"""
REFERENCES = Path(__file__).with_name("reference_numbers.json")


def _e(value: object) -> str:
    return html.escape(str(value))


def _table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return '<p class="note">(no rows)</p>'
    # Wide tables (provenance) scroll inside the page instead of overflowing it.
    return '<div class="scroll">' + frame.to_html(index=False, escape=True, border=0, na_rep="-") + "</div>"


def load_references() -> list[dict]:
    return json.loads(REFERENCES.read_text(encoding="utf-8"))["rows"]


def references_table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "method (ours)": r["method"], "as reported": r["name"], "source": f"{r['source']} ({r['ref']})",
        "model": r["model"], "hardware": r["hardware"], "setting": r["setting"] or "-",
        "τ": r["tau"] or "-", "speedup": r["speedup"] or "-", "recalled": "yes, unverified" if r["recalled"] else "",
    } for r in rows])


def ordering_table(overall: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """Our pooled τ and speedup beside the Spec-Bench leaderboard's, per method, so the
    orderings can be compared (their numbers: 7B/13B targets on an A100)."""
    board = {r["method"]: r for r in rows if r["source"].startswith("Spec-Bench")}
    out = []
    for _, row in overall[overall["method"] != "ar"].iterrows():
        theirs = board.get(row["method"], {})
        speed = row.get("speedup", float("nan"))
        out.append({"method": row["method"], "tag": row["series"], "ours: τ": f"{row['tau']:.2f}",
                    "ours: speedup": "-" if speed != speed else f"{speed:.2f}x",
                    "Spec-Bench leaderboard: τ": theirs.get("tau") or "-",
                    "Spec-Bench leaderboard: speedup": theirs.get("speedup") or "-",
                    "their model, hardware": f"{theirs['model']}, {theirs['hardware']}" if theirs else "-"})
    return pd.DataFrame(out)


def _figures(figures: list[Figured | Skipped]) -> str:
    parts = []
    for fig in figures:
        if isinstance(fig, Skipped):
            parts.append(f'<h3 id="fig-{fig.name}">{_e(fig.title)}</h3><p class="warn">Not drawn: {_e(fig.reason)}</p>')
            continue
        data = base64.b64encode(fig.png.read_bytes()).decode("ascii")
        parts.append(f'<h3 id="fig-{fig.name}">{_e(fig.title)}</h3><figure>'
                     f'<img src="data:image/png;base64,{data}" alt="{_e(fig.title)}">'
                     f"<figcaption>{_e(fig.caption)} Files: {_e(fig.png.name)}, {_e(fig.svg.name)}.</figcaption>"
                     "</figure>")
    return "\n".join(parts)


def _problems(records: Records, figures: list[Figured | Skipped]) -> str:
    rows = [{"kind": p.kind, "where": p.where, "detail": p.detail} for p in records.problems]
    rows += [{"kind": "figure not drawn", "where": f.name, "detail": f.reason}
             for f in figures if isinstance(f, Skipped)]
    if not rows:
        return '<p class="note">None: every selected record file was read in full.</p>'
    return '<p class="warn">These records are missing, partial or left out; the tables above say nothing ' \
           "about what is listed here.</p>" + _table(pd.DataFrame(rows))


def _provenance(records: Records) -> str:
    rows, details = [], []
    for run in records.runs + records.superseded:
        provs = [h.get("provenance", {}) for h in run.headers]
        first = provs[0] if provs else {}
        settings = run.settings
        drafter = settings.get("drafter") or {}
        rows.append({
            "file": str(run.path), "method": run.method, "task": run.task, "tag": run.tag or "-",
            "turns": len(run.turns), "invocations": len(run.headers),
            "git sha": ", ".join(dict.fromkeys(p.get("git_sha", "?")[:12] for p in provs)),
            "started": ", ".join(dict.fromkeys(p.get("started_at", "?") for p in provs)),
            "device": first.get("device_name", "?"), "threads": first.get("torch_threads", "?"),
            "max new": settings.get("max_new_tokens", "?"), "dtype": settings.get("dtype", "?"),
            "sampling": json.dumps(settings.get("sampling", {})),
            "options": json.dumps(settings.get("method_options", {})) if settings.get("method_options") else "-",
            "drafter": Path(str(drafter.get("drafter", ""))).name or "-",
            "in tables": "no (superseded)" if run in records.superseded else "yes"})
        details.append(f"<details><summary>{_e(run.path)}: {len(run.headers)} header(s)</summary>"
                       f"<pre>{_e(json.dumps(run.headers, indent=1, ensure_ascii=False))}</pre></details>")
    return _table(pd.DataFrame(rows)) + "\n".join(details)


def _settings(selection: dict, records: Records) -> str:
    parts = ["<pre>" + _e(json.dumps(selection, indent=1)) + "</pre>"]
    for manifest in records.manifests:
        plan = {k: v for k, v in manifest.items() if k != "cells"}
        parts.append(f"<h3>Grid manifest {_e(manifest['path'])}</h3><pre>{_e(json.dumps(plan, indent=1))}</pre>")
        parts.append(_table(pd.DataFrame(manifest["cells"])))
    return "\n".join(parts)


def _revisions(records: Records) -> str:
    frame = revisions_table(records, "task")
    if frame.empty:
        return "<p>No earlier revision: every method's records were recorded with today's settings.</p>"
    return ("<p>The grid never overwrites finished records: a cell whose settings changed (a retrained drafter, "
            "another dtype) runs into the next revision of its tag, and the tables above show the newest. "
            "Here each method with an older revision, every revision summarized the same way (speedup against "
            "the baseline of its own revision), with the settings that changed.</p>"
            + _table(display_revisions(revisions_table(records, "overall")))
            + "<h3>Per task</h3>" + _table(display_revisions(frame)))


def category_matrix(per_category: pd.DataFrame) -> pd.DataFrame:
    """Category x method, each cell "τ / speedup" (AIPerf's SPEED-Bench matrix, two metrics)."""
    if per_category.empty:
        return pd.DataFrame()
    rows = per_category[per_category["method"] != "ar"]
    cells = rows.assign(cell=[f"{t:.2f} / {s:.2f}x" if s == s else f"{t:.2f} / -"
                              for t, s in zip(rows["tau"], rows.get("speedup", pd.Series(float("nan"),
                                                                                         index=rows.index)))])
    matrix = cells.pivot_table(index=["series", "task", "category"], columns="method", values="cell",
                               aggfunc="first")
    matrix.columns.name = None
    return matrix.reset_index()


def _category_matrix(per_category: pd.DataFrame) -> str:
    matrix = category_matrix(per_category)
    if matrix.empty:
        return ""
    return ('<p class="note">τ / speedup over AR per category and method (the rows below in full).</p>'
            + _table(matrix))


def _papers(papers: list) -> str:
    parts = ['<p class="ref">Published numbers are <b>the papers\'</b>, each read in its source (column "published '
             'number checked"); ours come from the record file named in each row. The targets differ by one to two '
             "orders of magnitude and the hardware by kind, so compare orderings and trends, not values.</p>"]
    for table, frame in papers:
        parts.append(f'<h3 id="paper-{_e(table.key)}">{_e(table.title)}</h3>'
                     f'<p class="note">Source: {_e(table.source)}.<br>Theirs: {_e(table.theirs)}.<br>'
                     f"Ours (series <code>{_e(table.series)}</code>): {_e(table.ours)}.</p>" + _table(frame))
    return "\n".join(parts)


def _regime(regime: pd.DataFrame) -> str:
    return ("<p>At each τ a paper published, the speedup this decode loop reaches for the same method on this "
            "machine when its drafts are accepted that often (oracle acceptance: the method's real draft pass, tree "
            "and verification; only acceptance is set; greedy), read off the oracle runs' (τ, speedup) points "
            "(<code>python -m bench.paper_regime</code>, tags oracle&lt;a&gt;), beside the paper's own speedup. "
            "It separates what our system costs from what our drafters accept.</p>" + _table(regime))


def _claims(claims: pd.DataFrame) -> str:
    return ('<p class="note">Each claim on its own definition, measured on the kept records (the grid\'s series '
            "of this report, the block sweep, the load sweep, the hardware profiles), recomputed whenever the "
            "report is made. Our target is a 135M model on a CPU, the papers' 7-70B targets on GPUs: an ordering "
            "or a trend can be checked here, a value cannot.</p>" + _table(claims))


def _serving(records: Records) -> str:
    from bench.report.serving_gap import GAP, gap_table

    frame = gap_table(records.runs)
    if frame.empty:
        return ('<p class="note">No run here names its drafter\'s held-out prediction (records made before '
                "drafters carried it, or methods without a trained drafter).</p>")
    return (f'<p class="note">Per trained method and task: the τ its drafter\'s manifest predicts (decode rounds '
            "replayed on held-out replies cut to their first 128 tokens, greedy) beside the τ these records measured; "
            f"a gap over {GAP:.0%} is flagged with its likely cause.</p>" + _table(frame))


def _ablations(studies: list[dict], figures: list[Figured | Skipped]) -> str:
    from bench.ablate import table

    parts = []
    for record in studies:
        parts.append(f"<h3>{_e(record['study'])}: {_e(record['path'])}</h3>"
                     f'<p class="note">{len(record["arms"])} arms, {record["steps"]} steps each, '
                     f"on {_e(record['target'])}; "
                     f"data {_e(json.dumps(record['shared']))}, loop {_e(json.dumps(record['loop']))}; "
                     f"git {_e(str(record.get('git_sha', '?'))[:12])}, {_e(record.get('device_name', '?'))}.</p>")
        rows = [line.strip("|").split("|") for line in table(record).splitlines()
                if line.startswith("|") and not line.startswith("|---")]
        parts.append(_table(pd.DataFrame([[c.strip() for c in r] for r in rows[1:]],
                                         columns=[c.strip() for c in rows[0]])))
        if record.get("missing"):
            parts.append(f'<p class="warn">Not finished: {_e(", ".join(record["missing"]))}.</p>')
        parts.append(_figures([f for f in figures if f.name == f"ablation-{record['study']}"]))
    return "\n".join(parts)


def render(records: Records, tables: Tables, figures: list[Figured | Skipped], selection: dict,
           references: list[dict] | None = None,
           tuned: pd.DataFrame | None = None, ablations: list[dict] | None = None,
           claims: pd.DataFrame | None = None, papers: list | None = None,
           regime: pd.DataFrame | None = None) -> str:
    references = load_references() if references is None else references
    sizes = ", ".join(f"{task}: {n} turns" for task, n in tables.per_task[tables.per_task["method"] == "ar"]
                      .groupby("task")["turns"].max().items()) if not tables.per_task.empty else "none"
    sections = [
        ("overall", "Overall (all selected tasks pooled)", _table(display_table(tables.overall))),
        *([("tuned", "At each method's tuned budget (bench tune, --budget auto)",
            '<p class="note">The same suites, each method at the draft budget it ran fastest at on this machine '
            "(held-back ShareGPT prompts, interleaved with AR); \"at its defaults\" is the table above. A speedup "
            f"marked * was recorded more than {BASELINE_AGE_MINUTES} min after the tag's shared AR baseline "
            "(\"not interleaved\" under "
            "Missing and partial): it compares the machine at two moments.</p>"
            + _table(tuned))] if tuned is not None and not tuned.empty else []),
        ("figures", "Figures", _figures([f for f in figures if not f.name.startswith("ablation-")])),
        ("tasks", "Per task", _table(display_table(tables.per_task))),
        ("categories", "Per category (MT-bench, Spec-Bench, SPEED-Bench)", _category_matrix(tables.per_category)
         + _table(display_table(tables.per_category))),
        *([("papers", "The papers' tables beside ours", _papers(papers))] if papers else []),
        *([("regime", "The papers' regime through our loop", _regime(regime))] if regime is not None else []),
        *([("claims", "The papers' claims, checked here", _claims(claims))] if claims is not None else []),
        ("serving", "Training against serving", _serving(records)),
        *([("ablations", "Recipe ablations (bench ablate)", _ablations(ablations, figures))] if ablations else []),
        ("revisions", "Earlier revisions (before a retrained drafter or other settings)", _revisions(records)),
        ("missing", "Missing and partial records", _problems(records, figures)),
        ("references", "Reported by the papers (not measured here)",
         '<p class="ref">The numbers in this section are <b>reported by the papers</b> and the Spec-Bench '
         "leaderboard for other targets and hardware (bench/report/reference_numbers.json, sources in "
         "methods/README.md); rows marked recalled were taken from memory of the paper, not re-read. "
         "Compare orderings, not values.</p><h3>Ordering: ours beside the Spec-Bench leaderboard</h3>"
         + _table(ordering_table(tables.overall, references) if not tables.overall.empty else pd.DataFrame())
         + "<h3>All reported numbers</h3>" + _table(references_table(references))),
        ("runs", "Runs and provenance", _provenance(records)),
        ("settings", "Settings of this report", _settings(selection, records)),
    ]
    nav = " ".join(f'<a href="#{key}">{_e(title.split(" (")[0])}</a>' for key, title, _ in sections)
    body = "\n".join(f'<h2 id="{key}">{_e(title)}</h2>\n{content}' for key, title, content in sections)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Speculative decoding report</title>
<style>{CSS}</style></head><body>
<h1>Speculative decoding report</h1>
<p class="note">Generated {_e(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))} by <code>bench report</code>
at commit {_e(git_sha()[:12])}. Every number in the tables and figures is computed from the run records listed
under <a href="#runs">Runs</a>; speedups are ratios of sums against the AR baseline of the same tag with a 95%
bootstrap interval over paired turns; "speedup (Spec-Bench)" is Spec-Bench's convention over the same turns, the
ratio of mean per-question tok/s. Sample sizes (AR turns per task): {_e(sizes)}.
{len(records.problems)} problem(s) listed under <a href="#missing">Missing and partial</a>.</p>
<nav>{nav}</nav>
{body}
</body></html>
"""


def write_html(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
