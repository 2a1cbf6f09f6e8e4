"""`bench report`: the tables (bench.report.tables), the figures (bench.report.plots) and one HTML page
(bench.report.html) from the kept records, and the generated README blocks (the headline
table in README.md, the references in results/README.md)."""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import shutil
from pathlib import Path

import pandas as pd

from bench.ablate import figure, records_in
from bench.core.errors import BenchError
from bench.paper_regime import ORACLE_PREFIX, regime_table
from bench.records import Problem, split_repeat, split_revision
from bench.report.claims import Evidence, claims_table
from bench.report.html import load_references, references_table, render, write_html
from bench.report.paper_tables import PaperTable, load_paper_tables, paper_table
from bench.report.plots import Figured, context_sweep, make_figures
from bench.report.revisions import NEWEST, display_revisions, revisions_table
from bench.report.tables import (
    BASELINE,
    BASELINE_AGE_MINUTES,
    HEADLINE,
    RESULTS_README,
    Records,
    RunFile,
    Shelf,
    Tables,
    build_tables,
    csv_table,
    display_table,
    to_markdown,
    update_readmes,
    write_tables,
)
from bench.tune import tuned_overview


def readme_blocks(tables: Tables, records: Records, command: str,
                  tuned: pd.DataFrame | None = None) -> dict[str, str]:
    """What `bench report --readme` writes between markers: `report` (the headline, README.md),
    `references`, `tuned` and `revisions` (results/README.md)."""
    baselines: dict[tuple[str, str], list[RunFile]] = {}
    for run in records.runs:
        if run.method == BASELINE:
            baselines.setdefault((run.task, run.series), []).append(run)
    several = len({series for _, series in baselines}) > 1
    sizes = "; ".join(f"{task}{f' [{series}]' if several else ''}: {max(len(r.turns) for r in runs)} turns"
                      + (f" x {len(runs)} passes" if len(runs) > 1 else "")
                      for (task, series), runs in sorted(baselines.items())) or "none"
    series = ", ".join(sorted({r.tag or "(untagged)" for r in records.runs})) or "none"
    note = (f"\n\nRecords: tag(s) {series} (`{command}`). Sample sizes (AR turns per task): {sizes}. "
            f"{len(records.problems)} missing/partial item(s): see the report's \"Missing and partial records\". "
            "How speedups are computed, the tuned budgets and earlier revisions: "
            "[results/README.md](results/README.md).")
    # Each block is written even when empty, so a block never keeps numbers from an earlier selection.
    blocks = {"tuned": "(none: no tuned series in this selection, `--tuned-tag`)",
              "revisions": "(none: no method has an earlier revision in this selection)"}
    if tuned is not None and not tuned.empty:
        blocks["tuned"] = (to_markdown(tuned) + (f"\n\n{STALE_NOTE}" if tuned["speedup [95% CI]"].str.endswith("*")
                                                  .any() else ""))
    revisions = revisions_table(records, "overall")
    if not revisions.empty:  # a retrained drafter's numbers beside the ones it replaced
        blocks["revisions"] = to_markdown(display_revisions(revisions))
    refs = references_table(load_references())
    return {"report": to_markdown(with_first_revision(tables.overall, revisions)) + note, **blocks,
            "references": to_markdown(refs) + "\n\nReported by the papers and the Spec-Bench leaderboard "
            "(other targets, other hardware), from bench/report/reference_numbers.json with the sources "
            "methods/README.md lists; not measured here."}


def with_first_revision(overall: pd.DataFrame, revisions: pd.DataFrame) -> pd.DataFrame:
    """The headline table with each method's oldest revision (τ, speedup, records) beside it:
    what a retrained drafter replaced, pooled over the same tasks as revisions_table pools."""
    shown = display_table(overall)
    if revisions.empty or shown.empty:
        return shown
    first = {}
    for _, r in revisions.iterrows():
        key = (r["target"], r["series"], r["method"])
        if key not in first and r["changed"] != NEWEST:
            first[key] = (f"{r['tau']:.2f}, " + ("-" if pd.isna(r.get("speedup", math.nan))
                                                 else f"{r['speedup']:.2f}x") + f" ({r['records']})")
    shown["first revision: τ, speedup"] = [first.get((t, s, m), "-") for t, s, m in
                                           zip(overall["target"], overall["series"], overall["method"])]
    return shown


