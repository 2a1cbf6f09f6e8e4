"""Spec-Bench answer files (bench.specbench): export of our records, import of theirs, and
the two speedup conventions side by side. Hand-built records (tests/report_helpers.py) and
hand-written Spec-Bench files with the fields their evaluation/eval.py writes; every expected
number is worked out by hand in the comments. No model is loaded."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from report_helpers import PLD_ROUNDS, TARGET, turn, write_run

from bench import metrics
from bench.cli import main
from bench.records import RunFile, turn_problem
from bench.report.tables import load_records, summarize
from bench.specbench import read_answers, specbench_speed

# Question 1 has two turns, question 2 one; their lengths differ, so the conventions differ.
# AR:  q1: 40 tokens in 2.0 s, 20 in 1.0 s; q2: 10 tokens in 1.0 s       (4.0 s, 70 tokens)
# pld: q1: 40 tokens in 0.5 s, 20 in 0.5 s; q2: 10 tokens in 0.25 s      (1.25 s, 70 tokens)
# Ours, ratio of sums: (4.0 / 70) / (1.25 / 70) = 3.2.
# Spec-Bench, ratio of mean per-question tok/s: mean(60/1.0, 10/0.25) / mean(60/3.0, 10/1.0)
#   = 50 / 15 = 10/3.
OURS, THEIRS = 3.2, 10 / 3
AR_TURNS = [("1", 1, 40, 0.2, 1.8), ("1", 2, 20, 0.1, 0.9), ("2", 1, 10, 0.1, 0.9)]
PLD_TURNS = [("1", 1, 40, 0.1, 0.4), ("1", 2, 20, 0.1, 0.4), ("2", 1, 10, 0.05, 0.2)]
SPECBENCH_KEYS = {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
CHOICE_KEYS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}


def write_pair(results: Path, tag: str = "t") -> Path:
    write_run(results, "mtbench", "ar", tag, [turn(q, n, tokens=k, ttft=a, decode=b) for q, n, k, a, b in AR_TURNS])
    return write_run(results, "mtbench", "pld", tag, [turn(q, n, tokens=k, ttft=a, decode=b, **PLD_ROUNDS)
                                                      for q, n, k, a, b in PLD_TURNS])


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def one_line_error(result, says: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.output
    assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr


def leftovers(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


# ---------------------------------------------------------------- export


def test_export_writes_their_shape_and_their_speedup_matches_the_records(tmp_path):
    run = write_pair(tmp_path / "results")
    out = tmp_path / "answers" / "tiny-pld.jsonl"
    result = invoke("export", "--format", "specbench", "--run", str(run), "--out", str(out))
    assert result.exit_code == 0, result.output
    method, base = lines(out), lines(out.with_name("tiny-pld-baseline.jsonl"))
    assert [r["question_id"] for r in method] == [1, 2] == [r["question_id"] for r in base]  # numbered, as theirs
    for row in method + base:
        assert set(row) == SPECBENCH_KEYS and len(row["choices"]) == 1 and set(row["choices"][0]) == CHOICE_KEYS
    first = method[0]["choices"][0]
    assert first["new_tokens"] == [40, 20] and first["wall_time"] == pytest.approx([0.5, 0.5])
    assert first["accept_lengths"] == [4, 3, 2] * 2 and first["decoding_steps"] == [3, 3]  # n_r + 1; rounds per turn
    assert base[0]["choices"][0]["accept_lengths"] == [1] * 18

    # Their computation on the files, against the same computed directly from the record files.
    def mean_question_rate(path: Path) -> float:
        sums: dict[str, list[float]] = {}
        for record in lines(path)[1:]:
            q = sums.setdefault(record["question_id"], [0, 0.0])
            q[0] += len(record["tokens"])
            q[1] += record["ttft"] + record["decode_time"]
        return sum(n / s for n, s in sums.values()) / len(sums)

    direct = mean_question_rate(run) / mean_question_rate(run.with_name("ar-t.jsonl"))
    speed = specbench_speed(method, base)
    assert speed.speedup == pytest.approx(direct) == pytest.approx(THEIRS)
    assert speed.tokens_per_s == pytest.approx(50.0) and speed.baseline_tokens_per_s == pytest.approx(15.0)
    assert speed.mean_accepted == pytest.approx(3.0)  # their mean accepted tokens is our τ
    assert "speedup 3.333x" in result.output
    # speed.py's subtasks select by category: all of these are "writing", none "translation".
    assert specbench_speed(method, base, "mt_bench").speedup == pytest.approx(THEIRS)
    assert specbench_speed(method, base, "translation").questions == 0


def test_reports_give_both_conventions(tmp_path):
    write_pair(tmp_path)
    row = summarize(load_records(tmp_path), "task").set_index("method").loc["pld"]
    assert row["speedup"] == pytest.approx(OURS) and row["speedup_specbench"] == pytest.approx(THEIRS)
    result = invoke("report", "--results", str(tmp_path), "--out", str(tmp_path / "plots"))
    assert result.exit_code == 0, result.output
    header, _, ar, pld = result.stdout.splitlines()[:4]
    assert "| speedup [95% CI] |" in header and "| speedup (Spec-Bench) |" in header
    assert "| 3.20x [" in pld and "| 3.33x |" in pld and "| 1 (baseline) | 1 (baseline) |" in ar
    assert "speedup_specbench" in (tmp_path / "plots" / "tables" / "per_task.csv").read_text()


def test_export_by_run_name_and_of_a_baseline_alone(tmp_path):
    write_pair(tmp_path / "results")
    out = tmp_path / "pld.jsonl"
    result = invoke("export", "--format", "specbench", "--results-dir", str(tmp_path / "results"), "--target", TARGET,
                    "--task", "mtbench", "--method", "pld", "--tag", "t", "--out", str(out),
                    "--baseline-out", str(tmp_path / "vanilla.jsonl"))
    assert result.exit_code == 0, result.output
    assert len(lines(out)) == 2 and len(lines(tmp_path / "vanilla.jsonl")) == 2
    result = invoke("export", "--format", "specbench", "--run", str(tmp_path / "results" / TARGET / "mtbench" /
                                                                   "ar-t.jsonl"), "--out", str(tmp_path / "ar.jsonl"))
    assert result.exit_code == 0 and len(lines(tmp_path / "ar.jsonl")) == 2
    assert not (tmp_path / "ar-baseline.jsonl").exists()


def test_export_writes_only_turns_both_runs_finished(tmp_path):
    results = tmp_path / "results"
    write_run(results, "mtbench", "ar", "t", [turn(q, n, tokens=k, ttft=a, decode=b) for q, n, k, a, b in AR_TURNS])
    run = write_run(results, "mtbench", "pld", "t", [turn("1", 2, **PLD_ROUNDS), turn("2", 1, **PLD_ROUNDS)])
    result = invoke("export", "--format", "specbench", "--run", str(run), "--out", str(tmp_path / "pld.jsonl"))
    assert result.exit_code == 0, result.output
    # q1 has no first turn in pld: Spec-Bench's turns are positional, so q1 is left out on both sides.
    assert [r["question_id"] for r in lines(tmp_path / "pld.jsonl")] == [2]
    assert [r["question_id"] for r in lines(tmp_path / "pld-baseline.jsonl")] == [2]
    assert "3 turns without their pair left out" in result.output


# ---------------------------------------------------------------- import


def test_export_then_import_keeps_every_number(tmp_path):
    results = tmp_path / "results"
    run = write_pair(results)
    out = tmp_path / "pld.jsonl"
    assert invoke("export", "--format", "specbench", "--run", str(run), "--out", str(out)).exit_code == 0
    for method, source in (("pld", out), ("ar", tmp_path / "pld-baseline.jsonl")):
        result = invoke("import", str(source), "--format", "specbench", "--target", TARGET, "--task", "mtbench",
                        "--method", method, "--tag", "back", "--results-dir", str(results))
        assert result.exit_code == 0, result.output
    back = RunFile(results / TARGET / "mtbench" / "pld-back.jsonl")
    header = back.headers[0]
    assert header["imported_from"] == "specbench" and header["settings"]["imported_from"] == "specbench"
    assert header["source_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    first = back.done("1", 1)
    assert first["tokens"] is None and first["new_tokens"] == 40 and first["ttft"] is None  # not in their file
    assert first["wall_time"] == pytest.approx(0.5) and first["accept_lengths"] == [3, 2, 1]
    assert not back.problems
    rows = summarize(load_records(results), "task").set_index(["series", "method"])
    for tag in ("t", "back"):
        assert rows.loc[(tag, "pld"), "speedup"] == pytest.approx(OURS)
        assert rows.loc[(tag, "pld"), "speedup_specbench"] == pytest.approx(THEIRS)
        assert rows.loc[(tag, "pld"), "tau"] == pytest.approx(3.0)
    assert rows.loc[("back", "pld"), "ttft_s"] != rows.loc[("back", "pld"), "ttft_s"]  # unknown: NaN, not 0


def answer(qid, category, turns, new_tokens, wall_time, accept_lengths, steps_key="decoding_steps", steps=None):
    """One line as Spec-Bench's evaluation/eval.py writes it."""
    choice = {"index": 0, "turns": turns, steps_key: steps or [len(accept_lengths)], "new_tokens": new_tokens,
              "wall_time": wall_time, "accept_lengths": accept_lengths}
    return {"question_id": qid, "category": category, "answer_id": f"id{qid}",
            "model_id": "vicuna-7b-v1.3-eagle-float16-temperature-0.0", "choices": [choice], "tstamp": 1.7e9}


