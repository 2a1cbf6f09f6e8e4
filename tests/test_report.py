"""`bench report` and the all-results grid, on hand-built records whose numbers are worked
out by hand (tests/report_helpers.py). No model is loaded."""

from __future__ import annotations

import base64
import gzip
import io
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from report_helpers import PLD_ROUNDS, TARGET, turn, write_clean, write_profile, write_run

from bench import metrics
from bench.cli import main
from bench.core.errors import BenchError
from bench.report.plots import Figured, Skipped, make_figures
from bench.report.tables import (
    build_tables,
    display_table,
    load_records,
    replace_between_markers,
    summarize,
    to_latex,
    to_markdown,
    update_readme,
    update_readmes,
    write_tables,
)


def row(frame, **match):
    chosen = frame
    for key, value in match.items():
        chosen = chosen[chosen[key] == value]
    assert len(chosen) == 1, (match, chosen)
    return chosen.iloc[0]


def kinds(records) -> list[str]:
    return sorted(p.kind for p in records.problems)


def test_per_task_and_pooled_numbers(tmp_path):
    write_clean(tmp_path)
    records = load_records(tmp_path)
    per_task, overall = summarize(records, "task"), summarize(records, "overall")
    mt = row(per_task, task="mtbench", method="pld")
    assert mt["tau"] == pytest.approx(3.0) and mt["turns"] == 4 and mt["questions"] == 2
    assert mt["speedup"] == pytest.approx(2.0) and mt["match_rate"] == 1.0
    assert row(per_task, task="gsm8k", method="pld")["speedup"] == pytest.approx(4.0)
    # Pooled over suites whose question ids collide ("1" in both): (6.0/50) / (2.5/50).
    pooled = row(overall, method="pld")
    assert pooled["speedup"] == pytest.approx(2.4) and pooled["turns"] == 5
    assert row(overall, method="ar")["tokens_per_s"] == pytest.approx(50 / 6.0)
    # Speedup model S = τ·t0/(t_d+t_v): t0 = 0.9 s verify / 9 AR steps, t_d+t_v = 0.4 s / 3 rounds.
    assert pooled["speedup_model"] == pytest.approx(3 * 0.1 / (0.4 / 3))
    assert mt["verify_s_per_round"] == pytest.approx(0.1) and mt["draft_s_per_round"] == pytest.approx(0.1 / 3)
    # The same numbers bench.metrics gives on the raw turns: one definition, reused.
    pld = [t for r in records.runs if r.method == "pld" and r.task == "mtbench" for t in r.turns]
    ar = [t for r in records.runs if r.method == "ar" and r.task == "mtbench" for t in r.turns]
    assert mt["speedup_ci"] == metrics.speedup_interval(pld, ar)
    assert records.problems[0].kind == "missing" and "bench profile" in records.problems[0].detail


def test_per_category_tables_only_for_category_suites(tmp_path):
    write_clean(tmp_path)
    categories = summarize(load_records(tmp_path), "category")
    assert set(categories["task"]) == {"mtbench"}
    assert sorted(categories[categories["method"] == "pld"]["category"]) == ["math", "writing"]
    assert row(categories, category="math", method="pld")["speedup"] == pytest.approx(2.0)


def test_filters(tmp_path):
    write_clean(tmp_path)
    write_clean(tmp_path, tag="other")
    records = load_records(tmp_path, tasks=("gsm8k",), methods=("pld",), tags=("t",))
    assert [(r.task, r.method, r.tag) for r in records.runs] == [("gsm8k", "pld", "t")]
    with pytest.raises(BenchError, match="no run records"):
        load_records(tmp_path, tags=("nothing",), targets=(TARGET,))
    with pytest.raises(BenchError, match="results folder not found"):
        load_records(tmp_path / "absent")


def test_bad_records_are_reported_and_nothing_else_is_lost(tmp_path):
    write_clean(tmp_path)
    good = turn("1", category="writing", decode=0.4, draft=0.1, verify=0.3, exact=True, **PLD_ROUNDS)
    broken = dict(good, turn=2)
    del broken["accept_lengths"]
    path = write_run(tmp_path, "mtbench", "eagle", "t", [good, broken], tail='{"type": "turn", "question')
    text = path.read_text().split("\n")
    path.write_text("\n".join(text[:1] + ["{not json"] + text[1:]))  # a corrupt line in the middle
    write_run(tmp_path, "mtbench", "sps", "lonely", [good])  # no ar-lonely beside it
    records = load_records(tmp_path)
    details = {(p.kind, p.where.rsplit("/", 1)[-1]): p.detail for p in records.problems}
    assert ("corrupt", "eagle-t.jsonl:2") in details
    assert ("unfinished", "eagle-t.jsonl") in details
    assert ("malformed turn", "eagle-t.jsonl:4") in details and "accept_lengths" in details[
        ("malformed turn", "eagle-t.jsonl:4")]
    partial = [p.detail for p in records.problems if p.kind == "partial" and p.where.endswith("eagle-t.jsonl")]
    assert len(partial) == 2 and "1 of the 4 turns its baseline has" in partial[0]
    assert partial[1] == "MT-bench questions with turn 1 only: 1"
    assert ("no baseline", "sps-lonely.jsonl") in details
    # The good turn of the damaged file still counts, and so does every clean file.
    per_task = summarize(records, "task")
    assert row(per_task, method="eagle", task="mtbench")["turns"] == 1
    assert row(per_task, method="pld", task="mtbench")["speedup"] == pytest.approx(2.0)
    assert "no baseline" in row(display_table(per_task), method="sps")["speedup [95% CI]"]


def test_pooled_revisions_follow_the_drafter_not_the_revision_number(tmp_path):
    """A task rerun more often numbers the same drafter's cells higher (MT-bench's grid.r3 is
    GSM8K's grid.r2): the pooled rows group cells by their settings, never across drafters."""
    from bench.report.revisions import display_revisions, revisions_table

    write_clean(tmp_path, tag="grid")
    mt_keys = [("1", 1), ("1", 2), ("2", 1), ("2", 2)]
    drafters = {name: {"sha": name, "trained_tokens": tokens} for name, tokens in
                (("a", 200_000), ("b", 1_000_000), ("c", 5_000_000))}
    for task, keys, revisions in (("mtbench", mt_keys, ("a", "b", "c")), ("gsm8k", [("1", 1)], ("b", "c"))):
        for number, name in enumerate(revisions, start=2):
            write_run(tmp_path, task, "ar", f"grid.r{number}", [turn(q, n) for q, n in keys])
            write_run(tmp_path, task, "pld", f"grid.r{number}", [turn(q, n, decode=0.5) for q, n in keys],
                      drafter=drafters[name])
    overall = display_revisions(revisions_table(load_records(tmp_path, tags=("grid",)), "overall"))
    assert list(zip(overall.records, overall.turns, overall["drafter trained on"])) == [
        ("grid", 5, "-"), ("grid.r2", 4, "0.20M tokens"), ("grid.r2, grid.r3", 5, "1.00M tokens"),
        ("grid.r3, grid.r4", 5, "5.00M tokens")]