def profile_block(profiles: list[dict]) -> str:
    """What `bench report --readme` writes between the `profile` markers: one line per kept
    `bench profile` record, every figure read from it."""
    lines = []
    for profile in sorted(profiles, key=lambda p: p["path"]):
        chain = {r["k"]: r for r in profile["rows"] if r["kind"] == "chain"}
        trees = {r["k"]: r for r in profile["rows"] if r["kind"] == "tree"}
        base = chain.get(1)
        if base is None:
            continue
        prov = profile.get("provenance") or {}
        head = (f"- `{Path(profile['path']).name}` ({prov.get('device_name', '?')}, {profile.get('dtype', '?')}, "
                f"{prov.get('torch_threads', '?')} thread(s), context {profile.get('context', '?')}, "
                f"median of {profile.get('repeats', '?')}, {str(prov.get('started_at', '?'))[:10]}): "
                f"t_v(1) {base['median_s'] * 1e3:.2f} ms")
        bound = profile.get("memory_bound") or {}
        if bound.get("step_over_limit"):
            spread = bound.get("step_over_limit_range")
            head += (f" = {bound['step_over_limit']:.2f}x the memory-bound limit"
                     + (f" [{spread[0]:.2f}, {spread[1]:.2f}] over rounds" if spread else "")
                     + f" ({bound['weight_bytes'] / 1e6:.0f} MB at {bound['read_bytes_per_s'] / 1e9:.1f} GB/s"
                     + (", read between the passes" if bound.get("rounds") else "") + ")")
        hf = profile.get("hf_generate") or {}
        if hf.get("step_s"):
            head += (f"; transformers.generate {hf['step_s'] * 1e3:.2f} ms/token "
                     f"({hf['step_s'] / base['median_s']:.2f}x)")
        shown = [k for k in (4, 8, 16, 32) if k in chain]
        if shown:
            head += (f"; t_v(k)/t_v(1) at k = {' / '.join(map(str, shown))}: "
                     + " / ".join(f"{chain[k]['median_s'] / base['median_s']:.2f}" for k in shown))
        if trees:
            head += (f"; top-2 trees of {' / '.join(map(str, sorted(trees)))} nodes: "
                     + " / ".join(f"{trees[k]['median_s'] / base['median_s']:.2f}" for k in sorted(trees)))
        compute = profile.get("compute_bound") or {}
        if compute.get("least_ratio_to_k1"):
            head += (f"; compute-bound floor of a {compute['k']}-token pass {compute['floor_s'] * 1e3:.1f} ms "
                     f"({compute['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s): t_v({compute['k']})/t_v(1) >= "
                     f"{compute['least_ratio_to_k1']:.2f} here")
        drafters = [d for d in profile.get("drafters", []) if "skipped" not in d]
        if drafters:
            head += "; draft ms per round: " + ", ".join(f"{d['method']} {d['draft_ms_per_round']:.1f}"
                                                         for d in drafters)
        lines.append(head + ".")
    return "\n".join(lines) or "No `bench profile` record."


STALE_NOTE = (f"\\* recorded more than {BASELINE_AGE_MINUTES} min after the tag's shared AR baseline on some task "
              "(the report's \"not interleaved\"): that speedup compares the machine at two moments, not two methods.")


def paper_tables_of(shelf: Shelf, records: Records, tables: Tables) -> list[tuple[PaperTable, pd.DataFrame]]:
    """Each published table (bench/report/paper_tables.json) beside our cells: from this report's
    records where the table's series is among them, else from that series' own records."""
    out = []
    for table in load_paper_tables():
        selected = records if table.series in set(tables.per_task.get("series", ())) else None
        if selected is None:
            try:
                selected = shelf.select(tags=(table.series,))
            except BenchError:
                selected = None
        per_task = build_tables(selected).per_task if selected is not None else None
        if per_task is not None and not per_task.empty:
            per_task = per_task[per_task["series"] == table.series]
        runs = {(r.method, r.task): str(r.path) for r in (selected.runs if selected else [])
                if r.series == table.series}
        out.append((table, paper_table(table, per_task, runs)))
    return out