# EAGLE: q81 (2 turns) 9 tokens in 0.5 s, steps [4, 2 | 3]; q201 (1 turn) 5 tokens in 0.25 s, steps [3, 2].
# Vanilla: q81 9 tokens in 0.9 s; q201 5 in 0.5 s.
# Spec-Bench: mean(18, 20) / mean(10, 10) = 1.9. Ours: (1.4 / 14) / (0.75 / 14) = 1.8667. τ = 14 / 5 = 2.8.
EAGLE = [answer(81, "writing", ["A.", "B."], [6, 3], [0.3, 0.2], [4, 2, 3], steps=[2, 1]),
         answer(201, "translation", ["C."], [5], [0.25], [3, 2])]
VANILLA = [answer(81, "writing", ["A.", "B."], [6, 3], [0.6, 0.3], [1] * 9, steps=[6, 3]),
           answer(201, "translation", ["C."], [5], [0.5], [1] * 5)]


def write_answers(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail, encoding="utf-8")
    return path


def test_their_answer_files_show_in_the_report(tmp_path):
    results = tmp_path / "results"
    for method, rows in (("eagle", EAGLE), ("ar", VANILLA)):
        source = write_answers(tmp_path / f"{method}.jsonl", rows)
        result = invoke("import", str(source), "--format", "specbench", "--target", "vicuna-7b", "--task",
                        "specbench", "--method", method, "--results-dir", str(results))
        assert result.exit_code == 0, result.output
    assert specbench_speed(EAGLE, VANILLA).speedup == pytest.approx(1.9)
    result = invoke("report", "--results", str(results), "--out", str(tmp_path / "plots"))
    assert result.exit_code == 0, result.output
    eagle = next(line for line in result.stdout.splitlines() if "| eagle |" in line)
    assert "| 2.80 |" in eagle and "| 1.87x [" in eagle and "| 1.90x |" in eagle
    per_category = (tmp_path / "plots" / "tables" / "per_category.md").read_text()
    assert "translation" in per_category and "writing" in per_category