def test_a_record_without_token_count_takes_the_shipped_drafter_of_its_weights(tmp_path, monkeypatch):
    """MTP's and SpS's records name their drafter by its weights' digest only: the table takes the
    trained tokens from the shipped drafter with those weights, and from no other."""
    from bench.core import drafters
    from bench.report import tables

    shipped = tmp_path / "shipped" / TARGET / "pld"
    shipped.mkdir(parents=True)
    (shipped / drafters.WEIGHTS).write_bytes(b"weights of the shipped drafter")
    (shipped / drafters.MANIFEST).write_text(json.dumps({"training": {"tokens_seen": 6_460_094}}))
    monkeypatch.setattr(drafters, "SHIPPED_ROOTS", [tmp_path / "shipped"])
    tables._shipped_tokens_by_digest.cache_clear()
    results = tmp_path / "results"
    write_clean(results, tag="grid")
    digest = drafters.weights_sha1(shipped)
    write_run(results, "gsm8k", "ar", "grid.r2", [turn("1", ttft=0.2, decode=1.8)])
    write_run(results, "gsm8k", "pld", "grid.r2", [turn("1", decode=0.9, **PLD_ROUNDS)],
              drafter={"weights_sha1": digest})
    write_run(results, "mtbench", "pld", "grid.r2", [turn("1", 1, decode=0.9, **PLD_ROUNDS)],
              drafter={"weights_sha1": "0123456789ab"})  # no shipped drafter has these weights
    try:
        per_task = summarize(load_records(results, tags=("grid",)), "task")
    finally:
        tables._shipped_tokens_by_digest.cache_clear()
    assert row(per_task, task="gsm8k", method="pld")["trained_tokens"] == 6_460_094
    assert math.isnan(row(per_task, task="mtbench", method="pld")["trained_tokens"])


def test_newest_revision_wins_and_older_ones_are_listed(tmp_path):
    write_clean(tmp_path, tag="grid")
    write_run(tmp_path, "gsm8k", "ar", "grid.r2", [turn("1", ttft=0.2, decode=1.8)])
    write_run(tmp_path, "gsm8k", "pld", "grid.r2", [turn("1", decode=0.9, **PLD_ROUNDS)])  # now speedup 2
    records = load_records(tmp_path, tags=("grid",))
    assert {r.tag for r in records.runs if r.task == "gsm8k"} == {"grid.r2"}
    assert row(summarize(records, "task"), task="gsm8k", method="pld")["speedup"] == pytest.approx(2.0)
    assert sorted(p.where.rsplit("/", 1)[-1] for p in records.problems if p.kind == "superseded") == [
        "ar-grid.jsonl", "pld-grid.jsonl"]
    # A method not rerun yet keeps the baseline it was interleaved with, though that one has a newer revision.
    write_run(tmp_path, "mtbench", "ar", "grid.r2", [turn(q, n) for q, n in (("1", 1), ("1", 2), ("2", 1), ("2", 2))])
    records = load_records(tmp_path, tags=("grid",))
    assert row(summarize(records, "task"), task="mtbench", method="pld")["speedup"] == pytest.approx(2.0)
    assert not [p for p in records.problems if p.kind == "no baseline"]
    # ...and that baseline, still in use, is not listed as a leftover revision
    assert "ar-grid.jsonl" not in [p.where.rsplit("/", 1)[-1] for p in records.problems
                                   if p.kind == "superseded" and "mtbench" in p.where]
    assert [r.path.name for r in records.superseded if r.task == "mtbench"] == ["ar-grid.jsonl"]


def test_earlier_revisions_are_shown_beside_the_newest(tmp_path):
    from bench.report.build import make_report
    from bench.report.revisions import display_revisions, revisions_table

    write_clean(tmp_path, tag="grid")  # gsm8k: pld speedup 4 (a 0.2M-token drafter), MT-bench 2
    write_run(tmp_path, "gsm8k", "ar", "grid.r2", [turn("1", ttft=0.2, decode=1.8)])
    write_run(tmp_path, "gsm8k", "pld", "grid.r2", [turn("1", decode=0.9, **PLD_ROUNDS)],
              drafter={"sha": "new", "trained_tokens": 1_400_000})  # retrained: now speedup 2
    records = load_records(tmp_path, tags=("grid",))
    per_task = revisions_table(records, "task")
    assert list(zip(per_task.task, per_task.method, per_task.records)) == [
        ("gsm8k", "pld", "grid"), ("gsm8k", "pld", "grid.r2")]  # MT-bench has one revision: not listed
    assert list(per_task.speedup) == pytest.approx([4.0, 2.0]) and list(per_task.tau) == pytest.approx([3.0, 3.0])
    shown = display_revisions(per_task)
    assert list(shown["changed against the newest"]) == ["drafter", "(newest)"]
    assert list(shown["drafter trained on"]) == ["-", "1.40M tokens"]
    # Pooled, each revision over the same tasks (GSM8K only), never MT-bench's unchanged turns.
    overall = revisions_table(records, "overall")
    assert list(overall.records) == ["grid", "grid.r2"] and list(overall.turns) == [1, 1]
    assert "changed against the newest" not in display_revisions(overall)
    assert revisions_table(load_records(tmp_path, tags=("grid",), tasks=("mtbench",))).empty
    # In the report (its own section, tables/revisions.csv) and in the README's headline block.
    readme = tmp_path / "README.md"
    readme.write_text("<!-- report:start -->\n<!-- report:end -->\n")
    (tmp_path / "results").mkdir()
    results_readme = tmp_path / "results" / "README.md"
    results_readme.write_text("".join(f"<!-- {b}:start -->\n<!-- {b}:end -->\n" for b in
                                      ("references", "revisions")))
    out = make_report(tmp_path, tmp_path / "out", tags=("grid",), readme=readme)
    html = out["html"].read_text()
    assert 'id="revisions"' in html and "1.40M tokens" in html
    assert 'id="claims"' in html and 'id="goals"' not in html  # the papers' claims, not the project's goals
    assert (tmp_path / "out" / "tables" / "revisions.csv").read_text().count("\n") == 3
    # README.md: the headline, each method's first revision beside its newest; the rest in results/README.md.
    headline = next(line for line in readme.read_text().splitlines() if line.startswith("| pld |"))
    assert headline.endswith("| 3.00, 4.00x (grid) |") and "Before and after" not in readme.read_text()
    assert "| pld | grid.r2 |" in results_readme.read_text() and "| pld | grid.r2 |" not in readme.read_text()
    # python -m bench.report.summary reads each method's newest revision, against that revision's baseline.
    from bench.report.summary import summary_rows

    rows = {(r["task"], r["method"]): r for r in summary_rows(tmp_path, TARGET, "grid")}
    assert rows[("gsm8k", "pld")]["speedup"] == pytest.approx(2.0) and rows[("gsm8k", "pld")]["turns"] == 1
    assert rows[("mtbench", "pld")]["speedup"] == pytest.approx(2.0)  # still revision 1, its own baseline
    # Another method retrained later runs into grid.r3 with a new baseline revision: pld's
    # grid.r2 row keeps the baseline it ran beside (it lost it once: "no baseline").
    write_run(tmp_path, "gsm8k", "ar", "grid.r3", [turn("1", ttft=0.2, decode=2.8)])
    write_run(tmp_path, "gsm8k", "sps", "grid", [turn("1", decode=1.8)])
    write_run(tmp_path, "gsm8k", "sps", "grid.r3", [turn("1", decode=0.9)], drafter={"sha": "x"})
    later = revisions_table(load_records(tmp_path, tags=("grid",)), "overall")
    assert list(zip(later.method, later.records)) == [("pld", "grid"), ("pld", "grid.r2"), ("sps", "grid"),
                                                      ("sps", "grid.r3")]
    assert list(later.speedup) == pytest.approx([4.0, 2.0, 2.0 / 1.9, 3.0])  # AR 2.0 s per turn, sps 1.9


