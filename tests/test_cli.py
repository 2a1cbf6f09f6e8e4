"""The `bench` command line: bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import bench.core.target
from bench.cli import main
from tasks import task_name


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def no_target_load(monkeypatch):
    """Errors that need no model must be reported before the target loads."""
    def refuse(*args, **kwargs):
        raise AssertionError("the target model was loaded")

    monkeypatch.setattr(bench.core.target, "load_target", refuse)


def assert_bad_input(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.stderr


def test_list():
    result = invoke("list")
    assert result.exit_code == 0
    for word in ("methods:", "ar ", "hf ", "tasks:", "mtbench, humaneval, gsm8k, specbench", "targets:",
                 "smollm2-135m"):
        assert word in result.stdout


def test_unknown_method(no_target_load, tiny_task):
    assert_bad_input(invoke("run", "--method", "eagel", "--task", str(tiny_task)),
                     "unknown method 'eagel'", "ar")


def test_unknown_task(no_target_load):
    assert_bad_input(invoke("run", "--method", "ar", "--task", "mtbnech"), "unknown task 'mtbnech'")


def test_unknown_category(no_target_load, data_dir):
    result = invoke("run", "--method", "ar", "--task", "mtbench", "--data-dir", str(data_dir), "--category", "poetry")
    assert_bad_input(result, "no category poetry", "has: coding")


def test_malformed_custom_jsonl(no_target_load, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2,\n')
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(path)), "broken.jsonl:2: malformed JSON")


def test_missing_custom_file(no_target_load, tmp_path):
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(tmp_path / "gone.jsonl")), "task file not found")


def test_bad_option(no_target_load, tiny_task):
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(tiny_task), "--option", "depth"),
                     "--option takes key=value, got 'depth'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_cuda(no_target_load, tiny_task):
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(tiny_task), "--device", "cuda"),
                     "CUDA is not available")


def test_bad_dtype(no_target_load, tiny_task):
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(tiny_task), "--dtype", "fp8"),
                     "unknown dtype 'fp8'")


def test_unknown_target_folder(tiny_task, tmp_path):
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(tiny_task), "--target", str(tmp_path / "nomodel")),
                     "unknown target")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    assert_bad_input(invoke("run", "--method", "ar", "--task", str(tiny_task), "--target", str(empty)),
                     "has no config.json")


def test_unwritable_results_dir(tiny_task, tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("a file, not a folder")
    result = invoke("run", "--method", "ar", "--task", str(tiny_task), "--device", "cpu",
                    "--results-dir", str(blocker))
    assert_bad_input(result, "cannot write results to")


def test_settings_mismatch_on_resume(tiny_task, tmp_path):
    path = tmp_path / "smollm2-135m" / task_name(str(tiny_task)) / "ar.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"type": "header", "settings": {"method": "ar", "max_new_tokens": 999}}) + "\n")
    result = invoke("run", "--method", "ar", "--task", str(tiny_task), "--device", "cpu",
                    "--results-dir", str(tmp_path))
    assert_bad_input(result, "other settings", "max_new_tokens", "--tag")
    assert len(path.read_text().splitlines()) == 1


def test_run_prints_summary(tiny_task, tmp_path):
    result = invoke("run", "--method", "ar", "--task", str(tiny_task), "--category", "math", "--device", "cpu",
                    "--max-new-tokens", "3", "--results-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "tau" in result.stdout and "records (ar):" in result.stdout
    records = tmp_path / "smollm2-135m" / task_name(str(tiny_task)) / "ar.jsonl"
    turns = [json.loads(line) for line in records.read_text().splitlines()]
    assert [t.get("question_id") for t in turns if t["type"] == "turn"] == ["q2"]


def test_real_exit_code_and_one_line(tmp_path):
    """The installed script: exit status 2 and exactly one stderr line, no traceback."""
    script = shutil.which("bench", path=str(Path(sys.executable).parent)) or shutil.which("bench")
    if script is None:
        pytest.skip("the `bench` console script is not installed")
    done = subprocess.run([script, "run", "--method", "nope", "--task", "mtbench"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown method 'nope' (choose from ar")


@pytest.mark.parametrize("given,expected", [(None, "ACTIVE"), ("PASSIVE", "PASSIVE")])
def test_the_harness_keeps_openmp_workers_spinning_unless_told_otherwise(given, expected):
    """bench/__init__ sets OMP_WAIT_POLICY=ACTIVE before torch loads libgomp (an A/B record under
    results/<target>/profile/ measures why); a policy the user set is kept."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = "import os, bench, torch; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_pack_stores_finished_records_and_names_what_it_leaves(tmp_path):
    from report_helpers import write_clean

    results = tmp_path / "results"
    write_clean(results)
    cut = results / "tiny" / "mtbench" / "pld-t.jsonl"
    cut.write_bytes(cut.read_bytes() + b'{"type": "turn"')  # a run cut by a crash: not finished
    result = invoke("pack", "--results-dir", str(results))
    assert result.exit_code == 0, result.output
    assert "packed 3 record files" in result.stdout and "1 left as they are" in result.stdout
    assert "pld-t.jsonl ends in an unfinished line" in result.stderr
    assert cut.exists() and len(list(results.glob("*/*/*.jsonl.gz"))) == 3
    again = invoke("pack", "--results-dir", str(results))
    assert "packed 0 record files" in again.stdout and "3 were packed already" in again.stdout
    assert_bad_input(invoke("pack", str(tmp_path / "nowhere")), "no such file or folder")