def numbered_series_of(shelf: Shelf, prefix: str, targets: tuple[str, ...] = ()) -> pd.DataFrame | None:
    """The per-task rows of every series named `prefix` and a number (ctx512: the context
    sweep, python -m bench.context_sweep; oracle0.5: python -m bench.paper_regime) of
    `targets` (all where empty), or None where the shelf has none."""
    tags = set()
    for path in shelf.results_dir.glob(f"*/*/*-{prefix}*.jsonl*"):
        series = split_revision(split_repeat(path.name.split("-", 1)[1].split(".jsonl")[0])[0])[0]
        if series[len(prefix):len(prefix) + 1].isdigit():
            tags.add(series)
    if not tags:
        return None
    try:
        return build_tables(shelf.select(targets=tuple(targets) or None, tags=tuple(sorted(tags)))).per_task
    except BenchError:
        return None


BLOCK_SWEEP_TAGS = ("b4", "b8", "b16")  # `make block-sweep`: the drafters at block (budget) 4, 8, 16


def evidence_of(shelf: Shelf, tables: Tables, load: pd.DataFrame | None, profiles: list[dict]) -> Evidence:
    """What the claims table reads: this report's tables, the block sweep's and (where this
    report drew none) the load sweep's kept series, the hardware profiles."""
    def series(tags: tuple[str, ...]) -> pd.DataFrame | None:
        try:
            return build_tables(shelf.select(tags=tags)).per_task
        except BenchError:
            return None
    if load is None:
        load = series(tuple(f"load{b}" for b in (1, 2, 4, 8, 16, 32)))
    return Evidence(tables.per_task, tables.overall, series(BLOCK_SWEEP_TAGS), load, tuple(profiles))


def grid_settings(manifest: dict) -> bool:
    """Whether a grid manifest ran the grid's default suites and settings (greedy, its sample
    of each suite, its token budget) at every method's defaults (manifests written before they
    kept the budget and options do not say, so they do not count)."""
    from bench.grid import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PLAN

    return (manifest.get("plan") == DEFAULT_PLAN and manifest.get("max_new_tokens") == DEFAULT_MAX_NEW_TOKENS
            and not manifest.get("temperature") and "budget" in manifest and manifest["budget"] is None
            and manifest.get("options") == {})


DRAFTERS = "drafters"  # how each shipped drafter was trained
PROFILE = "profile"  # every kept hardware profile
# Blocks a README may leave out: each is written into whichever of the two files has its markers.
OPTIONAL_BLOCKS = (DRAFTERS, PROFILE, "tuned", "revisions")


def place_blocks(blocks: dict[str, str], readme: Path, results_readme: Path) -> dict[Path, dict[str, str]]:
    """The headline goes to README.md and `references` to results/README.md (both must have
    their markers); every optional block to the file that has its markers, or nowhere."""
    texts = {}
    for path in (readme, results_readme):
        try:
            texts[path] = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise BenchError(f"cannot read {path}: {exc.strerror}") from None
    files: dict[Path, dict[str, str]] = {readme: {}, results_readme: {}}
    for name, block in blocks.items():
        if name == HEADLINE:
            files[readme][name] = block
        elif name not in OPTIONAL_BLOCKS:
            files[results_readme][name] = block
        else:
            where = [p for p in (readme, results_readme) if f"<!-- {name}:start -->" in texts[p]]
            if where:
                files[where[0]][name] = block
    return files


def _duration(seconds: float) -> str:
    """A training time as hours, or minutes under an hour (a GPU run can take two)."""
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{max(1, round(seconds / 60))} min"


