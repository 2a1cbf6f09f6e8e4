"""`bench tune` and `--budget auto` (bench.tune): the tuning prompts are held back from
distillation, the record keeps every candidate, and auto runs each method at its tuned
budget, refusing a missing tuning, other weights or another drafter in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from bench.cli import main
from bench.core.errors import BenchError
from bench.records import RunFile
from bench.run import RunSettings, run
from bench.training import distill as distill_module
from bench.training.distill import TUNING_HOLDOUT, tuning_holdout, tuning_prompts, usable_conversations
from bench.tune import best_candidate, check_tuned_drafter, parse_budget, tune, tuned_budget, tuning_path
from tests.test_distill import _sharegpt


def test_parse_budget():
    assert parse_budget(None) is None and parse_budget("auto") == "auto" and parse_budget("4") == 4
    for bad in ("x", "0", "-2", "1.5"):
        with pytest.raises(BenchError, match="--budget takes an integer >= 1 or 'auto'"):
            parse_budget(bad)


def test_the_fastest_candidate_wins_and_ties_go_to_the_defaults_then_the_smaller_budget():
    rows = [{"budget": None, "speedup": 0.9}, {"budget": 4, "speedup": 1.2}, {"budget": 2, "speedup": 1.2}]
    assert best_candidate(rows)["budget"] == 2
    assert best_candidate([*rows, {"budget": None, "speedup": 1.2}])["budget"] is None
    assert best_candidate([{"budget": 8, "speedup": 0.5}, {"budget": None, "speedup": 0.4}])["budget"] == 8


def test_tuning_prompts_are_the_conversations_distillation_holds_back(tmp_path):
    assert tuning_holdout(4 * TUNING_HOLDOUT) == 0 and tuning_holdout(4 * TUNING_HOLDOUT + 1) == TUNING_HOLDOUT
    path = _sharegpt(tmp_path / "sg.json", [[f"Question number {i}?", "More."] for i in range(200)])
    kept, _ = usable_conversations(0, None, path)
    held = tuning_prompts({}, path)
    assert held == [c["users"][0] for c in kept[-TUNING_HOLDOUT:]]
    assert tuning_prompts({}, _sharegpt(tmp_path / "small.json", [["Hi?"]] * 10)) == []  # small data: none held


def test_distillation_never_generates_the_held_back_conversations(tmp_path, monkeypatch, default_target):
    path = _sharegpt(tmp_path / "sg.json", [[f"Say the number {i}."] for i in range(4 * TUNING_HOLDOUT + 8)])
    asked = []

    def fake_generate(batch, tokenizer, work, settings, eos, bar, finished, journal):
        for _k, items in work:
            asked.extend(item["users"][0] for item in items)
        return iter(())

    monkeypatch.setattr(distill_module, "generate_shards", fake_generate)
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    settings = distill_module.DistillSettings(max_reply=8, max_context=64, shard_conversations=64, dtype="float32",
                                              data_path=str(path))
    distill_module.distill(default_target, settings, {}, progress=False)
    held = set(tuning_prompts({}, path))
    assert len(held) == TUNING_HOLDOUT and len(asked) == 8 + 3 * TUNING_HOLDOUT and not held & set(asked)


def _prompt(target, text="Count from one to five."):
    from bench.core.target import chat_prompt

    return chat_prompt(target.tokenizer, [{"role": "user", "content": text}])


@pytest.mark.slow  # the slow tier (make test-slow)
def test_tune_keeps_every_candidate_and_auto_runs_at_the_best(default_target, tmp_path, tiny_task, one_thread):
    path = tune(default_target, ["pld"], [_prompt(default_target)], tmp_path, budgets=(2, 3), max_new_tokens=12,
                echo=lambda line: None)
    assert path == tuning_path(tmp_path, default_target)
    record = json.loads(path.read_text())
    entry = record["methods"]["pld"]
    assert record["fingerprint"] == default_target.fingerprint and record["threads"] == 1
    assert [row["budget"] for row in entry["candidates"]] == [None, 2, 3]
    assert all(row["exact_prompts"] == 1 and row["tokens"] == entry["ar_tokens"] for row in entry["candidates"])
    assert entry["best"] == best_candidate(entry["candidates"])["budget"]
    assert tuned_budget(tmp_path, default_target, "pld") == (entry["best"], {**entry, "file": path.name})
    said = []  # a second tuning with the same drafter and settings keeps the entry
    tune(default_target, ["pld"], [_prompt(default_target)], tmp_path, budgets=(2, 3), max_new_tokens=12,
         echo=said.append)
    assert json.loads(path.read_text())["methods"]["pld"] == entry and "already tuned" in said[0]

    entry["best"] = 3  # whatever the timing said: auto runs what the record says
    path.write_text(json.dumps(record))
    settings = RunSettings(method="pld", task=str(tiny_task), max_new_tokens=8, results_dir=str(tmp_path),
                           dtype="float32", budget="auto", tag="auto")
    header = RunFile(run(settings)["_paths"]["pld"]).headers[0]["settings"]
    assert header["budget"] == 3 and header["method_options"] == {"num_pred_tokens": 3}
    assert header["budget_from"] == path.name

    entry["best"] = None  # the defaults won: the run records no budget, but where auto came from
    path.write_text(json.dumps(record))
    header = RunFile(run(replace(settings, tag="auto2"))["_paths"]["pld"]).headers[0]["settings"]
    assert "budget" not in header and header["method_options"] == {} and header["budget_from"] == path.name


def test_auto_refuses_a_missing_tuning_other_weights_and_another_drafter(default_target, tmp_path, tiny_task):
    with pytest.raises(BenchError, match="no tuning of eagle3 .* run `bench tune --method eagle3`"):
        tuned_budget(tmp_path, default_target, "eagle3")
    path = tuning_path(tmp_path, default_target)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "spec-bench-tune/1", "fingerprint": "other", "methods": {"pld": {}}}))
    with pytest.raises(BenchError, match="tuned on other weights"):
        tuned_budget(tmp_path, default_target, "pld")
    path.write_text("{not json")
    with pytest.raises(BenchError, match="unreadable tuning record"):
        tuned_budget(tmp_path, default_target, "pld")
    with pytest.raises(BenchError, match="tuned eagle3 with drafter abc, this run loads def"):
        check_tuned_drafter({"drafter_sha": "abc", "file": "x.json"},
                            SimpleNamespace(info={"manifest_sha": "def"}), "eagle3")
    check_tuned_drafter({"drafter_sha": None}, SimpleNamespace(), "pld")  # no drafter on either side
    with pytest.raises(BenchError, match="tuned sps with drafter None, this run loads 8ab8"):  # a draft LM's weights
        check_tuned_drafter({"drafter_sha": None, "file": "x.json"},
                            SimpleNamespace(info={"drafter": "d", "weights_sha1": "8ab8"}), "sps")
    result = CliRunner().invoke(main, ["run", "--method", "pld", "--task", str(tiny_task), "--budget", "auto",
                                       "--results-dir", str(tmp_path / "none"), "--max-new-tokens", "4"])
    assert result.exit_code == 2 and "no tuning of pld" in result.stderr and len(result.stderr.splitlines()) == 1


def test_the_grid_runs_each_method_at_its_tuned_budget(default_target, tmp_path, tiny_task, monkeypatch):
    import bench.core.target
    import bench.run
    from bench import registry
    from bench.grid import run_grid

    path = tuning_path(tmp_path, default_target)
    path.parent.mkdir(parents=True)
    entry = {"drafter_sha": None, "best": 5, "candidates": []}
    path.write_text(json.dumps({"format": "spec-bench-tune/1", "fingerprint": default_target.fingerprint,
                                "methods": {"pld": entry, "dflash": {**entry, "drafter_sha": "old"}}}))
    monkeypatch.setattr(bench.core.target, "load_target", lambda *a, **k: default_target)
    monkeypatch.setattr(registry, "build_decoder",
                        lambda name, target, options=None: SimpleNamespace(lossless=True, info=None))
    ran = []
    monkeypatch.setattr(bench.run, "run", lambda settings: ran.append(settings))
    cells = run_grid({str(tiny_task): {}}, ["pld", "dflash", "lookahead"], "g", str(tmp_path), budget="auto",
                     echo=lambda line: None)
    assert [(s.method, s.budget, s.budget_from) for s in ran] == [("pld", 5, path.name)]
    status = {c.method: c.status for c in cells}
    assert "tuned dflash with drafter old" in status["dflash"] and "no tuning of lookahead" in status["lookahead"]


def test_the_report_shows_the_tuned_series_beside_the_grid(tmp_path):
    """A hand-made grid (eagle3 at its defaults, 0.5x AR) and grid-auto (eagle3 at budget 2,
    AR 1.0 s against 0.8 s per turn: 1.25x): the tuned table and tables/tuned.csv."""
    from bench.report.build import make_report
    from bench.report.plots import Figured
    from tests.report_helpers import turn, write_run

    results = tmp_path / "results"
    for tag, decode, settings in (("grid", 1.9, {}), ("grid-auto", 0.7, {"budget": 2, "budget_from": "x.json",
                                                                         "method_options": {"total_token": 3,
                                                                                            "depth": 2}})):
        write_run(results, "mtbench", "ar", tag, [turn("1"), turn("2")])
        write_run(results, "mtbench", "eagle3", tag, [turn(q, decode=decode, exact=True, proposed=(2,) * 3,
                                                           accepted=(2, 2, 2)) for q in ("1", "2")], **settings)
    tune_dir = results / "tiny" / "tune"
    tune_dir.mkdir()
    (tune_dir / "cpu-bfloat16-x-t1.json").write_text(json.dumps({"methods": {"eagle3": {"candidates": [
        {"budget": None, "speedup": 0.5}, {"budget": 1, "speedup": 1.1}, {"budget": 2, "speedup": 1.3}]}}}))
    (tune_dir / "cpu-float32-x-t1.json").write_text("{broken")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- report:start -->\n<!-- report:end -->\n", encoding="utf-8")
    (results / "README.md").write_text("".join(f"<!-- {b}:start -->\n<!-- {b}:end -->\n" for b in
                                               ("references", "tuned")), encoding="utf-8")
    result = make_report(results, tmp_path / "plots", tags=("grid",), tuned_tags=("grid-auto",), readme=readme)
    text = (results / "README.md").read_text(encoding="utf-8")  # the headline alone goes to README.md
    headline = readme.read_text(encoding="utf-8")
    assert "| eagle3 |" in headline and "| 0.50x | 100% |" not in headline
    # A selection without a tuned series empties the block rather than keeping the numbers above.
    make_report(results, tmp_path / "plots", tags=("grid",), readme=readme)
    assert "(none: no tuned series" in (results / "README.md").read_text(encoding="utf-8")
    make_report(results, tmp_path / "plots", tags=("grid",), tuned_tags=("grid-auto",), readme=readme)
    assert "| eagle3 | 2 | 2 | 3.00 | 1.25x [1.25, 1.25] | 0.50x | 100% |" in text
    assert (tmp_path / "plots" / "tables" / "tuned.csv").exists()
    assert "tuned budget" in result["html"].read_text(encoding="utf-8")
    figures = {f.name: f for f in result["figures"]}
    assert isinstance(figures["tune"], Figured) and figures["tune"].png.exists()  # the readable record is drawn
    assert any(p.kind == "corrupt" and p.where.endswith("cpu-float32-x-t1.json") for p in result["problems"])
    assert "*" not in text.split("<!-- tuned:start -->")[1].split("<!-- tuned:end -->")[0]
    # A tuned cell recorded an hour after the tag's shared baseline is marked, with why.
    path = results / "tiny" / "mtbench" / "eagle3-grid-auto.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["provenance"]["started_at"] = "2026-01-01T01:10:00Z"
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    make_report(results, tmp_path / "plots", tags=("grid",), tuned_tags=("grid-auto",), readme=readme)
    text = (results / "README.md").read_text(encoding="utf-8")
    assert "| eagle3 | 2 | 2 | 3.00 | 1.25x [1.25, 1.25] * | 0.50x | 100% |" in text
    assert "\\* recorded more than 45 min after the tag's shared AR baseline" in text