def test_pack_with_nothing_to_pack_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_bad_input(invoke("pack", str(tmp_path / "empty")), "no record files")


def test_bench_check_names_each_damaged_file_and_fails(tmp_path):
    """A clean shelf passes; a replaced token list under a true exact_match flag, a foreign
    line in AR's file and a method recorded at other settings than its baseline are each named
    with their file, and the command exits 1."""
    from report_helpers import write_clean

    results = tmp_path / "results"
    write_clean(results)
    clean = invoke("check", str(results))
    assert clean.exit_code == 0, clean.output
    assert "0 record file(s) with findings" in clean.stdout
    mt = results / "tiny" / "mtbench"
    pld = mt / "pld-t.jsonl"
    rows = [json.loads(line) for line in pld.read_text().splitlines()]
    rows[1]["tokens"] = [7] * len(rows[1]["tokens"])  # replaced, the flag still true
    pld.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ar = mt / "ar-t.jsonl"
    foreign = dict(rows[2], question_id="9", method="pld")
    ar.write_text(ar.read_text() + json.dumps(foreign) + "\n")
    gsm = results / "tiny" / "gsm8k" / "pld-t.jsonl"
    rows = [json.loads(line) for line in gsm.read_text().splitlines()]
    rows[0]["settings"]["max_new_tokens"] = 8
    gsm.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = invoke("check", str(results))
    assert found.exit_code == 1
    assert f"{pld}: inconsistent" in found.stdout and f"{ar}: foreign" in found.stdout
    assert f"{gsm}: unpaired" in found.stdout and "3 record file(s) with findings" in found.stdout
    assert_bad_input(invoke("check", str(tmp_path / "nowhere")), "results folder not found")


def test_rounds_names_the_methods_it_can_replay(no_target_load):
    """`bench rounds` for a method without a replay hook, or a trained method's held-out-only
    replay asked for grid turns: one line each, before the target loads."""
    result = CliRunner().invoke(main, ["rounds", "--method", "pld"])
    assert result.exit_code == 2 and "pld has no round replay" in result.output
    assert "dflash" in result.output and "sps" in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(main, ["rounds", "--method", "eagle3", "--task", "humaneval"])
    assert result.exit_code == 2 and "held-out conversations only" in result.output