def test_step_counts_that_do_not_split_leave_the_turns_out_of_tau(tmp_path):
    # Older method scripts write `idxs` (the last step's index): 1 + 0 != 3 steps listed.
    rows = [answer(81, "writing", ["A.", "B."], [6, 3], [0.3, 0.2], [4, 2, 3], steps_key="idxs", steps=[1, 0]),
            EAGLE[1]]
    source = write_answers(tmp_path / "eagle.jsonl", rows)
    result = invoke("import", str(source), "--format", "specbench", "--target", "v", "--task", "specbench",
                    "--method", "eagle", "--results-dir", str(tmp_path / "results"))
    assert result.exit_code == 0 and "1 questions' accept lengths not split" in result.output
    run = RunFile(tmp_path / "results" / "v" / "specbench" / "eagle.jsonl")
    assert run.done("81", 1)["accept_lengths"] is None and run.done("201", 1)["accept_lengths"] == [2, 1]
    assert metrics.tau(run.turns) == pytest.approx(2.5)  # q201 only: (3 + 2) / 2


def test_imported_nulls_only_in_imported_turns():
    ours = {k: v for k, v in turn("1").items() if k != "type"}
    assert turn_problem(ours) is None
    assert "tokens is not" in turn_problem({**ours, "tokens": None})  # our own runs stay strict
    imported = {**ours, "imported_from": "specbench", "tokens": None, "ttft": None, "decode_time": None}
    assert "without new_tokens" in turn_problem(imported) and "without wall_time" in turn_problem(imported)
    assert turn_problem({**imported, "new_tokens": 3, "wall_time": 0.5}) is None


# ---------------------------------------------------------------- bad input


BAD_FILES = {
    "not JSON": (lambda: write_rows(EAGLE[:1]) + "{not json\n", ":2: malformed JSON"),
    "no wall_time": (lambda: write_rows([drop(EAGLE[0], "wall_time")]), "choices[0] has no wall_time"),
    "no choices": (lambda: write_rows([{k: v for k, v in EAGLE[0].items() if k != "choices"}]), "no choices"),
    "no question_id": (lambda: write_rows([{k: v for k, v in EAGLE[0].items() if k != "question_id"}]),
                       "no question_id"),
    "a turn short": (lambda: write_rows([{**EAGLE[0], "choices": [{**EAGLE[0]["choices"][0], "new_tokens": [6]}]}]),
                     "new_tokens is not 2 integers"),
    "a question twice": (lambda: write_rows([EAGLE[1], EAGLE[1]]), "question 201 again"),
    "empty": (lambda: "", "no answers"),
}


