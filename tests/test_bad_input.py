"""Bad input and damaged records, one row per case: a one-line error and exit 2 (nothing
written), or, for damaged records, the damaged line or file left out and reported while
everything else counts. Hand-built records (tests/report_helpers.py) where no model is
needed; the embedded default target, 4 new tokens, 1 question, where a run must decode."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from report_helpers import PLD_ROUNDS, TARGET, header, turn, write_clean, write_run

import bench.core.target
import bench.run
from bench.cli import main as bench_main
from bench.grid import main as grid_main
from bench.records import RunFile, read_records
from bench.report.summary import main as summary_main
from tasks import task_name

MODEL = "smollm2-135m"  # the embedded default target's records folder
QUICK = ["--device", "cpu", "--max-new-tokens", "4", "--limit", "1"]


@dataclass
class Case:
    """`prepare(tmp)` builds the files and returns the arguments; `patch(monkeypatch, tmp)`
    injects a fault; `stderr` must be in the error output; `check(tmp, result)` looks at what
    was (not) written."""
    program: str  # bench | summary | grid
    prepare: Callable[[Path], list[str]]
    code: int
    stderr: str
    check: Callable[[Path, object], None] = lambda tmp, result: None
    patch: Callable[[pytest.MonkeyPatch, Path], None] = lambda monkeypatch, tmp: None
    model: bool = False  # the target loads (a run that must decode); else loading it fails the case


# ---------------------------------------------------------------- helpers


def tiny_task(tmp: Path, name: str = "tiny.jsonl", turns: tuple[str, ...] = ("Say hi.",), folder: str = "") -> Path:
    path = tmp / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"question_id": "q1", "category": "chat", "turns": list(turns)}) + "\n")
    return path


def run_args(task: Path, tmp: Path, *extra: str) -> list[str]:
    return ["run", "--method", "ar", "--task", str(task), "--results-dir", str(tmp / "results"), *QUICK, *extra]


def ar_records(tmp: Path, task: Path) -> Path:
    return tmp / "results" / MODEL / task_name(str(task)) / "ar.jsonl"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """One finished run (ar, tiny task, 1 turn of 4 tokens) that cases copy and damage."""
    tmp = tmp_path_factory.mktemp("recorded")
    task = tiny_task(tmp)
    result = CliRunner().invoke(bench_main, run_args(task, tmp))
    assert result.exit_code == 0, result.output
    return tmp


def from_recorded(tmp: Path, edit: Callable[[list[dict]], list[str]]) -> list[str]:
    """A copy of the finished run whose record lines `edit` rewrites; the same command again."""
    source = recorded_dir()
    shutil.copytree(source, tmp, dirs_exist_ok=True)
    task = tmp / "tiny.jsonl"
    path = ar_records(tmp, task)
    path.write_bytes(b"".join(line if isinstance(line, bytes) else line.encode() + b"\n"
                              for line in edit([json.loads(x) for x in path.read_text().splitlines()])))
    return run_args(task, tmp)


_RECORDED: list[Path] = []  # the `recorded` fixture's folder, for the cases' prepare
_OPEN: list[int] = []  # descriptors a case holds open (closed after it)


def recorded_dir() -> Path:
    return _RECORDED[0]


def report_args(tmp: Path) -> list[str]:
    return ["report", "--results", str(tmp / "results"), "--out", str(tmp / "out")]


def summary_args(tmp: Path) -> list[str]:
    return ["--results-dir", str(tmp / "results"), "--target", TARGET, "--tag", "t"]


def clean_with(tmp: Path, edit: Callable[[Path], None] | None = None) -> Path:
    """write_clean (pld 2x over AR on MT-bench, 4x on GSM8K, 2.4x pooled) and `edit` of
    results/tiny/mtbench/pld-t.jsonl."""
    results = tmp / "results"
    write_clean(results)
    if edit is not None:
        edit(results / TARGET / "mtbench" / "pld-t.jsonl")
    return results


def pld_row(result) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith("| pld |"))


def unchanged(path_of: Callable[[Path], Path]) -> Callable[[Path, object], None]:
    def check(tmp: Path, result) -> None:
        assert path_of(tmp).read_bytes() == (tmp / "before").read_bytes()
    return check


def keep_copy(path: Path, tmp: Path) -> None:
    shutil.copy(path, tmp / "before")


def fail_open(suffix: str, code: int) -> Callable[[pytest.MonkeyPatch, Path], None]:
    """os.open of a path ending in `suffix` fails with `code` (root ignores chmod)."""
    def patch(monkeypatch, tmp):
        real = os.open

        def refuse(path, flags, *args, **kwargs):
            if str(path).endswith(suffix):
                raise OSError(code, os.strerror(code), str(path))
            return real(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", refuse)
    return patch


def disk_full_on_append(monkeypatch, tmp):
    """The disk fills up in the middle of appending a record: half the bytes, then ENOSPC."""
    real = os.write

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith(".jsonl"):
            real(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)


def hold_lock(monkeypatch, tmp):
    """Another run holds the record file's lock (a second open file description conflicts
    with flock even in this process)."""
    lock = ar_records(tmp, tmp / "tiny.jsonl").with_name("ar.jsonl.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(lock, os.O_WRONLY | os.O_CREAT)
    fcntl.flock(handle, fcntl.LOCK_EX)
    _OPEN.append(handle)


def interrupt(where: str) -> Callable[[pytest.MonkeyPatch, Path], None]:
    def patch(monkeypatch, tmp):
        def stop(*args, **kwargs):
            raise KeyboardInterrupt
        if where == "load":
            monkeypatch.setattr(bench.core.target, "load_target", stop)
        else:  # during the first turn, after the file was taken for writing
            monkeypatch.setattr(bench.run.UtilizationMonitor, "__enter__", stop)
    return patch


# ---------------------------------------------------------------- the cases


def _prompt_changed(tmp):
    def edit(lines):
        lines[1]["prompt_hash"] = "0" * 12  # recorded for another prompt
        return [json.dumps(x) for x in lines]
    args = from_recorded(tmp, edit)
    keep_copy(ar_records(tmp, tmp / "tiny.jsonl"), tmp)
    return args


def _custom_named_like_a_suite(tmp):
    suite = tmp / "results" / MODEL / "mtbench" / "ar.jsonl"  # MT-bench records, question 81 included
    suite.parent.mkdir(parents=True)
    suite.write_text(json.dumps(header("ar", "mtbench")) + "\n" + json.dumps(turn("81")) + "\n")
    keep_copy(suite, tmp)
    path = tmp / "mine" / "mtbench.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"question_id": "81", "turns": ["Say hi."]}) + "\n")
    return run_args(path, tmp)


def _custom_check(tmp, result):
    assert (tmp / "results" / MODEL / "mtbench" / "ar.jsonl").read_bytes() == (tmp / "before").read_bytes()
    mine = ar_records(tmp, tmp / "mine" / "mtbench.jsonl")
    assert mine.parent.name.startswith("mtbench-") and len(read_records(mine)[1]) == 1


def _two_files_one_name(tmp):
    first, second = tiny_task(tmp, "questions.jsonl", folder="a"), tiny_task(tmp, "questions.jsonl", ("Hello?",), "b")
    # The first file's records (its questions are the recorded run's): the second must not reuse them.
    shutil.copytree(ar_records(recorded_dir(), recorded_dir() / "tiny.jsonl").parent, ar_records(tmp, first).parent)
    keep_copy(ar_records(tmp, first), tmp)
    return run_args(second, tmp)


def _two_files_check(tmp, result):
    first, second = ar_records(tmp, tmp / "a" / "questions.jsonl"), ar_records(tmp, tmp / "b" / "questions.jsonl")
    assert first.parent != second.parent and first.read_bytes() == (tmp / "before").read_bytes()
    (mine,), (theirs,) = read_records(second)[1], read_records(first)[1]
    assert mine["prompt_hash"] != theirs["prompt_hash"]


def _header_only(tmp):
    clean_with(tmp, lambda path: path.write_text(json.dumps(header("pld", "mtbench")) + "\n"))
    return report_args(tmp)


def _header_only_summary(tmp):
    _header_only(tmp)
    return summary_args(tmp)


def _duplicate(tmp):
    def edit(path):
        lines = path.read_text().splitlines()
        faster = json.loads(lines[1])
        faster["decode_time"] = 0.05  # the same turn again, faster: it would lift the speedup
        path.write_text("\n".join(lines + [json.dumps(faster)]) + "\n")
    clean_with(tmp, edit)
    return report_args(tmp)


def _duplicate_summary(tmp):
    _duplicate(tmp)
    return summary_args(tmp)


def _long_prompt(tmp):
    return run_args(tiny_task(tmp, turns=("hello " * 9000,)), tmp)


def _no_records(tmp, result):
    assert not list((tmp / "results").rglob("*.jsonl"))


def _tag(tag: str, program: str = "bench"):
    def prepare(tmp):
        task = tiny_task(tmp)
        if program == "grid":
            return ["--tag", tag, "--task", "mtbench", "--results-dir", str(tmp / "results"), "--dry-run"]
        return run_args(task, tmp, "--tag", tag)
    return prepare


def _mixed_repeats(tmp):
    keys = [("1", 1), ("1", 2), ("2", 1), ("2", 2)]
    for tag, ar_decode, tokens in (("t", 0.9, 10), ("t.rep2", 1.9, 20)):  # pass 2 ran with other settings
        write_run(tmp / "results", "mtbench", "ar", tag, [turn(q, n, decode=ar_decode) for q, n in keys],
                  max_new_tokens=tokens)
        write_run(tmp / "results", "mtbench", "pld", tag, [turn(q, n, decode=0.4, draft=0.1, verify=0.3, exact=True,
                                                                **PLD_ROUNDS) for q, n in keys], max_new_tokens=tokens)
    return report_args(tmp)


def _mixed_repeats_summary(tmp):
    _mixed_repeats(tmp)
    return summary_args(tmp)


def _string_ttft(tmp):
    def edit(path):
        lines = path.read_text().splitlines()
        bad = json.loads(lines[1])
        bad["ttft"] = "0.5"
        path.write_text("\n".join([lines[0], json.dumps(bad)] + lines[2:]) + "\n")
    clean_with(tmp, edit)
    return report_args(tmp)


def _string_ttft_summary(tmp):
    _string_ttft(tmp)
    return summary_args(tmp)


def _no_text_on_resume(tmp):
    def edit(lines):
        del lines[1]["text"]
        return [json.dumps(x) for x in lines]
    return from_recorded(tmp, edit)


def _redone(kind: str):
    def check(tmp, result):
        path = ar_records(tmp, tmp / "tiny.jsonl")
        run = RunFile(path)
        assert [p.kind for p in run.problems] == [kind]  # the damaged line stays, named
        assert len(run.turns) == 1 and run.turns[0]["text"]  # and the turn was decoded again
    return check


def _lock_read_only(tmp):
    return run_args(tiny_task(tmp), tmp)


def _disk_full(tmp):
    return run_args(tiny_task(tmp), tmp)


def _whole_lines_only(tmp, result):
    path = ar_records(tmp, tmp / "tiny.jsonl")  # the failed append (header and turn) was cut back
    assert not path.exists() or path.read_bytes() == b""


def _report_into_a_file(tmp):
    clean_with(tmp)
    (tmp / "out").write_text("a file where the report folder should be")
    return report_args(tmp)


def _report_disk_full(tmp):
    clean_with(tmp)
    (tmp / "out").mkdir()
    (tmp / "out" / "report.html").write_text("the last report")
    return report_args(tmp)


def _last_report_kept(tmp, result):
    assert [p.name for p in (tmp / "out").rglob("*")] == ["report.html"]
    assert (tmp / "out" / "report.html").read_text() == "the last report"
    assert not list(tmp.glob(".out.partial*"))


def _full_on_write(monkeypatch, tmp):
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if ".partial" in str(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", write_text)


def _readme_full(tmp):
    clean_with(tmp)
    (tmp / "README.md").write_text("<!-- grid:start -->\nold\n<!-- grid:end -->\n")
    keep_copy(tmp / "README.md", tmp)
    return summary_args(tmp) + ["--readme", "grid", "--readme-path", str(tmp / "README.md")]


def _readme_kept(tmp, result):
    assert (tmp / "README.md").read_bytes() == (tmp / "before").read_bytes() and not (tmp / "README.tmp").exists()


def _full_on_tmp(monkeypatch, tmp):
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.suffix == ".tmp":
            real(self, "half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", write_text)


def _read_only_out(monkeypatch, tmp):
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if ".partial" in str(self):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", mkdir)


def _not_utf8(tmp):
    def edit(path):
        lines = path.read_bytes().split(b"\n")
        lines[2] = lines[2].replace(b'"x"', b'"caf\xe9"')  # one Latin-1 byte in one turn's text
        path.write_bytes(b"\n".join(lines))
    clean_with(tmp, edit)
    return report_args(tmp)


def _not_utf8_summary(tmp):
    _not_utf8(tmp)
    return summary_args(tmp)


def _not_utf8_on_resume(tmp):
    def edit(lines):
        damaged = json.dumps(lines[1]).encode().replace(b'"text": "', b'"text": "caf\xe9 ')
        return [json.dumps(lines[0]), damaged + b"\n"]
    return from_recorded(tmp, edit)


def _report_shows(*fragments: str) -> Callable[[Path, object], None]:
    def check(tmp, result):
        assert result.exit_code == 0
        for fragment in fragments:
            assert fragment in result.stdout, result.stdout
    return check


def _summary_shows(fragment: str, turns: int = 4) -> Callable[[Path, object], None]:
    def check(tmp, result):
        row = next(line for line in result.stdout.splitlines() if line.startswith("| mtbench | pld |"))
        assert f"| {turns} |" in row and fragment in row and "nanx" not in row, row
    return check


def _export_into_full_folder(tmp):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    return ["export", "--method", "eagle3", "--format", "eagle", "--out", str(tmp / "out")]


def _export_kept(tmp, result):
    assert [p.name for p in (tmp / "out").iterdir()] == ["keep.txt"]


def _null_question(tmp):
    path = tmp / "null.jsonl"
    path.write_text(json.dumps({"question_id": None, "turns": ["Say hi."]}) + "\n")
    return path


def _export_over(tmp):
    results = clean_with(tmp)
    (tmp / "out.jsonl").write_text("mine")
    return ["export", "--format", "specbench", "--run", str(results / TARGET / "mtbench" / "pld-t.jsonl"),
            "--out", str(tmp / "out.jsonl")]


def _export_over_kept(tmp, result):
    assert (tmp / "out.jsonl").read_text() == "mine" and not (tmp / "out-baseline.jsonl").exists()


def _answers(tmp, question_id: object = 1, **choice):
    """A one-question Spec-Bench answer file, its choice's fields overridden by `choice`."""
    row = {"question_id": question_id, "category": "chat", "model_id": "m",
           "choices": [{"index": 0, "turns": ["hi"], "new_tokens": [4], "wall_time": [0.5], **choice}]}
    path = tmp / "answers.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return ["import", str(path), "--format", "specbench", "--target", TARGET, "--task", "mtbench", "--method", "pld",
            "--results-dir", str(tmp / "results")]