def test_table_writers(tmp_path):
    write_clean(tmp_path)
    tables = build_tables(load_records(tmp_path))
    markdown = to_markdown(display_table(tables.overall))
    assert markdown.splitlines()[0].startswith("| method | turns | τ | speedup [95% CI]")
    assert "| pld | 5 | 3.00 | 2.40x [" in markdown and "| ar | 5 | 1.00 | 1 (baseline)" in markdown
    latex = to_latex(display_table(tables.per_category), "per_category 100%")
    assert r"$\tau$" in latex and r"100\%" in latex and r"per\_category" in latex and "writing" in latex
    written = write_tables(tables, tmp_path / "out", load_records(tmp_path))
    assert sorted(p.name for p in written)[:3] == ["overall.csv", "overall.md", "overall.tex"]
    turns = (tmp_path / "out" / "tables" / "turns.csv").read_text().splitlines()
    assert len(turns) == 1 + 10 and f"{TARGET},gsm8k,t,pld,1,1,math,1,10," in "\n".join(turns)
    csv = (tmp_path / "out" / "tables" / "overall.csv").read_text().splitlines()
    assert "speedup_ci_low" in csv[0] and "accept_cond" in csv[0]
    assert any(line.startswith(f"{TARGET},t,pld,") and ",2.4," in line for line in csv)


def test_readme_markers(tmp_path):
    text = "a\n<!-- report:start -->\nold\n<!-- report:end -->\n<!-- s2:start -->\nkeep\n<!-- s2:end -->\n"
    assert replace_between_markers(text, "report", "new") == text.replace("old", "new")
    with pytest.raises(BenchError, match="report:start"):
        replace_between_markers("no markers", "report", "x")
    readme = tmp_path / "README.md"
    readme.write_text(text)
    update_readme(readme, {"report": "| t |"})
    assert "| t |" in readme.read_text() and "keep" in readme.read_text()
    other = tmp_path / "other.md"  # a file without the marker: neither file is written
    other.write_text("no markers\n")
    with pytest.raises(BenchError, match="other.md: .*grid:start"):
        update_readmes({readme: {"report": "| u |"}, other: {"grid": "| g |"}})
    assert "| t |" in readme.read_text() and other.read_text() == "no markers\n"


def test_figures_profile_and_gpu(tmp_path):
    gpu = {"kind": "gpu", "util_mean": 55.0, "memory_max_mib": 10.0, "series": [[0.0, 40.0], [0.2, 70.0]]}
    write_clean(tmp_path, util=gpu)
    records = load_records(tmp_path)
    figures = {f.name: f for f in make_figures(records, build_tables(records), tmp_path / "out")}
    assert isinstance(figures["profile"], Skipped) and isinstance(figures["gpu_util"], Figured)
    assert "GPU util" in display_table(build_tables(records).overall).columns
    for name in ("speedup", "acceptance", "accept_hist", "tau_budget", "speedup_tau", "gpu_util"):
        figure = figures[name]
        assert isinstance(figure, Figured), (name, getattr(figure, "reason", ""))
        assert figure.svg.read_text().lstrip().startswith("<?xml")
        pixels = np.asarray(Image.open(figure.png).convert("L"), dtype=float)
        assert pixels.std() > 5, name  # not a blank canvas
    write_profile(tmp_path)
    records = load_records(tmp_path)
    assert "missing" not in kinds(records)
    drawn = {f.name: f for f in make_figures(records, build_tables(records), tmp_path / "out")}
    assert isinstance(drawn["profile"], Figured)


def test_only_profiles_are_read_as_profiles(tmp_path):
    """The profile folder also keeps scripts' A/B records (kernels-ab-, train-ab-, ...): they are
    not hardware profiles and are not reported as damaged ones; a damaged profile is."""
    write_run(tmp_path, "mtbench", "ar", "t", [turn("1")])
    folder = write_profile(tmp_path).parent
    (folder / "train-ab-sps-abc1234-test-cpu.json").write_text(json.dumps({"what": "an A/B record"}))
    (folder / "cpu-bfloat16-test-cpu-t2.json").write_text("{not json")
    records = load_records(tmp_path)
    assert len(records.profiles) == 1
    in_folder = [(p.kind, Path(p.where).name) for p in records.problems if Path(p.where).parent == folder]
    assert in_folder == [("corrupt", "cpu-bfloat16-test-cpu-t2.json")]


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images, self.headings, self.tables, self.external = [], [], 0, []
        self._heading = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tables += tag == "table"
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        for key in ("src", "href"):
            if re.match(r"^(https?:)?//", attrs.get(key) or ""):
                self.external.append(attrs[key])
        if tag in ("script", "link", "iframe"):
            self.external.append(tag)
        if tag in ("h1", "h2"):
            self._heading = ""

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data

    def handle_endtag(self, tag):
        if tag in ("h1", "h2") and self._heading is not None:
            self.headings.append(self._heading.strip())
            self._heading = None


def test_bench_report_command_writes_a_self_contained_report(tmp_path, monkeypatch):
    results, out = tmp_path / "results", tmp_path / "plots"
    write_clean(results)
    write_profile(results)
    (tmp_path / "README.md").write_text("<!-- report:start -->\n<!-- report:end -->\n")
    (results / "README.md").write_text("<!-- references:start -->\n<!-- references:end -->\n")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["report", "--results", str(results), "--out", str(out), "--readme"])
    assert result.exit_code == 0, result.output
    assert "| pld | 5 | 3.00 | 2.40x" in result.stdout
    readme, results_readme = (tmp_path / "README.md").read_text(), (results / "README.md").read_text()
    assert "| pld | 5 | 3.00 | 2.40x" in readme and "reported by the papers" not in readme.lower()
    assert "reported by the papers" in results_readme.lower() and "| pld | 5 |" not in results_readme
    assert {p.name for p in (out / "figures").iterdir()} >= {"speedup.png", "speedup.svg", "profile.svg"}
    page = (out / "report.html").read_text(encoding="utf-8")
    parsed = _Images()
    parsed.feed(page)
    assert parsed.external == [] and "url(" not in page  # readable offline from the one file
    assert parsed.tables >= 6
    assert {"Overall (all selected tasks pooled)", "Figures", "Missing and partial records",
            "Reported by the papers (not measured here)", "Runs and provenance"} <= set(parsed.headings)
    assert len(parsed.images) == 6  # all but the GPU plot: these are CPU records
    for src in parsed.images:
        assert src.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        assert image.size[0] > 200 and np.asarray(image.convert("L"), dtype=float).std() > 5
    assert "not measured: no GPU runs" in page and "abc123" in page  # skipped figure and provenance shown
    assert "EAGLE-3" in page and "Spec-Bench leaderboard" in page


def test_bench_report_bad_input_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["report", "--results", str(tmp_path / "none")])
    assert result.exit_code == 2 and result.stderr.startswith("error: results folder not found")
    assert len(result.stderr.splitlines()) == 1


def test_reference_numbers_cite_a_source():
    from bench.report.html import load_references

    rows = load_references()
    methods_readme = Path(__file__).resolve().parent.parent / "methods" / "README.md"
    anchors = {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
               for line in methods_readme.read_text(encoding="utf-8").splitlines() if line.startswith("#")}
    assert rows and all(r["source"] and r["ref"].startswith("methods/README.md#") for r in rows)
    assert {r["ref"].split("#", 1)[1] for r in rows} <= anchors  # each cites a section that exists
    assert all(r["tau"] or r["speedup"] for r in rows)
    assert {"sps", "pld", "lookahead", "medusa", "eagle2", "eagle3"} <= {r["method"] for r in rows}


# ---------------------------------------------------------------- the grid (no model: fakes)


class _FakeTarget:
    name, fingerprint = TARGET, "fp"
    engine = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture
def fake_bench(monkeypatch):
    """The grid's code path with the model parts replaced: a fake target and decoders, and a
    `run` that writes one turn record per planned turn (as bench run does)."""
    import bench.core.target
    import bench.registry as registry
    import bench.run
    from bench.records import RunFile, records_path
    from tasks import load_task, task_name

    calls = []

    def build_decoder(name, target, options=None):
        if name == "eagle3":
            raise BenchError("no eagle3 drafter for target 'tiny'")
        return SimpleNamespace(lossless=True)

    def fake_run(settings):
        calls.append(settings.records_tag)
        questions = load_task(settings.task, settings.data_dir, settings.limit, (), settings.per_category)
        for method in (settings.method, "ar"):
            path = records_path(settings.results_dir, TARGET, task_name(settings.task), method, settings.records_tag)
            recorded = bench.run.record_settings(settings, method, _FakeTarget, build_decoder(method, None))
            records = RunFile(path, recorded, "cpu")
            for q in questions:
                for number in range(1, len(q.turns) + 1):
                    if records.done(q.question_id, number) is None:
                        records.add_turn({k: v for k, v in turn(q.question_id, number).items() if k != "type"})
        return {}

    monkeypatch.setattr(bench.core.target, "load_target", lambda *a, **k: _FakeTarget)
    monkeypatch.setattr(registry, "build_decoder", build_decoder)
    monkeypatch.setattr(bench.run, "run", fake_run)
    return calls


def test_grid_is_idempotent_and_never_overwrites(tmp_path, tiny_task, fake_bench):
    from bench.grid import run_grid
    from tasks import task_name

    results = tmp_path / "results"
    plan = {str(tiny_task): {}}

    def grid(tokens: int, repeats: int = 1) -> dict:
        cells = run_grid(plan, ["pld", "eagle3"], "grid", str(results), tokens, echo=lambda line: None,
                         repeats=repeats)
        return {(c.method, c.repeat) if repeats > 1 else c.method: c for c in cells}

    first = grid(8)
    assert first["pld"].status == "ran" and first["pld"].turns == first["pld"].expected_turns == 3
    assert first["eagle3"].status.startswith("not run: no eagle3 drafter")
    assert first["ar"].status == "baseline" and fake_bench == ["grid"]
    folder = results / TARGET / task_name(str(tiny_task))  # tiny-<content hash>
    pld_file = folder / "pld-grid.jsonl"
    before = pld_file.read_bytes()
    assert grid(8)["pld"].status == "up to date (skipped)" and fake_bench == ["grid"]
    # Other settings: a fresh revision, the finished records untouched.
    changed = grid(9)
    assert changed["pld"].status == "ran" and changed["pld"].records == "grid.r2" and fake_bench[-1] == "grid.r2"
    assert pld_file.read_bytes() == before
    # An interrupted revision resumes in place.
    r2 = folder / "pld-grid.r2.jsonl"
    r2.write_text("".join(r2.read_text().splitlines(keepends=True)[:-1]))
    assert grid(9)["pld"].status == "ran" and fake_bench[-1] == "grid.r2"
    manifest = json.loads((results / TARGET / "grid-grid.json").read_text())
    assert {c["method"]: c["status"] for c in manifest["cells"]}["eagle3"].startswith("not run")
    records = load_records(results, tags=("grid",))
    assert {r.tag for r in records.runs} == {"grid.r2"}
    assert "not run" in kinds(records) and "superseded" in kinds(records)
    # A second pass goes beside the first (same revision); pass 1 is skipped, not rerun.
    passes = grid(9, repeats=2)
    assert passes[("pld", 1)].status == "up to date (skipped)" and passes[("pld", 2)].status == "ran"
    assert passes[("pld", 2)].records == passes[("ar", 2)].records == fake_bench[-1] == "grid.r2.rep2"
    # --remeasure-contended: a file with a turn that waited for the CPU is set aside (kept) and run again.
    lines = r2.read_text().splitlines(keepends=True)
    slow = json.loads(lines[-1])
    slow["utilization"]["util_mean"] = 20.0
    r2.write_text("".join(lines[:-1]) + json.dumps(slow) + "\n")
    assert "contended" in kinds(load_records(results, tags=("grid",)))
    cells = run_grid(plan, ["pld"], "grid", str(results), 9, echo=lambda line: None, remeasure_contended=True)
    assert [c.status for c in cells if c.method == "pld"] == ["ran"] and fake_bench[-1] == "grid.r2"
    assert (folder / "pld-grid.r2.jsonl.contended").read_text().endswith(json.dumps(slow) + "\n")
    assert "contended" not in kinds(load_records(results, tags=("grid",)))
    records = load_records(results, tags=("grid",))
    assert sorted((r.method, r.repeat) for r in records.runs) == [("ar", 1), ("ar", 2), ("pld", 1), ("pld", 2)]
    assert "partial" not in kinds(records) and "no baseline" not in kinds(records)
    cells = json.loads((results / TARGET / "grid-grid.json").read_text())["cells"]
    assert sorted((c["method"], c["repeat"]) for c in cells) == [("ar", 1), ("ar", 2), ("eagle3", 1), ("eagle3", 2),
                                                                 ("pld", 1), ("pld", 2)]
    # --remeasure-stale: records begun long after the tag's shared baseline are set aside and run again.
    lines = r2.read_text().splitlines(keepends=True)
    head = json.loads(lines[0])
    head["provenance"]["started_at"] = "2099-01-01T00:00:00Z"
    r2.write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    assert "not interleaved" in kinds(load_records(results, tags=("grid",)))
    cells = run_grid(plan, ["pld"], "grid", str(results), 9, echo=lambda line: None, remeasure_stale=True)
    assert [c.status for c in cells if c.method == "pld"] == ["ran"] and fake_bench[-1] == "grid.r2"
    assert json.loads((folder / "pld-grid.r2.jsonl.stale").read_text().splitlines()[0]) == head
    assert "not interleaved" not in kinds(load_records(results, tags=("grid",)))
    cells = run_grid(plan, ["pld"], "grid", str(results), 9, echo=lambda line: None, remeasure_stale=True)
    assert [c.status for c in cells if c.method == "pld"] == ["up to date (skipped)"]
    # A later invocation under the tag with one method at its own options keeps the others'.
    run_grid(plan, ["pld"], "grid", str(results), 9, echo=lambda line: None, method_options={"num_pred_tokens": 3})
    manifest = json.loads((results / TARGET / "grid-grid.json").read_text())
    assert manifest["methods"] == ["eagle3", "pld"] and manifest["options"] == {"num_pred_tokens": 3}
    assert manifest["method_options"] == {"pld": {"num_pred_tokens": 3}, "eagle3": {}}


def test_grid_methods_come_from_the_registry():
    import bench.registry as registry
    from bench.grid import grid_methods

    chosen = grid_methods()
    assert "ar" not in chosen and "hf" not in chosen and "pld" in chosen and "eagle3" in chosen
    assert all(registry.METHODS[m].lossless for m in chosen)