def drafters_table() -> str:
    """The shipped drafters, each with what its manifest says of its training: the data, the
    trained tokens, epochs, steps, time, machine and command (`bench train` records the last two)."""
    import methods  # noqa: F401  (registers the shipped drafters)
    from bench.core.drafters import list_drafters, read_manifest

    rows = []
    for target, method, kind, folder in list_drafters():
        if kind != "shipped":
            continue
        training = read_manifest(folder).get("training", {})
        runs = training.get("runs") or []
        tokens = training.get("tokens_seen") or training.get("reply_tokens_seen")
        elapsed = training.get("elapsed_s")
        pool = training.get("feature_tokens")
        data = training.get("data", "-") + (f"; a {pool / 1e6:.2f}M-token pool" if pool else "")
        command = runs[-1]["command"] if runs else training.get("command")
        rows.append({"target": target, "method": method, "data": data,
                     "trained tokens": f"{tokens / 1e6:.2f}M" if tokens else "not recorded",
                     "epochs": training.get("epochs", "-"), "steps": training.get("steps", "-"),
                     "time": _duration(elapsed) if elapsed else "-",
                     "machine": "; ".join(sorted({r["machine"] for r in runs})) or "not recorded",
                     "command": f"`{command}`" if command else "not recorded"})
    if not rows:
        return "No shipped drafter."
    return to_markdown(pd.DataFrame(rows)) + ("\n\nFrom each shipped drafter's `drafter.json` (methods/checkpoints/); "
                                              "`make train-at-scale` trains and ships the set at scale.")


def shipped_training_logs(targets: set[str], problems: list[Problem]) -> list[dict]:
    """The training log each shipped drafter of `targets` ships: per logged step the tokens
    seen and the agreement at draft position 0 (`acc0` where the trainer logs positions,
    else `acc`), and the held-out agreement its manifest records (None where it has none).
    An unreadable log or line is added to `problems`, not drawn."""
    import gzip
    import json
    import zlib

    import methods  # noqa: F401  (registers the shipped drafters)
    from bench.core.drafters import heldout_of, list_drafters, read_manifest

    logs = []
    for target, method, kind, folder in list_drafters():
        path = folder / "log.jsonl.gz"
        if kind != "shipped" or target not in targets or not path.is_file():
            continue
        try:
            lines = gzip.decompress(path.read_bytes()).decode().splitlines()
            heldout = heldout_of(read_manifest(folder)).get("top1_by_position") or [None]
        except (OSError, EOFError, UnicodeDecodeError, zlib.error, BenchError) as exc:
            problems.append(Problem("unreadable training log", str(path), str(exc).splitlines()[0]))
            continue
        tokens, agreement, bad = [], [], 0
        for line in filter(str.strip, lines):
            try:
                row = json.loads(line)
            except ValueError:
                bad += 1
                continue
            value = row.get("acc0", row.get("acc")) if isinstance(row, dict) else None
            if isinstance(row, dict) and isinstance(row.get("tokens_seen"), int) and isinstance(value, float | int):
                tokens.append(row["tokens_seen"])
                agreement.append(float(value))
        if bad:
            problems.append(Problem("damaged training log", str(path), f"{bad} unreadable line(s) left out"))
        logs.append({"target": target, "method": method, "tokens": tokens, "agreement": agreement,
                     "heldout": heldout[0]})
    return logs


