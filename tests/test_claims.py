"""The papers' claims table: each claim's verdict follows the records on its own definition,
and a claim whose series is not kept says so instead of guessing."""

from __future__ import annotations

import pandas as pd

from bench.report.claims import AGREE, DISAGREE, UNTESTABLE, Evidence, claims_table


def rows(**columns) -> pd.DataFrame:
    return pd.DataFrame(columns)


def test_verdicts_follow_the_records_and_missing_series_are_named():
    per_task = rows(method=["eagle3", "eagle2", "eagle", "pld"] * 2, task=["gsm8k"] * 4 + ["mtbench"] * 4,
                    tau=[3.0, 2.5, 2.0, 1.5, 2.0, 2.5, 1.8, 1.4], match_rate=[1.0] * 8, mismatches=[0] * 8)
    overall = rows(method=["eagle3", "eagle2", "ddtree", "dflash"], speedup=[1.5, 1.0, 0.9, 1.0],
                   tau=[2.5, 2.2, 3.0, 2.0])
    blocks = rows(method=["dflash"] * 3 + ["mtp"] * 3, series=["b4", "b8", "b16"] * 2,
                  tau=[2.0, 2.6, 3.1, 1.8, 2.1, 2.15])
    table = claims_table(Evidence(per_task, overall, blocks))
    def of(column: str, start: str) -> str:
        return next(v for c, v in zip(table["claim"], table[column]) if c.startswith(start))

    verdict = {start: of("verdict", start) for start in ("DFlash", "EAGLE-3 >", "EAGLE-3's", "DDTree", "Speculation",
                                                         "The output")}
    assert verdict["DFlash"] == AGREE  # rises 2.0 / 2.6 / 3.1; MTP +0.3 then +0.05
    assert verdict["EAGLE-3 >"] == DISAGREE  # mtbench has EAGLE-2 ahead
    assert verdict["EAGLE-3's"] == AGREE  # 1.5x / 1.0x
    assert verdict["DDTree"] == DISAGREE  # higher τ, lower speedup
    assert verdict["Speculation"] == UNTESTABLE and verdict["The output"] == AGREE
    assert "load sweep" in of("why", "Speculation") and "higher τ, lower speedup" in of("why", "DDTree")


def test_a_paper_table_sets_our_cell_beside_the_published_one_with_its_record(tmp_path):
    import json

    from report_helpers import TARGET, write_clean

    from bench.report.build import paper_tables_of
    from bench.report.paper_tables import load_paper_tables, paper_table
    from bench.report.tables import Shelf, build_tables, load_records

    write_clean(tmp_path / "results")
    spec = {"tables": [{"key": "k", "title": "T", "source": "S", "theirs": "them", "series": "t", "ours": "us",
                        "cells": [{"method": "pld", "task": "gsm8k", "metric": "tau", "published": 1.75,
                                   "checked": "yes"},
                                  {"method": "eagle", "task": "gsm8k", "metric": "speedup", "published": 2.1}]}]}
    (tmp_path / "tables.json").write_text(json.dumps(spec))
    [table] = load_paper_tables(tmp_path / "tables.json")
    records = load_records(tmp_path / "results")
    runs = {(r.method, r.task): str(r.path) for r in records.runs}
    frame = paper_table(table, build_tables(records).per_task, runs)
    assert list(frame["ours"]) == ["3.00", "not run"] and list(frame["published"]) == ["1.75", "2.1x"]
    assert frame["our record"].iloc[0].endswith(f"{TARGET}/gsm8k/pld-t.jsonl")
    shipped = paper_tables_of(Shelf(tmp_path / "results"), records, build_tables(records))  # the project's own tables
    assert {t.key for t, _ in shipped} >= {"dspark-table1", "ddtree-results", "specbench-leaderboard"}


def test_the_context_sweep_builds_prompts_of_each_length_and_the_report_draws_it(tmp_path, default_target):
    from report_helpers import turn, write_run

    from bench.context_sweep import long_prompts
    from bench.core.target import chat_prompt
    from bench.report.build import make_report
    from tasks import load_task

    pool = load_task("specbench")[:40]
    for length in (256, 1024):
        rows = long_prompts(pool, default_target.tokenizer, length, 2)
        sizes = [len(chat_prompt(default_target.tokenizer, [{"role": "user", "content": r["turns"][0]}]))
                 for r in rows]
        assert len(rows) == 2 and all(abs(size - length) <= 0.05 * length + 8 for size in sizes), sizes
        assert rows[0]["turns"][0].endswith(pool[0].turns[-1])  # the request comes last
    results = tmp_path / "results"
    for length, decode in ((256, 0.4), (1024, 0.6)):
        write_run(results, f"ctx{length}-abc", "ar", f"ctx{length}", [turn("1")])
        write_run(results, f"ctx{length}-abc", "pld", f"ctx{length}",
                  [turn("1", decode=decode, draft=0.1, verify=0.3, exact=True, proposed=(3, 3), accepted=(2, 1))])
    make_report(results, tmp_path / "plots")
    assert (tmp_path / "plots" / "figures" / "context.png").exists()


def test_the_papers_regime_reads_the_speedup_at_each_published_tau(tmp_path):
    """Oracle runs of eagle3 on MT-bench at τ 1 (as fast as AR) and τ 3 (twice as fast): the
    report's regime table reads the speedup at each τ a paper published for eagle3 there by
    linear interpolation, and a τ past the sweep's highest is out of reach, not extrapolated."""
    from bench.paper_regime import speedup_at
    from bench.report.build import make_report
    from tests.report_helpers import turn, write_run

    curve = pd.DataFrame({"tau": [1.0, 3.0, 3.0], "speedup": [1.0, 1.8, 2.2]})
    assert speedup_at(curve, 2.0) == (1.5, "between τ 1.00 and 3.00")
    assert speedup_at(curve, 3.5)[1] == "out of reach: the sweep's highest τ is 3.00"
    assert speedup_at(curve.iloc[:1], 1.0)[1] == "fewer than two oracle runs"
    results = tmp_path / "results"
    for tag, accept, accepted, decode in (("oracle0.5", 0.5, (0,) * 9, 0.9), ("oracle1.0", 1.0, (2, 2, 2), 0.45)):
        write_run(results, "mtbench", "ar", tag, [turn("1")], method_options={})
        write_run(results, "mtbench", "eagle3", tag, [turn("1", decode=decode, exact=True, proposed=accepted,
                                                           accepted=accepted)],
                  method_options={"oracle_accept": accept})
    out = make_report(results, tmp_path / "plots", tags=("oracle0.5", "oracle1.0"))
    regime = pd.read_csv(tmp_path / "plots" / "tables" / "paper-regime.csv").fillna("")
    rows = regime[(regime["method"] == "eagle3") & (regime["task"] == "mtbench")]
    dspark = rows[rows["paper"] == "dspark-table1"].iloc[0]  # τ 2.66, inside the sweep
    assert dspark["how"] == "between τ 1.00 and 3.00" and 1.0 < float(dspark["our loop at that τ"][:-1]) < 2.0
    assert all(how in ("between τ 1.00 and 3.00", "") or how.startswith("out of reach") for how in rows["how"])
    assert (regime[regime["method"] == "sps"]["how"] == "not run").all()
    assert 'id="regime"' in out["html"].read_text()