def test_summary_table_into_readme(tmp_path):
    """`python -m bench.report.summary --readme NAME` writes the per-task table between the markers:
    pld on MT-bench has τ 3 and speedup 2 (write_clean), GSM8K speedup 4."""
    from bench.report.summary import main as summary_main
    write_clean(tmp_path / "results", tag="g")
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- grid:start -->\nold\n<!-- grid:end -->\ny\n")
    args = ["--results-dir", str(tmp_path / "results"), "--target", TARGET, "--tag", "g", "--readme", "grid",
            "--readme-path", str(readme)]
    result = CliRunner().invoke(summary_main, args)
    assert result.exit_code == 0, result.output
    text = readme.read_text()
    assert "old" not in text and text.startswith("x\n<!-- grid:start -->\n| task | method |") and text.endswith("y\n")
    mtbench = next(line for line in text.splitlines() if line.startswith("| mtbench | pld |"))
    assert "| 4 | 3.00 |" in mtbench and "| 2.00x [" in mtbench
    assert "| gsm8k | pld | 1 | 3.00 |" in text and "| 4.00x [" in text
    missing = CliRunner().invoke(summary_main, args[:4] + ["--tag", "nope", "--readme", "grid",
                                                           "--readme-path", str(readme)])
    assert missing.exit_code != 0 and "no records" in missing.output and readme.read_text() == text
    only = CliRunner().invoke(summary_main, args[:6] + ["--method", "pld", "--task", "gsm8k"])
    assert only.exit_code == 0 and "| gsm8k | pld |" in only.output and "| mtbench |" not in only.output
    none = CliRunner().invoke(summary_main, args[:6] + ["--method", "eagle"])
    assert none.exit_code != 0 and "no records" in none.output


def test_summary_names_cells_timed_at_other_thread_counts(tmp_path):
    """A series whose cells ran at different torch thread counts says which ran at which (a
    pooled row would compare them); one thread count throughout adds no line."""
    from bench.report.summary import format_table, summary_rows
    results = tmp_path / "results"
    write_clean(results, tag="g")
    rows = summary_rows(results, TARGET, "g")
    assert {row["threads"] for row in rows} == {"1"} and "thread counts" not in format_table(rows)
    for method in ("ar", "pld"):  # GSM8K's cell, method and baseline, timed at 2 threads
        path = results / TARGET / "gsm8k" / f"{method}-g.jsonl"
        lines = path.read_text().splitlines(keepends=True)
        head = json.loads(lines[0])
        head["provenance"]["torch_threads"] = 2
        path.write_text(json.dumps(head) + "\n" + "".join(lines[1:]))
    table = format_table(summary_rows(results, TARGET, "g"))
    assert table.splitlines()[-1] == ("Cells ran at different torch thread counts (each speedup is against the AR "
                                      "timed beside it): 1 thread(s): mtbench pld; 2 thread(s): gsm8k pld.")


def test_repeats_pool_and_pair_within_their_pass(tmp_path):
    """Pass 1 (tag t): AR 1.0 s per turn, pld 0.5 s: speedup 2. Pass 2 (t.rep2): AR 2.0 s,
    pld 0.5 s: speedup 4. Pooled: (4 x 1.0 + 4 x 2.0) / (8 x 0.5) = 3; paired across passes it
    would not be."""
    keys = [("1", 1), ("1", 2), ("2", 1), ("2", 2)]
    for tag, ar_decode in (("t", 0.9), ("t.rep2", 1.9)):
        write_run(tmp_path, "mtbench", "ar", tag, [turn(q, n, decode=ar_decode) for q, n in keys])
        write_run(tmp_path, "mtbench", "pld", tag, [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True,
                                                         **PLD_ROUNDS) for q, n in keys])
    records = load_records(tmp_path, tags=("t",))
    assert sorted((r.method, r.repeat) for r in records.runs) == [("ar", 1), ("ar", 2), ("pld", 1), ("pld", 2)]
    assert not [p for p in records.problems if p.kind != "missing"]  # only the hardware profile is missing
    pld = row(summarize(records, "task"), method="pld")
    assert pld["turns"] == 8 and pld["repeats"] == 2 and pld["tau"] == pytest.approx(3.0)
    assert pld["speedup"] == pytest.approx(3.0) and pld["speedup_repeats"] == pytest.approx([2.0, 4.0])
    shown = to_markdown(display_table(summarize(records, "overall")))
    assert "| 3.00x [2.00, 4.00] (2 passes) |" in shown and "speedup over repeats" in shown.splitlines()[0]
    from bench.report.summary import format_table, summary_rows
    (summary_row,) = summary_rows(tmp_path, TARGET, "t")  # python -m bench.report.summary pools the passes too
    assert summary_row["speedup"] == pytest.approx(3.0) and summary_row["speedup_repeats"] == pytest.approx([2.0, 4.0])
    assert format_table([summary_row]).endswith("| 3.00x [2.00, 4.00] (2 passes) |")
    from bench.report.build import readme_blocks
    assert "Sample sizes (AR turns per task): mtbench: 4 turns x 2 passes." in readme_blocks(
        build_tables(records), records, "bench report")["report"]
    # A pass without its own baseline is reported, not paired with another pass's baseline.
    (tmp_path / TARGET / "mtbench" / "ar-t.rep2.jsonl").unlink()
    records = load_records(tmp_path, tags=("t",))
    assert any(p.kind == "no baseline" and p.where.endswith("pld-t.rep2.jsonl") for p in records.problems)
    assert row(summarize(records, "task"), method="pld")["speedup"] == pytest.approx(2.0)


def test_turns_that_shared_the_cores_are_reported(tmp_path):
    """Process CPU 50% per turn is one busy core of two; a turn at 30% waited for the CPU."""
    keys = [("1", 1), ("2", 1), ("3", 1)]
    write_run(tmp_path, "mtbench", "ar", "t", [turn(q, n) for q, n in keys])
    utils = [{"kind": "cpu", "util_mean": u} for u in (50.0, 30.0, 49.0)]
    write_run(tmp_path, "mtbench", "pld", "t", [turn(q, n, exact=True, util=u) for (q, n), u in zip(keys, utils)])
    (problem,) = [p for p in load_records(tmp_path).problems if p.kind == "contended"]
    assert problem.where.endswith("pld-t.jsonl") and problem.detail.startswith("1 of 3 turns")
    assert "(2/1)" in problem.detail
    # Newer records say their threads and cpus: 2 threads on 2 cpus should get ~100%.
    utils = [{"kind": "cpu", "util_mean": u, "threads": 2, "cpus": 2} for u in (60.0, 61.0, 95.0)]
    write_run(tmp_path, "mtbench", "pld", "t", [turn(q, n, exact=True, util=u) for (q, n), u in zip(keys, utils)])
    (problem,) = [p for p in load_records(tmp_path).problems if p.kind == "contended"]
    assert problem.detail.startswith("2 of 3 turns") and "(1/1, 2/1)" in problem.detail
    write_run(tmp_path, "mtbench", "pld", "t", [turn(q, n, exact=True) for q, n in keys])
    assert "contended" not in kinds(load_records(tmp_path))


def test_scaling_figure_from_drafters_kept_at_several_sizes(tmp_path):
    """τ against the tokens each run's drafter was trained on: drawn once a method has runs
    with drafters of two or more training sizes (their records carry drafter.trained_tokens)."""
    write_clean(tmp_path)
    records = load_records(tmp_path)
    figures = {f.name: f for f in make_figures(records, build_tables(records), tmp_path / "out")}
    assert isinstance(figures["scaling"], Skipped) and "--keep-at" in figures["scaling"].reason
    keys = [("1", 1), ("1", 2), ("2", 1), ("2", 2)]
    for tag, tokens, accepted in (("k200", 200_000, (1, 1, 1)), ("k1m", 1_000_000, (3, 2, 1))):
        drafter = {"drafter": f"out/kept/{tokens}-tokens", "trained_tokens": tokens}
        write_run(tmp_path, "mtbench", "ar", tag, [turn(q, n) for q, n in keys])
        write_run(tmp_path, "mtbench", "pld", tag, [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True,
                                                         proposed=(3, 3, 3), accepted=accepted) for q, n in keys],
                  drafter=drafter)
    # A drafter of another training run: its own size, not a point of this run's line.
    write_run(tmp_path, "mtbench", "ar", "other", [turn(q, n) for q, n in keys])
    write_run(tmp_path, "mtbench", "pld", "other", [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True,
                                                       proposed=(3, 3, 3), accepted=(3, 3, 3)) for q, n in keys],
              drafter={"drafter": "methods/checkpoints/x/pld", "trained_tokens": 500_000})
    records = load_records(tmp_path)
    tables = build_tables(records)
    rows = tables.per_task[tables.per_task["trained_tokens"].notna() & tables.per_task["drafter_run"].eq("out")]
    assert sorted(rows["trained_tokens"]) == [200_000, 1_000_000]
    figure = {f.name: f for f in make_figures(records, tables, tmp_path / "out")}["scaling"]
    assert isinstance(figure, Figured), getattr(figure, "reason", "")
    pixels = np.asarray(Image.open(figure.png).convert("L"), dtype=float)
    assert pixels.std() > 5
    assert "per tenfold data" in figure.caption
    assert list(pd.read_csv(figure.png.parent / "scaling_fit.csv")["sizes"]) == [2]