def make_report(results_dir: Path, out: Path, targets: tuple[str, ...] = (), tasks: tuple[str, ...] = (),
                methods: tuple[str, ...] = (), tags: tuple[str, ...] = (), readme: Path | None = None,
                results_readme: Path | None = None, load_tags: tuple[str, ...] = (),
                tuned_tags: tuple[str, ...] = ()) -> dict:
    """Tables, figures and report.html under `out`. With `readme`, also its headline block, and
    the other blocks into `results_readme` (default: results/README.md beside `readme`).
    `load_tags`: a load sweep's series, drawn in the load figure only (not in the tables).
    `tuned_tags`: the grid at each method's tuned budget (bench.tune), shown beside the grid."""
    shelf = Shelf(Path(results_dir))  # every file read once, whatever the selections below
    records = shelf.select(targets or None, tasks or None, methods or None, tags or None)
    tables = build_tables(records)
    tuned = tuned_view = None
    if tuned_tags:
        tuned_records = shelf.select(targets or None, tasks or None, methods or None, tuned_tags)
        tuned = build_tables(tuned_records)
        stale = {Path(p.where).name.split("-", 1)[0] for p in tuned_records.problems if p.kind == "not interleaved"}
        tuned_view = tuned_overview(tuned.overall, tables.overall, stale)
        records.problems.extend(tuned_records.problems)
    load = None
    if load_tags:
        load_records = shelf.select(targets or None, tasks or None, methods or None, load_tags)
        load = build_tables(load_records).per_task
        records.problems.extend(load_records.problems)
    out = Path(out)
    selection = {"results": str(results_dir), "target": list(targets) or "all", "task": list(tasks) or "all",
                 "method": list(methods) or "all", "tag": list(tags) or "all"}
    if load_tags:
        selection["load figure"] = list(load_tags)
    if tuned_tags:
        selection["tuned budgets"] = list(tuned_tags)
    # Everything is written into a folder beside `out` first and moved in file by file once
    # whole, so a full disk or an unwritable folder leaves `out` as it was (and one line).
    stage = out.parent / f".{out.name}.partial"
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way")
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        written = write_tables(tables, stage, records)
        earlier = revisions_table(records, "task")
        if not earlier.empty:
            written.append(stage / "tables" / "revisions.csv")
            csv_table(earlier).to_csv(written[-1], index=False)
        figures = make_figures(records, tables, stage, load,
                               shipped_training_logs({run.target for run in records.runs}, records.problems))
        written += [p for f in figures if isinstance(f, Figured) for p in (f.png, f.svg)]
        if tuned is not None:
            written.append(stage / "tables" / "tuned.csv")
            csv_table(tuned.per_task).to_csv(written[-1], index=False)
        claims = claims_table(evidence_of(shelf, tables, load, records.profiles))
        written.append(stage / "tables" / "claims.csv")
        claims.to_csv(written[-1], index=False)
        papers = paper_tables_of(shelf, records, tables)
        for table, frame in papers:
            written.append(stage / "tables" / f"paper-{table.key}.csv")
            frame.to_csv(written[-1], index=False)
        regime = regime_table(load_paper_tables(), numbered_series_of(shelf, ORACLE_PREFIX, tuple(targets)))
        written.append(stage / "tables" / "paper-regime.csv")
        regime.to_csv(written[-1], index=False)
        studies = [r for r in records_in(Path(results_dir)) if not targets or r["target"] in targets]
        drawn = [figure(r, stage / "figures") for r in studies if r["arms"]]
        contexts = numbered_series_of(shelf, "ctx", tuple(targets))
        if contexts is not None:
            drawn.append(context_sweep(contexts, stage / "figures"))
        drawn = [f for f in drawn if isinstance(f, Figured)]
        figures += drawn
        written += [p for f in drawn for p in (f.png, f.svg)]
        write_html(stage / "report.html", render(records, tables, figures, selection, tuned=tuned_view,
                                                 ablations=studies, claims=claims, papers=papers,
                                                 regime=regime))
        fresh = sorted(p for p in stage.rglob("*") if p.is_file())
        for path in fresh:
            (out / path.relative_to(stage)).parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, out / path.relative_to(stage))
        # The report's own folders hold this report only: a table or figure an earlier report
        # wrote and this one did not (no revisions, no tuned series now) goes.
        kept = {out / p.relative_to(stage) for p in fresh}
        for folder in (out / "tables", out / "figures"):
            for path in folder.glob("*") if folder.is_dir() else []:
                if path.is_file() and path not in kept:
                    path.unlink()
    except OSError as exc:
        raise BenchError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    written = [out / p.relative_to(stage) for p in written]
    figures = [dataclasses.replace(f, png=out / f.png.relative_to(stage), svg=out / f.svg.relative_to(stage))
               if isinstance(f, Figured) else f for f in figures]
    html_path = out / "report.html"
    if readme is not None:
        command = "bench report" + "".join(f" --{k} {v}" for k, values in (("target", targets), ("task", tasks),
                                           ("method", methods), ("tag", tags)) for v in values)
        blocks = readme_blocks(tables, records, command, tuned_view)
        results_readme = Path(results_readme) if results_readme else Path(readme).parent / RESULTS_README
        blocks[DRAFTERS] = drafters_table()
        blocks[PROFILE] = profile_block(records.profiles)
        update_readmes(place_blocks(blocks, Path(readme), results_readme))
    return {"html": html_path, "files": written, "problems": records.problems, "tables": tables,
            "figures": figures}