def write_rows(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def drop(row: dict, key: str) -> dict:
    return {**row, "choices": [{k: v for k, v in row["choices"][0].items() if k != key}]}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_answer_files_are_one_line_and_write_nothing(tmp_path, name):
    text, says = BAD_FILES[name]
    source = tmp_path / "bad.jsonl"
    source.write_text(text(), encoding="utf-8")
    result = invoke("import", str(source), "--format", "specbench", "--target", "v", "--task", "specbench",
                    "--method", "eagle", "--results-dir", str(tmp_path / "results"))
    one_line_error(result, says)
    assert leftovers(tmp_path / "results") == []


def test_unknown_format_and_missing_baseline_are_one_line(tmp_path):
    source = write_answers(tmp_path / "eagle.jsonl", EAGLE)
    result = invoke("import", str(source), "--format", "fastchat", "--target", "v", "--task", "specbench",
                    "--method", "eagle", "--results-dir", str(tmp_path / "results"))
    one_line_error(result, "unknown answer-file format 'fastchat'")
    run = write_pair(tmp_path / "results")
    result = invoke("export", "--format", "spec-bench", "--run", str(run), "--out", str(tmp_path / "x.jsonl"))
    one_line_error(result, "unknown answer-file format 'spec-bench'")
    run.with_name("ar-t.jsonl").unlink()
    result = invoke("export", "--format", "specbench", "--run", str(run), "--out", str(tmp_path / "x.jsonl"))
    one_line_error(result, "no baseline ar-t.jsonl")
    assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "x-baseline.jsonl").exists()


def test_export_writes_both_files_or_neither(tmp_path):
    run = write_pair(tmp_path / "results")
    (tmp_path / "blocked").write_text("a file where a folder should be")
    result = invoke("export", "--format", "specbench", "--run", str(run), "--out", str(tmp_path / "out" / "pld.jsonl"),
                    "--baseline-out", str(tmp_path / "blocked" / "ar.jsonl"))
    one_line_error(result, "cannot write")
    assert leftovers(tmp_path / "out") == []


def test_import_never_overwrites_records(tmp_path):
    run = write_pair(tmp_path / "results")
    before = run.read_bytes()
    source = write_answers(tmp_path / "eagle.jsonl", EAGLE)
    result = invoke("import", str(source), "--format", "specbench", "--target", TARGET, "--task", "mtbench",
                    "--method", "pld", "--tag", "t", "--results-dir", str(tmp_path / "results"))
    one_line_error(result, "already exists")
    assert run.read_bytes() == before
    assert read_answers(source).rows == EAGLE


def test_speculation_profile_export_reads_back_and_keeps_its_identities(tmp_path):
    """`bench export --format speculation-profile`: specdec_bench's keys, per category too; read
    back, every identity holds (histogram over every step, joint from 1 and never rising,
    conditional = ratio of joints, mean tokens per step = sum of joints = τ), and a damaged
    profile fails them."""
    from click.testing import CliRunner
    from report_helpers import TARGET, write_clean

    from bench import metrics
    from bench.cli import main
    from bench.records import RunFile
    from bench.speculation_profile import problems

    results = tmp_path / "results"
    write_clean(results)
    run = results / TARGET / "mtbench" / "pld-t.jsonl"
    out = tmp_path / "acceptance_rate.json"
    result = CliRunner().invoke(main, ["export", "--format", "speculation-profile", "--run", str(run), "--out",
                                       str(out)])
    assert result.exit_code == 0, result.output
    [profile] = json.loads(out.read_text())
    assert {"Request_AL", "Category_AL", "Average_AL", "Acceptance_Length_Histogram", "Conditional_Acceptance_Rate",
            "Joint_Acceptance_Rate", "Per_Category", "Checks", "Source"} <= set(profile)
    assert set(profile["Category_AL"]) == {"writing", "math"} and not problems(profile)
    assert all(check["holds"] for check in profile["Checks"].values())
    tau = metrics.tau(RunFile(run).turns)
    assert profile["Checks"]["mean_tokens_per_step_is_the_sum_of_joints"]["mean"] == pytest.approx(tau)
    profile["Joint_Acceptance_Rate"][max(profile["Joint_Acceptance_Rate"], key=int)] = 2.0  # damaged
    assert "joint_never_rises" in problems(profile)
    again = CliRunner().invoke(main, ["export", "--format", "speculation-profile", "--run", str(run), "--out",
                                      str(out)])
    assert again.exit_code == 2 and "give --force" in again.stderr