def test_two_training_runs_in_one_folder_keep_their_own_scaling_tags_and_lines(tmp_path):
    """scripts/scaling_runs names a kept copy's tag by its training run: a later run into the same
    folder whose copies saw the same token counts gets other tags (a tag's records hold one
    drafter), and the tables tell the two runs apart, so neither line mixes in the other's points."""
    from bench.records import scaling_run, scaling_tag
    from scripts.scaling_runs import training_run

    def manifest(pool, steps):
        return {"method": "pld", "training": {"max_steps": 4632, "batch_size": 4, "lr": 6e-4, "seed": 0,
                                              "settings": {"ttt_steps": 7}, "feature_tokens": pool, "steps": steps}}

    first, later = training_run(manifest(1_300_229, 200)), training_run(manifest(4_373_615, 200))
    assert training_run(manifest(1_300_229, 4632)) == first != later  # a run's copies share it
    # An option added while the run trained (EAGLE-3's taps), recorded at its default only in the
    # manifests exported after it existed, leaves the run's id alone; set, it is another run.
    exported_later = manifest(1_300_229, 4632)
    exported_later["training"]["settings"]["taps"] = ""
    assert training_run(exported_later) == first
    exported_later["training"]["settings"]["taps"] = "2,15,30"
    assert training_run(exported_later) != first
    assert scaling_run(scaling_tag(201_036, first)) == first and scaling_run("scale-201036") is None
    keys = [("1", 1), ("1", 2)]
    for run, accepted in ((first, (1, 1, 1)), (later, (3, 2, 1))):
        for tokens in (200_000, 1_000_000):
            tag = scaling_tag(tokens, run)
            write_run(tmp_path, "mtbench", "ar", tag, [turn(q, n) for q, n in keys])
            write_run(tmp_path, "mtbench", "pld", tag,
                      [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True, proposed=(3, 3, 3),
                            accepted=accepted) for q, n in keys],
                      drafter={"drafter": f"out/kept/{tokens}-tokens", "trained_tokens": tokens})
    per_task = build_tables(load_records(tmp_path)).per_task
    runs = per_task[per_task["trained_tokens"].notna()].groupby("drafter_run")["trained_tokens"].apply(sorted)
    assert runs.to_dict() == {first: [200_000, 1_000_000], later: [200_000, 1_000_000]}
    # The run's final drafter, shipped into another folder, is a point of the same line.
    tag = scaling_tag(6_000_000, later)
    write_run(tmp_path, "mtbench", "ar", tag, [turn(q, n) for q, n in keys])
    write_run(tmp_path, "mtbench", "pld", tag, [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True,
                                                     proposed=(3, 3, 3), accepted=(3, 3, 3)) for q, n in keys],
              drafter={"drafter": "methods/checkpoints/x/pld", "trained_tokens": 6_000_000})
    from bench.report.scaling import scaling_fit, scaling_rows

    fit = scaling_fit(scaling_rows(build_tables(load_records(tmp_path)).per_task)).set_index("run")
    assert fit.loc[later, "sizes"] == 3 and fit.loc[first, "sizes"] == 2  # a line per run, not one mixed
    # A method whose records do not carry the count (MTP's, Medusa's) is placed by its tag's.
    tag = scaling_tag(3_000_000, later)
    write_run(tmp_path, "mtbench", "ar", tag, [turn(q, n) for q, n in keys])
    write_run(tmp_path, "mtbench", "pld", tag, [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True,
                                                     proposed=(3, 3, 3), accepted=(2, 2, 2)) for q, n in keys],
              drafter={"drafter": "out"})
    fit = scaling_fit(scaling_rows(build_tables(load_records(tmp_path)).per_task)).set_index("run")
    assert fit.loc[later, "sizes"] == 4


def test_scaling_fit_is_the_log_linear_line():
    """τ = 1 + 0.5 log10(tokens / 1e5) for eagle3 on MT-bench: +0.5 per tenfold data; a flat
    line rises 0; the largest size's τ is quoted."""
    import pandas as pd

    from bench.report.scaling import scaling_fit

    rows = pd.DataFrame([{"method": "eagle3", "task": "mtbench", "trained_tokens": t,
                          "tau": 1 + 0.5 * math.log10(t / 1e5)} for t in (2e5, 1e6, 5e6)]
                        + [{"method": "mtp", "task": "gsm8k", "trained_tokens": t, "tau": 1.3} for t in (2e5, 1e6)]
                        + [{"method": "medusa", "task": "gsm8k", "trained_tokens": 2e5, "tau": 1.5}])
    fit = scaling_fit(rows).set_index("method")
    assert fit.loc["eagle3", "tau_per_10x"] == pytest.approx(0.5) and fit.loc["eagle3", "largest_tokens"] == 5e6
    assert fit.loc["mtp", "tau_per_10x"] == pytest.approx(0.0) and "medusa" not in fit.index  # one size: no line

def test_a_shipped_copy_is_the_drafter_its_training_folder_ran():
    """`bench ship` adds keys to the manifest it copies, so a shipped drafter's manifest digest
    differs from its training folder's: the tables tell drafters apart by their export instead."""
    from bench.report.tables import _drafter_id

    trained = {"manifest_sha": "aaa", "exported_at": "2026-12-05T17:59:11Z", "trained_tokens": 6344208}
    assert _drafter_id({**trained, "manifest_sha": "bbb"}) == _drafter_id(trained)
    assert _drafter_id({**trained, "trained_tokens": 1000176}) != _drafter_id(trained)
    assert _drafter_id({**trained, "weights_sha1": "ccc"}) == "ccc"
    assert _drafter_id({"manifest_sha": "aaa"}) == "aaa"  # a published drafter: no export stamp


def test_sampled_grid_series_records_its_temperature(tmp_path, tiny_task, fake_bench, monkeypatch):
    """`python -m bench.grid --temperature 1`: its own series (tag grid-t1), every cell's
    settings sampled at T = 1, the temperature in the manifest; the greedy series untouched."""
    from click.testing import CliRunner

    import bench.grid
    import tasks

    load_task = tasks.load_task
    monkeypatch.setattr(bench.grid, "DEFAULT_PLAN", {"mtbench": {}})
    monkeypatch.setattr(tasks, "load_task", lambda task, *a, **k: load_task(str(tiny_task), *a, **k))
    results = tmp_path / "results"
    result = CliRunner().invoke(bench.grid.main, ["--method", "pld", "--max-new-tokens", "8", "--results-dir",
                                                  str(results), "--temperature", "1"])
    assert result.exit_code == 0, result.output
    assert fake_bench == ["grid-t1"]
    manifest = json.loads((results / TARGET / "grid-grid-t1.json").read_text())
    assert manifest["temperature"] == 1.0 and not (results / TARGET / "grid-grid.json").exists()
    [pld] = list(results.rglob("pld-grid-t1.jsonl"))
    assert json.loads(pld.read_text().splitlines()[0])["settings"]["sampling"]["temperature"] == 1.0


