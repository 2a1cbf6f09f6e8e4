"""kill -9 at each point of a run, then the same command again: the same tokens as a run
never killed, every turn once, none lost. The points: the target's prefill, the middle of a
turn (a verification pass), halfway through appending a record, and `bench pack` between
writing the packed copy and removing the plain file (the kernel build's is in
tests/test_cpu_kernels.py). Each killed process is the real `bench run` with one function
wrapped to kill itself there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TASK = [{"question_id": "q1", "category": "chat", "turns": ["Say hi.", "And again?"]},
        {"question_id": "q2", "category": "chat", "turns": ["Count to three."]}]

# Wrappers run inside the child before `bench run`: each kills the process at its point.
KILLERS = {
    "prefill": """
import bench.core.engine as e
real = e.Engine.prefill
calls = [0]
def prefill(self, *a, **k):
    calls[0] += 1
    if calls[0] == 3:  # the second turn's first pass
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
e.Engine.prefill = prefill
""",
    "mid-turn": """
import bench.core.engine as e
real = e.Engine.forward
calls = [0]
def forward(self, *a, **k):
    calls[0] += 1
    if calls[0] == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
e.Engine.forward = forward
""",
    "append": """
import bench.records as r
real = os.write
appends = [0]
def write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").endswith("pld.jsonl"):
        appends[0] += 1
        if appends[0] == 2:  # halfway through the second turn's line
            real(fd, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, data)
r.os.write = write
""",
}


def bench(tmp: Path, args: list[str], killer: str = "") -> subprocess.CompletedProcess:
    code = f"import os, signal, sys\n{killer}\nfrom bench.cli import main\nsys.argv = ['bench', *{args!r}]\nmain()"
    env = dict(os.environ, BENCH_JEMALLOC="0")
    return subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=600)


def run_args(tmp: Path, results: str) -> list[str]:
    return ["run", "--method", "pld", "--task", str(tmp / "tiny.jsonl"), "--results-dir", str(tmp / results),
            "--device", "cpu", "--max-new-tokens", "12"]


def turns(path: Path) -> list[tuple[str, int, list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["question_id"], r["turn"], r["tokens"]) for r in rows if r["type"] == "turn"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory, default_target):
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "tiny.jsonl").write_text("".join(json.dumps(q) + "\n" for q in TASK))
    done = bench(tmp, run_args(tmp, "clean"))
    assert done.returncode == 0, done.stderr[-2000:]
    return tmp


def records(tmp: Path, results: str, method: str) -> Path:
    return next((tmp / results).glob(f"*/tiny*/{method}.jsonl"))


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("point", list(KILLERS))
def test_a_run_killed_anywhere_resumes_to_the_same_tokens(clean, point):
    killed = bench(clean, run_args(clean, point), KILLERS[point])
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = bench(clean, run_args(clean, point))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for method in ("pld", "ar"):
        got, want = turns(records(clean, point, method)), turns(records(clean, "clean", method))
        assert sorted(got) == sorted(want)  # every turn once, none lost, the same tokens


def test_pack_killed_before_removing_the_plain_file_packs_again(clean):
    from bench.records import packed_path

    path = records(clean, "clean", "ar")
    before = path.read_bytes()
    killer = """
import bench.records as r
real = r.write_bytes
def write_bytes(path, data):
    real(path, data)
    os.kill(os.getpid(), signal.SIGKILL)
r.write_bytes = write_bytes
"""
    killed = bench(clean, ["pack", str(path)], killer)
    assert killed.returncode == -9 and path.exists() and packed_path(path).exists()
    again = bench(clean, ["pack", str(path)])
    assert again.returncode == 0, again.stderr
    assert not path.exists()
    import gzip

    assert gzip.decompress(packed_path(path).read_bytes()) == before