def _no_import(tmp, result):
    assert not (tmp / "results").exists()


def _train(*extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["train", "--method", "eagle", "--out", str(tmp / "run"), *extra]


def _distill(*extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["distill", "--root", str(tmp / "distilled"), *extra]


def _a_file(tmp):
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def _target_folder(kind: str) -> Callable[[Path], list[str]]:
    """A --target folder: a malformed config.json, a config alone, or another model's weights."""
    def prepare(tmp):
        folder = tmp / "model"
        folder.mkdir()
        default = bench.core.target.cache_dir() / "targets" / "smollm2-135m-instruct"
        if kind == "malformed":
            (folder / "config.json").write_text("{not json")
        elif kind == "config only":
            shutil.copy(default / "config.json", folder / "config.json")
        else:  # the default target's config and tokenizer over weights of another shape
            for item in default.iterdir():
                if item.suffix != ".safetensors":
                    shutil.copy(item, folder / item.name)
            import torch
            from safetensors.torch import save_file

            save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, str(folder / "model.safetensors"))
        return ["run", "--method", "ar", "--task", str(tiny_task(tmp)), "--target", str(folder),
                "--results-dir", str(tmp / "results"), *QUICK]
    return prepare


def _foreign_in_ar(tmp):
    """A pld turn appended to AR's file (a new question): read as AR's, it would lift AR's τ."""
    results = clean_with(tmp)
    ar = results / TARGET / "mtbench" / "ar-t.jsonl"
    pld = [json.loads(line) for line in (results / TARGET / "mtbench" / "pld-t.jsonl").read_text().splitlines()]
    ar.write_text(ar.read_text() + json.dumps(dict(pld[1], question_id="3")) + "\n")
    return report_args(tmp)


def _tokens_replaced(tmp):
    """A turn's tokens replaced, its stored exact_match left true."""
    def edit(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[1]["tokens"] = [9] * len(rows[1]["tokens"])
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    clean_with(tmp, edit)
    return report_args(tmp)


def _both_packed_and_plain(tmp):
    """X.jsonl (1 turn) beside X.jsonl.gz (2 turns): packing must not lose the 2."""
    import gzip

    results = clean_with(tmp)
    ar = results / TARGET / "gsm8k" / "ar-t.jsonl"
    longer = ar.read_bytes() + (results / TARGET / "gsm8k" / "ar-t.jsonl").read_bytes().splitlines(True)[1] \
        .replace(b'"question_id": "1"', b'"question_id": "2"')
    ar.with_name("ar-t.jsonl.gz").write_bytes(gzip.compress(longer, mtime=0))
    keep_copy(ar.with_name("ar-t.jsonl.gz"), tmp)
    return ["pack", str(ar)]


def _empty_question_id(tmp):
    path = tmp / "empty.jsonl"
    path.write_text(json.dumps({"question_id": " ", "turns": ["Say hi."]}) + "\n")
    return run_args(path, tmp)


def _bom_task(tmp):
    path = tiny_task(tmp)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    return run_args(path, tmp)


def _no_time(tmp):
    """A turn whose tokens took no time at all: its tok/s would be infinite."""
    def edit(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[1].update(ttft=0.0, decode_time=0.0)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    clean_with(tmp, edit)
    return report_args(tmp)


def _other_settings(tmp):
    """pld's MT-bench records made at another max_new_tokens than their baseline."""
    def edit(path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[0]["settings"]["max_new_tokens"] = 8
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return clean_with(tmp, edit)


def _unpaired_report(tmp, result):
    assert result.exit_code == 0
    html = (tmp / "out" / "report.html").read_text()
    assert "unpaired" in html and "max_new_tokens 8" in html


def _unpaired_summary(tmp, result):
    row = next(line for line in result.stdout.splitlines() if line.startswith("| mtbench | pld |"))
    assert "2.00x" not in row and "unpaired" in result.stderr


CASES = {
    "0 report: a pld line in AR's file set aside": Case(
        "bench", _foreign_in_ar, 0, "foreign turn", _report_shows("| ar | 5 | 1.00 |")),
    "0 report: tokens replaced under a true exact_match flag": Case(
        "bench", _tokens_replaced, 0, "flag disagrees",
        _report_shows("| pld | 5 | 3.00 | 2.40x", "| 80% (0 near ties, 1 mismatches) |")),
    "0 report: a turn decoded in zero seconds left out": Case(
        "bench", _no_time, 0, "tokens decoded in zero seconds", _report_shows("| pld | 4 |")),
    "0 pack: a plain file beside a packed one it did not grow from": Case(
        "bench", _both_packed_and_plain, 0, "hold different lines",
        unchanged(lambda tmp: tmp / "results" / TARGET / "gsm8k" / "ar-t.jsonl.gz")),
    "0 run: empty question_id in the task": Case("bench", _empty_question_id, 2, "needs a 'question_id'", _no_records),
    "0 run: a task file that starts with a UTF-8 BOM": Case(
        "bench", _bom_task, 0, "", lambda tmp, result: ar_records(tmp, tmp / "tiny.jsonl").exists(), model=True),
    "0 report: method and baseline at other settings not paired": Case(
        "bench", lambda tmp: (_other_settings(tmp), report_args(tmp))[1], 0, "", _unpaired_report),
    "0 summary: method and baseline at other settings not paired": Case(
        "summary", lambda tmp: (_other_settings(tmp), summary_args(tmp))[1], 0, "unpaired", _unpaired_summary),
    "0 export specbench: method and baseline at other settings": Case(
        "bench", lambda tmp: ["export", "--format", "specbench", "--run",
                              str(_other_settings(tmp) / TARGET / "mtbench" / "pld-t.jsonl"), "--out",
                              str(tmp / "out.jsonl")], 2, "max_new_tokens 8",
        lambda tmp, r: not (tmp / "out.jsonl").exists()),
    # 0. records verified, not trusted: option ranges before anything loads, one line each
    "0 train: --lr nan": Case("bench", _train("--lr", "nan"), 2, "--lr must be a finite"),
    "0 train: an unknown training option": Case("bench", _train("--option", "blocks=3"), 2,
                                                "unknown eagle training option 'blocks'"),
    "0 train: --epochs inf": Case("bench", _train("--epochs", "inf"), 2, "--epochs must be a finite"),
    "0 train: --out a file": Case("bench", lambda tmp: ["train", "--method", "eagle", "--out", str(_a_file(tmp))], 2,
                                  "is a file, not a training folder"),
    "0 distill: --shards 5:2": Case("bench", _distill("--shards", "5:2"), 2, "names no shard"),
    "0 distill: --tokens -5": Case("bench", _distill("--tokens", "-5"), 2, "--tokens must be a positive"),
    "0 distill: --tokens nan": Case("bench", _distill("--tokens", "nan"), 2, "--tokens must be a positive"),
    "0 distill: --root a file": Case("bench", lambda tmp: ["distill", "--root", str(_a_file(tmp))], 2,
                                     "is a file, not a folder"),
    "0 distill: --device tpu": Case("bench", _distill("--device", "tpu"), 2, "device 'tpu'"),
    "0 import: --method nosuchmethod": Case(
        "bench", lambda tmp: [*_answers(tmp)[:-3], "nosuchmethod", *_answers(tmp)[-2:]], 2,
        "unknown method 'nosuchmethod'", _no_import),
    "0 import: wall_time 0": Case("bench", lambda tmp: _answers(tmp, wall_time=[0.0]), 2, "a time must be > 0",
                                  _no_import),
    "0 import: new_tokens 10^12": Case("bench", lambda tmp: _answers(tmp, new_tokens=[10 ** 12]), 2,
                                       "more than any turn decodes", _no_import),
    "0 import: question_id null": Case("bench", lambda tmp: _answers(tmp, question_id=None), 2, "no question_id",
                                       _no_import),
    "0 run: question_id null in the task": Case(
        "bench", lambda tmp: run_args(_null_question(tmp), tmp), 2, "needs a 'question_id'", _no_records),
    "0 run: --budget 10^9 for pld": Case(
        "bench", lambda tmp: [*run_args(tiny_task(tmp), tmp)[:2], "pld", *run_args(tiny_task(tmp), tmp)[3:],
                              "--budget", "1000000000"], 2, "at most 1024", _no_records),
    "0 run: --budget 20000 for eagle2": Case(
        "bench", lambda tmp: [*run_args(tiny_task(tmp), tmp)[:2], "eagle2", *run_args(tiny_task(tmp), tmp)[3:],
                              "--budget", "20000"], 2, "at most 116", _no_records),
    "0 run: --drafter that is no folder": Case(
        "bench", lambda tmp: [*run_args(tiny_task(tmp), tmp)[:2], "eagle", *run_args(tiny_task(tmp), tmp)[3:],
                              "--drafter", str(tmp / "nowhere")], 2, "is not a folder", _no_records),
    "0 tune: --method ar": Case("bench", lambda tmp: ["tune", "--method", "ar", "--results-dir", str(tmp)], 2,
                                "ar has no draft budget"),
    "0 summary: no records exits 2": Case("summary", lambda tmp: (clean_with(tmp), [
        "--results-dir", str(tmp / "results"), "--target", TARGET, "--tag", "nosuchtag"])[1], 2, "no records for"),
    "0 export specbench: the answer file exists": Case("bench", lambda tmp: _export_over(tmp), 2,
                                                       "give --force to replace it", _export_over_kept),
    "0 run: --target with a malformed config.json": Case("bench", _target_folder("malformed"), 2,
                                                         "unreadable config.json", model=True),
    "0 run: --target with a config alone": Case("bench", _target_folder("config only"), 2, "has no tokenizer",
                                                model=True),
    "0 run: --target with another model's weights": Case("bench", _target_folder("other weights"), 2,
                                                         "the weights are another model's", model=True),
    # 1. resume checks the prompt; custom tasks are keyed by their content
    "1 resume: turn recorded for another prompt": Case(
        "bench", _prompt_changed, 2, "was recorded for another prompt",
        unchanged(lambda tmp: ar_records(tmp, tmp / "tiny.jsonl")), model=True),
    "1 custom mtbench.jsonl: records of its own": Case(
        "bench", _custom_named_like_a_suite, 0, "", _custom_check, model=True),
    "1 two questions.jsonl files: records of their own": Case(
        "bench", _two_files_one_name, 0, "", _two_files_check, model=True),
    # 2. a header-only file (Ctrl-C in a method's first turn)
    "2 report: header-only file listed, left out": Case(
        "bench", _header_only, 0, "empty: ", _report_shows("| pld | 1 | 3.00 | 4.00x")),
    "2 summary: header-only file, no NaN row": Case(
        "summary", _header_only_summary, 0, "header only",
        lambda tmp, result: "| mtbench | pld |" not in result.stdout and "nan" not in result.stdout),
    "2+12 run: Ctrl-C in the first turn leaves no header": Case(
        "bench", lambda tmp: run_args(tiny_task(tmp), tmp), 130, "interrupted", _no_records,
        patch=interrupt("turn"), model=True),
    # 3. a duplicated turn line
    "3 report: duplicate flagged, counted once": Case(
        "bench", _duplicate, 0, "duplicate: ", _report_shows("| pld | 5 | 3.00 | 2.40x")),
    "3 summary: duplicate flagged, counted once": Case(
        "summary", _duplicate_summary, 0, "duplicate", _summary_shows("| 2.00x [")),
    # 4. prompt + max_new_tokens beyond the context
    "4 run: prompt beyond the context": Case(
        "bench", _long_prompt, 2, "question q1 turn 1: its prompt (9031 tokens)", _no_records, model=True),
    # 5. the repeat suffix is reserved; repeats pool only with equal settings
    "5 run: --tag x.rep2": Case("bench", _tag("x.rep2"), 2, "ends in 'rep<k>'", _no_records),
    "5 run: --tag rep3": Case("bench", _tag("rep3"), 2, "ends in 'rep<k>'", _no_records),
    "5 run: --tag a/b": Case("bench", _tag("a/b"), 2, "cannot be part of a file name", _no_records),
    "5 grid: --tag g.r2": Case("grid", _tag("g.r2", "grid"), 2, "ends in '.r<N>'"),
    "5 report: repeat with other settings not pooled": Case(
        "bench", _mixed_repeats, 0, "mixed settings: ", _report_shows("| pld | 4 | 3.00 | 2.00x")),
    "5 summary: repeat with other settings not pooled": Case(
        "summary", _mixed_repeats_summary, 0, "mixed settings", _summary_shows("| 2.00x [")),
    # 6. field types checked on read
    "6 report: \"ttft\": \"0.5\"": Case(
        "bench", _string_ttft, 0, "ttft is not seconds", _report_shows("| pld | 4 |")),
    "6 summary: \"ttft\": \"0.5\"": Case(
        "summary", _string_ttft_summary, 0, "ttft is not seconds", _summary_shows("| 2.00x [", turns=3)),
    "6 run: resume over a turn without text": Case(
        "bench", _no_text_on_resume, 0, "missing text", _redone("malformed turn"), model=True),
    # 7. file-system errors
    "7 run: read-only file system at the lock": Case(
        "bench", _lock_read_only, 2, "Read-only file system", _no_records, patch=fail_open(".lock", errno.EROFS)),
    "7 run: disk full during an append": Case(
        "bench", _disk_full, 2, "No space left on device", _whole_lines_only, patch=disk_full_on_append,
        model=True),
    "7 report --out: a file": Case("bench", _report_into_a_file, 2, "cannot write the report to"),
    "7 report --out: disk full": Case(
        "bench", _report_disk_full, 2, "No space left on device", _last_report_kept, patch=_full_on_write),
    "7 summary --readme: disk full": Case(
        "summary", _readme_full, 2, "cannot write", _readme_kept, patch=_full_on_tmp),
    "7 report --out: read-only": Case(
        "bench", _report_disk_full, 2, "Read-only file system", _last_report_kept, patch=_read_only_out),
    # 9. one non-UTF-8 byte: that line only
    "9 report: non-UTF-8 line left out, file kept": Case(
        "bench", _not_utf8, 0, "not UTF-8", _report_shows("| pld | 4 |")),
    "9 summary: non-UTF-8 line left out, file kept": Case(
        "summary", _not_utf8_summary, 0, "not UTF-8", _summary_shows("| 2.00x [", turns=3)),
    "9 run: resume over a non-UTF-8 line": Case(
        "bench", _not_utf8_on_resume, 0, "not UTF-8", _redone("corrupt"), model=True),
    # 11. NaN passes range checks
    "11 run: --temperature nan": Case(
        "bench", lambda tmp: run_args(tiny_task(tmp), tmp, "--temperature", "nan"), 2,
        "--temperature must be a finite number", _no_records),
    "11 run: --top-p nan": Case(
        "bench", lambda tmp: run_args(tiny_task(tmp), tmp, "--top-p", "nan"), 2, "--top-p must be a finite number",
        _no_records),
    # 12. the lock first; Ctrl-C is 130
    "12 run: second writer refused before the model loads": Case(
        "bench", lambda tmp: run_args(tiny_task(tmp), tmp), 2, "being written by another run", patch=hold_lock),
    "12 run: Ctrl-C exits 130": Case(
        "bench", lambda tmp: run_args(tiny_task(tmp), tmp), 130, "interrupted", _no_records, patch=interrupt("load")),
    # 13. export: a layout the method lacks, a folder that holds something
    "13 export: pld has no published layout": Case(
        "bench", lambda tmp: ["export", "--method", "pld", "--format", "speculators", "--out", str(tmp / "out")], 2,
        "pld exports to no published format", lambda tmp, result: not (tmp / "out").exists()),
    "13 export: out folder not empty": Case(
        "bench", _export_into_full_folder, 2, "exists and is not empty", _export_kept),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, monkeypatch, recorded):
    case = CASES[name]
    _RECORDED[:] = [recorded]
    monkeypatch.chdir(tmp_path)
    args = case.prepare(tmp_path)
    if not case.model:  # errors that need no model are found before it loads
        def refuse(*a, **k):
            raise AssertionError("the target model was loaded")
        monkeypatch.setattr(bench.core.target, "load_target", refuse)
    case.patch(monkeypatch, tmp_path)
    program = {"bench": bench_main, "summary": summary_main, "grid": grid_main}[case.program]
    try:
        result = CliRunner().invoke(program, args)
    finally:
        while _OPEN:
            os.close(_OPEN.pop())
        monkeypatch.undo()  # os and Path as they were before the checks read the files
    assert result.exit_code == case.code, (result.output, result.exception)
    said = [line for line in result.stderr.replace("\r", "\n").splitlines() if line and "turn/s]" not in line]
    if case.code == 2:  # one line (beside the progress bar of a run that got that far), no traceback
        assert result.stdout == "" and len(said) == 1 and said[0].startswith("error: "), result.output
    if case.code == 130:
        assert said[-1].startswith("interrupted")
    assert case.stderr in result.stderr, result.stderr
    assert "Traceback" not in result.output
    case.check(tmp_path, result)