def test_drafters_table_shows_how_each_shipped_drafter_was_trained(tmp_path, monkeypatch):
    """The README's drafters block: a shipped drafter's data, tokens, time from its manifest,
    and the command and machine `bench train` records; older manifests say 'not recorded'."""
    import bench.core.drafters as drafters
    from bench.core.drafters import record_training_run, write_drafter
    from bench.report.build import drafters_table

    monkeypatch.setattr(drafters, "SHIPPED_ROOTS", [tmp_path])
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    for method, elapsed in (("eagle3", 5400), ("medusa", 110)):  # a GPU run can take minutes
        write_drafter(tmp_path / "tiny" / method, {"w": torch.zeros(2)},
                      {"method": method, "training": {"tokens_seen": 1_250_000, "epochs": 1.5, "steps": 900,
                                                      "elapsed_s": elapsed, "data": "distilled",
                                                      "feature_tokens": 1.3e6}})
    record_training_run(tmp_path / "tiny" / "eagle3", "bench train --method eagle3 --epochs 1.5", "cpu")
    table = drafters_table()
    eagle3 = next(line for line in table.splitlines() if "| eagle3 |" in line)
    assert "1.25M" in eagle3 and "1.5 h" in eagle3 and "`bench train --method eagle3 --epochs 1.5`" in eagle3
    assert " thread" in eagle3 and "1.30M-token pool" in eagle3
    medusa = next(line for line in table.splitlines() if "| medusa |" in line)
    assert medusa.count("not recorded") == 2 and "| 2 min |" in medusa


def test_scaling_runs_find_the_kept_drafters_by_their_tokens(tmp_path):
    """scripts/scaling_runs: a training folder's kept copies and its final drafter, ordered by
    the tokens their manifests record; folders without a manifest or a count are left out."""
    from bench.core.drafters import write_drafter
    from scripts.scaling_runs import kept_drafters

    for folder, tokens in (("kept/200000-tokens", 200_311), ("kept/1000000-tokens", 1_000_907), (".", 1_430_000),
                           ("kept/5-tokens", None)):
        write_drafter(tmp_path / folder, {"w": torch.zeros(1)}, {"training": {"tokens_seen": tokens}})
    (tmp_path / "kept" / "9-tokens").mkdir()
    assert kept_drafters(tmp_path) == [(200_311, tmp_path / "kept/200000-tokens"),
                                       (1_000_907, tmp_path / "kept/1000000-tokens"), (1_430_000, tmp_path)]
    # Still training, the folder's last export is the kept copy's: the kept copy is named.
    write_drafter(tmp_path, {"w": torch.zeros(1)}, {"training": {"tokens_seen": 1_000_907}})
    assert kept_drafters(tmp_path)[-1] == (1_000_907, tmp_path / "kept/1000000-tokens")


def test_a_method_recorded_long_after_its_shared_baseline_is_reported(tmp_path):
    """The grid shares a tag's AR baseline among its cells; a cell run an hour later (a
    retrained drafter) compares the machine at two moments, and the report says so."""
    write_clean(tmp_path, tag="grid")
    path = tmp_path / TARGET / "gsm8k" / "pld-grid.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["provenance"]["started_at"] = "2026-01-01T01:10:00Z"  # 70 min after the baseline's 00:00
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    found = [p for p in load_records(tmp_path).problems if p.kind == "not interleaved"]
    assert [Path(p.where).name for p in found] == ["pld-grid.jsonl"]
    assert "began 70 min after its AR baseline ar-grid.jsonl" in found[0].detail


def test_a_late_method_whose_turns_carry_their_own_baseline_is_paired_with_it(tmp_path):
    """A method recorded long after the tag's baseline, whose turns carry the baseline decoded
    again right before each (bench.run: paired_baseline), is paired with those: no "not
    interleaved", and the speedup is its own moment's. A re-timed baseline that decoded
    other tokens than the recorded one is reported."""
    write_clean(tmp_path, tag="grid")
    path = tmp_path / TARGET / "gsm8k" / "pld-grid.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["provenance"]["started_at"] = "2026-01-01T01:10:00Z"
    (pld,) = [json.loads(line) for line in lines[1:]]
    ar = turn("1", category="math", ttft=0.1, decode=0.9)  # AR re-timed now: 1.0 s (the recorded one: 2.0 s)
    pld["paired_baseline"] = {k: ar[k] for k in ("ttft", "decode_time", "draft_time", "verify_time", "tokens",
                                                 "proposed_lengths", "accept_lengths", "tree_sizes", "utilization")}
    pld["paired_baseline"]["same_tokens"] = True
    path.write_text("\n".join([json.dumps(first), json.dumps(pld)]) + "\n")
    records = load_records(tmp_path)
    assert "not interleaved" not in kinds(records) and "baseline not reproduced" not in kinds(records)
    run = next(r for r in records.runs if r.method == "pld" and r.task == "gsm8k")
    base = next(r for r in records.runs if r.method == "ar" and r.task == "gsm8k")
    assert metrics.speedup(run.pooled, base.pooled) == pytest.approx(2.0)  # 1.0 s / 0.5 s, not 2.0 s / 0.5 s
    shown = display_table(summarize(records)).set_index(["task", "method"])
    assert shown.loc[("gsm8k", "pld"), "AR tok/s beside it"] == "10.0"  # 10 tokens in the re-timed 1.0 s
    assert shown.loc[("gsm8k", "pld"), "speedup [95% CI]"].startswith("2.00x")

    pld["paired_baseline"]["same_tokens"] = False
    path.write_text("\n".join([json.dumps(first), json.dumps(pld)]) + "\n")
    (found,) = [p for p in load_records(tmp_path).problems if p.kind == "baseline not reproduced"]
    assert Path(found.where).name == "pld-grid.jsonl" and "1 of its turns" in found.detail

    pld["paired_baseline"].pop("ttft")  # damaged: the turn is left out and reported, never counted
    path.write_text("\n".join([json.dumps(first), json.dumps(pld)]) + "\n")
    records = load_records(tmp_path)
    assert not [r for r in records.runs if r.method == "pld" and r.task == "gsm8k"]


def test_the_profile_block_reads_every_figure_from_the_kept_records(tmp_path):
    from bench.report.build import profile_block

    write_clean(tmp_path)
    write_profile(tmp_path)
    block = profile_block(load_records(tmp_path).profiles)
    # write_profile: t_v(k) = 10 ms x (1 + k/8) for chains, (1 + k/6) for trees
    assert block.startswith("- `cpu-float32.json` (test cpu, float32") and "t_v(1) 11.25 ms" in block
    assert "t_v(k)/t_v(1) at k = 4 / 8 / 16: 1.33 / 1.78 / 2.67" in block
    assert "top-2 trees of 8 / 16 nodes: 2.07 / 3.26" in block
    assert "t_v(16)/t_v(1) >= 2.00 here" in block and "draft ms per round: pld 0.2" in block
    assert profile_block([]) == "No `bench profile` record."


