"""`python -m bench.grid --ray`: on a real Ray head (127.0.0.1, two CPU workers) the grid
records what the in-process grid records (tokens, manifest) and resumes the same way; a
dead address is a one-line error that writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import bench.core.target
from bench.grid import main as grid_main
from bench.grid import run_grid
from bench.records import RunFile

METHODS = ["pld", "sps"]  # training-free, and the shipped draft model: both cheap on CPU
TOKENS = 8


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head of its own, two CPUs, on a free port; no token auth, so the test does not
    depend on a token left in ~/.ray. Stopped (its process group) after the module."""
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        env.setenv("OMP_NUM_THREADS", "1")
        head = subprocess.Popen(
            [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
             "--temp-dir", temp], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if head.poll() is not None or time.monotonic() > deadline:
                        pytest.fail("the Ray head did not start")
                    time.sleep(0.2)
            yield f"127.0.0.1:{port}"
        finally:
            head.terminate()  # `ray start --block` stops what it started
            try:
                head.wait(30)
            finally:
                try:
                    os.killpg(head.pid, signal.SIGKILL)  # anything of its group still there
                except ProcessLookupError:
                    pass
                shutil.rmtree(temp, ignore_errors=True)


def manifest(results: Path) -> dict:
    data = json.loads(next(results.glob("*/grid-g.json")).read_text())
    data.pop("updated_at")
    return data


def turns(results: Path) -> dict:
    """{(file, question, turn): what must not depend on where it was decoded}."""
    found = {}
    for path in sorted(results.rglob("*.jsonl")):
        for t in RunFile(path).turns:
            found[(str(path.relative_to(results)), t["question_id"], t["turn"])] = (
                t["tokens"], t["text"], t["prompt_hash"], t["accept_lengths"], t.get("exact_match"))
    return found


@pytest.mark.slow  # the slow tier (make test-slow)
def test_ray_grid_matches_the_in_process_grid_and_resumes(ray_head, tmp_path, tiny_task, one_thread):
    plan = {str(tiny_task): {}}

    def grid(results: Path, **ray) -> dict:
        cells = run_grid(plan, METHODS, "g", str(results), TOKENS, device="cpu", echo=lambda line: None, **ray)
        return {c.method: c.status for c in cells}

    local, remote = tmp_path / "local", tmp_path / "ray"
    assert grid(local) == {"pld": "ran", "sps": "ran", "ar": "baseline"}
    assert grid(remote, ray=ray_head, ray_cpus_per_cell=1) == {"pld": "ran", "sps": "ran", "ar": "baseline"}
    assert manifest(remote) == manifest(local)
    expected = turns(local)
    assert len(expected) == 9 and turns(remote) == expected  # ar, pld, sps: 3 turns each
    for path in remote.rglob("*.jsonl"):  # one header, from the worker, then the turns
        run = RunFile(path)
        assert not run.problems and len(run.headers) == 1
        assert run.headers[0]["settings"] == RunFile(local / path.relative_to(remote)).headers[0]["settings"]

    # An interrupted cell resumes on a worker: only its missing turn is decoded and appended
    # (after a header of its own), the finished cell is skipped.
    sps = next(remote.rglob("sps-g.jsonl"))
    sps.write_text("".join(sps.read_text().splitlines(keepends=True)[:-1]))
    assert grid(remote, ray=ray_head, ray_cpus_per_cell=1) == {"pld": "up to date (skipped)", "sps": "ran",
                                                              "ar": "baseline"}
    assert turns(remote) == expected and len(RunFile(sps).headers) == 2
    assert [c["status"] for c in manifest(remote)["cells"]] == ["up to date (skipped)", "ran", "baseline"]


@pytest.mark.parametrize("address", ["dead", "auto"])
def test_a_dead_ray_address_is_one_line(address, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target model was loaded")

    monkeypatch.setattr(bench.core.target, "load_target", refuse)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", dead)  # what `auto` finds
    args = ["--ray", dead if address == "dead" else "auto", "--task", "mtbench", "--limit", "1", "--method", "pld",
            "--results-dir", str(tmp_path / "results")]
    started = time.monotonic()
    result = CliRunner().invoke(grid_main, args)
    assert result.exit_code == 2, (result.output, result.exception)
    said = [line for line in result.stderr.splitlines() if line]
    assert len(said) == 1 and said[0].startswith(f"error: no Ray cluster answers at {args[1]} ("), said
    assert result.stdout == "" and not (tmp_path / "results").exists()
    assert time.monotonic() - started < 30
