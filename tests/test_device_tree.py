"""scripts.device_tree: a slim tree carries no heavy folder, blocks commits, and restores exactly."""

import subprocess
from pathlib import Path

import click
import pytest

from scripts.device_tree import restore, slim, travelling


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name, size in {"bench/a.py": 10, "results/r.jsonl": 1000, "methods/checkpoints/m/w.bin": 5000,
                       "methods/sps.py": 20, "plots/report.html": 300}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    _git(tmp_path, "init", "-q")
    (tmp_path / ".git" / "info").mkdir(exist_ok=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("# a user's own line\n*.tmp")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return tmp_path


def test_slim_then_restore(repo: Path) -> None:
    before = travelling(repo)
    assert before == {"bench": 10, "results": 1000, "methods": 5020, "plots": 300}
    assert slim(repo) == ["methods/checkpoints", "results", "plots"]
    assert travelling(repo) == {"bench": 10, "methods": 20}
    assert (repo / "results" / "r.jsonl").stat().st_size == 1000  # the files stay on disk
    (repo / "bench" / "b.py").write_text("new")
    _git(repo, "add", "bench/b.py")
    commit = _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "oops")
    assert commit.returncode != 0 and "restore" in commit.stderr  # a commit now would delete the folders
    _git(repo, "reset", "-q", "--", "bench/b.py")
    with pytest.raises(click.ClickException, match="already slim"):
        slim(repo)
    assert restore(repo) == ["methods/checkpoints", "results", "plots"]
    assert travelling(repo) == {**before, "bench": 13}  # the new, untracked file travels as before
    assert _git(repo, "status", "--porcelain").stdout == "?? bench/b.py\n"
    assert (repo / ".git" / "info" / "exclude").read_text() == "# a user's own line\n*.tmp\n"
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    assert restore(repo) == []  # twice is harmless


def test_slim_refuses_staged_changes(repo: Path) -> None:
    (repo / "results" / "r.jsonl").write_text("changed")
    _git(repo, "add", "results/r.jsonl")
    with pytest.raises(click.ClickException, match="staged"):
        slim(repo)
    assert not (repo / ".git" / "device-slim.json").exists()