def test_grid_options_reach_every_cell_and_are_checked_first(tmp_path, tiny_task, fake_bench):
    """`python -m bench.grid --option k=v`: every selected method runs with it (recorded in its
    settings); an option one of them does not take fails before anything runs."""
    from bench.grid import run_grid
    from bench.records import RunFile
    from tasks import task_name

    results = tmp_path / "results"
    cells = run_grid({str(tiny_task): {}}, ["pld"], "opt", str(results), 8, echo=lambda line: None,
                     method_options={"max_ngram": 2})
    assert [c.status for c in cells if c.method == "pld"] == ["ran"]
    run = RunFile(results / TARGET / task_name(str(tiny_task)) / "pld-opt.jsonl")
    assert run.settings["method_options"] == {"max_ngram": 2}
    with pytest.raises(BenchError, match="max_ngram"):
        run_grid({str(tiny_task): {}}, ["pld", "lookahead"], "opt2", str(results), 8, echo=lambda line: None,
                 method_options={"max_ngram": 2})
    assert fake_bench == ["opt"]


def test_training_curves_come_from_the_shipped_drafters_logs(tmp_path, monkeypatch):
    """The report's training figure: each shipped drafter's log (gzipped, as `bench ship` leaves
    it) gives tokens seen against position-0 agreement (acc0 before acc), its manifest the held-out
    star; a damaged log is a reported problem, not a crash; other targets' drafters stay out."""
    import gzip

    import methods  # noqa: F401  (its shipped root registered before the test's replaces it)
    from bench.core import drafters
    from bench.records import Problem
    from bench.report.build import shipped_training_logs
    from bench.report.plots import Figured, Skipped, training_curves

    def shipped(target, method, lines, heldout=None, manifest=None):
        folder = tmp_path / "shipped" / target / method
        folder.mkdir(parents=True)
        manifest = manifest or ({"heldout": {"top1_by_position": heldout}} if heldout else {})
        (folder / "drafter.json").write_text(json.dumps(manifest))
        (folder / "log.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
        return folder

    rows = [json.dumps({"step": s, "acc": 0.1, "acc0": 0.1 * s, "tokens_seen": 100 * s}) for s in range(1, 6)]
    shipped("tiny", "dflash", rows + ["{not json"], heldout=[0.4, 0.2])
    shipped("tiny", "medusa", [json.dumps({"step": 1, "acc": 0.3, "tokens_seen": 50}),
                               json.dumps({"step": 2, "acc": 0.5, "tokens_seen": 100})])
    shipped("other", "eagle", rows)
    shipped("tiny", "mtp", rows[:2], manifest={"training": {"heldout": {"top1_by_position": [0.35]}}})  # MTP's place
    broken = shipped("tiny", "sps", [])
    (broken / "log.jsonl.gz").write_bytes(b"not gzip")
    monkeypatch.setattr(drafters, "SHIPPED_ROOTS", [tmp_path / "shipped"])
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))

    problems: list[Problem] = []
    logs = {log["method"]: log for log in shipped_training_logs({"tiny"}, problems)}
    assert set(logs) == {"dflash", "medusa", "mtp"} and logs["mtp"]["heldout"] == 0.35
    assert logs["dflash"]["tokens"] == [100, 200, 300, 400, 500] and logs["dflash"]["heldout"] == 0.4
    assert logs["dflash"]["agreement"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert logs["medusa"]["agreement"] == [0.3, 0.5] and logs["medusa"]["heldout"] is None
    assert sorted(p.kind for p in problems) == ["damaged training log", "unreadable training log"]
    assert "1 unreadable line" in next(p.detail for p in problems if p.kind == "damaged training log")

    figure = training_curves(list(logs.values()), tmp_path / "figures")
    assert isinstance(figure, Figured) and figure.png.stat().st_size > 0
    assert isinstance(training_curves([], tmp_path / "figures"), Skipped)


def test_grid_skips_packed_cells_resumes_them_and_sets_them_aside(tmp_path, tiny_task, fake_bench):
    from bench.grid import run_grid
    from bench.records import pack, record_files
    from tasks import task_name

    results = tmp_path / "results"
    plan = {str(tiny_task): {}}
    folder = results / TARGET / task_name(str(tiny_task))

    def grid(**kw) -> dict:
        return {c.method: c for c in run_grid(plan, ["pld"], "grid", str(results), 8, echo=lambda line: None, **kw)}

    assert grid()["pld"].status == "ran"
    for file in record_files(folder):
        pack(file)
    assert grid()["pld"].status == "up to date (skipped)" and fake_bench == ["grid"]
    stored = {p.name for p in folder.iterdir() if not p.name.endswith(".lock")}
    assert stored == {"ar-grid.jsonl.gz", "pld-grid.jsonl.gz"}
    # An unfinished packed cell (a turn lost) is unpacked and completed in place.
    pld = folder / "pld-grid.jsonl"
    text = gzip.decompress((folder / "pld-grid.jsonl.gz").read_bytes()).decode()
    (folder / "pld-grid.jsonl.gz").write_bytes(gzip.compress("".join(text.splitlines(keepends=True)[:-1]).encode()))
    assert grid()["pld"].status == "ran" and fake_bench[-1] == "grid"
    assert pld.exists() and not (folder / "pld-grid.jsonl.gz").exists()
    # A packed file with a contended turn is set aside packed, and its cell runs again.
    lines = pld.read_text().splitlines(keepends=True)
    slow = json.loads(lines[-1])
    slow["utilization"]["util_mean"] = 20.0
    pld.write_text("".join(lines[:-1]) + json.dumps(slow) + "\n")
    pack(pld)
    assert grid(remeasure_contended=True)["pld"].status == "ran"
    aside = folder / "pld-grid.jsonl.gz.contended"
    assert gzip.decompress(aside.read_bytes()).decode().endswith(json.dumps(slow) + "\n")
    assert "contended" not in kinds(load_records(results, tags=("grid",)))


def test_the_report_reads_the_shelf_once_and_imports_no_method(tmp_path):
    """Records that carry their draft budget are reported without any method's code (a clean
    interpreter), and every record file is read once however many selections the report makes."""
    import subprocess
    import sys

    results = tmp_path / "results"
    for method, budget in (("ar", None), ("pld", 3)):
        write_run(results, "gsm8k", method, "t", [turn("1", decode=0.5 if budget else 1.0, **(
            PLD_ROUNDS if budget else {}))], draft_budget=budget)
    write_profile(results)
    script = ("import sys; from unittest import mock; from pathlib import Path\n"
              "import bench.report.tables as tables\n"
              "from bench.report.build import make_report\n"
              "reads = []\n"
              "real = tables.read_run\n"
              "def counted(path, problems): reads.append(path); return real(path, problems)\n"
              "with mock.patch.object(tables, 'read_run', counted):\n"
              f"    report = make_report(Path({str(results)!r}), Path({str(tmp_path / 'out')!r}), load_tags=('t',),"
              " tuned_tags=('t',))\n"
              "print(sorted(m for m in sys.modules if m.startswith('methods.')))\n"
              "print(len(reads), len(set(reads)))\n"
              "print(report['tables'].per_task.set_index('method').loc['pld', 'budget'])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "2 2"
    assert float(out[2]) == 3.0


def test_a_report_removes_its_own_tables_and_figures_an_earlier_report_wrote(tmp_path):
    """An earlier report's table this one does not write (no revisions now) goes; what is not the
    report's own (another report's folder beside it) stays."""
    from bench.report.build import make_report

    write_clean(tmp_path / "results", tag="grid")
    out = tmp_path / "plots"
    for stale in (out / "tables" / "revisions.csv", out / "figures" / "goals.png", out / "amx" / "report.html"):
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("from an earlier report")
    make_report(tmp_path / "results", out)
    assert not (out / "tables" / "revisions.csv").exists() and not (out / "figures" / "goals.png").exists()
    assert (out / "amx" / "report.html").read_text() == "from an earlier report"
    assert (out / "tables" / "overall.csv").exists()
