"""What a call to a lent GPU machine would carry from this checkout, and a slim tree that fits.

The device tool sends the checkout's tracked files and its untracked files that git does not
ignore (and the paths a call names in `carry`), at most 64 MiB in all. The shipped drafters,
the records and the reports make this repository about 150 MB, so a call from it as it is
fails. `slim` takes the heavy folders out of the index and adds them to .git/info/exclude:
their files stay on disk, untouched, and no longer travel. `restore` puts both back. Neither
commits anything; `slim` refuses while changes are staged, and while the tree is slim a
pre-commit hook refuses commits (one would delete those folders from the branch).

    python -m scripts.device_tree size       # MiB that would travel now, by top folder
    python -m scripts.device_tree slim       # before the device calls
    python -m scripts.device_tree restore    # after them (safe to run twice)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click

LIMIT_BYTES = 64 * 2**20
HEAVY = ("methods/checkpoints", "results", "plots")  # what a GPU call does not read (carry a drafter if one does)
MARK = "# scripts.device_tree slim"
HOOK = (f"#!/bin/sh\n{MARK}\n"
        "echo 'the tree is slim for a device call: python -m scripts.device_tree restore first' >&2\nexit 1\n")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout


def _git_dir(root: Path) -> Path:
    return (root / _git(root, "rev-parse", "--git-dir").strip()).resolve()


def _hook(root: Path) -> Path:
    """The pre-commit hook git runs here (core.hooksPath respected)."""
    return (root / _git(root, "rev-parse", "--git-path", "hooks/pre-commit").strip()).resolve()


def travelling(root: Path) -> dict[str, int]:
    """Bytes that a device call would carry, per top-level entry (files missing on disk skipped)."""
    sizes: dict[str, int] = {}
    for name in _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        path = root / name
        if name and path.is_file() and not path.is_symlink():
            top = name.split("/", 1)[0]
            sizes[top] = sizes.get(top, 0) + path.stat().st_size
    shared = root / "shared"  # travels whole where the checkout has one
    if shared.is_dir() and "shared" not in sizes:
        sizes["shared"] = sum(p.stat().st_size for p in shared.rglob("*") if p.is_file() and not p.is_symlink())
    return sizes


def slim(root: Path, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """Untrack `heavy` in the index and exclude it; return the folders taken out."""
    git_dir = _git_dir(root)
    state = git_dir / "device-slim.json"
    if state.exists():
        raise click.ClickException("the tree is already slim (python -m scripts.device_tree restore undoes it)")
    if subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=root).returncode != 0:
        raise click.ClickException("changes are staged: commit or unstage them first (restore resets the index)")
    taken = [p for p in heavy if _git(root, "ls-files", "--", p).strip()]
    hook = _hook(root)
    if hook.exists() and MARK not in hook.read_text():
        raise click.ClickException(f"{hook} exists: this script will not replace it")
    state.write_text(json.dumps({"folders": taken}))
    for folder in taken:
        _git(root, "rm", "-r", "-q", "--cached", "--", folder)
    exclude = git_dir / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    kept = exclude.read_text() if exclude.exists() else ""
    if kept and not kept.endswith("\n"):
        kept += "\n"
    exclude.write_text(kept + f"{MARK}: begin\n" + "".join(f"/{folder}/\n" for folder in taken) + f"{MARK}: end\n")
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(HOOK)
    hook.chmod(0o755)
    return taken


def restore(root: Path) -> list[str]:
    """Undo `slim` (the index entries from HEAD, the exclude lines, the hook); [] if not slim."""
    git_dir = _git_dir(root)
    state = git_dir / "device-slim.json"
    if not state.exists():
        return []
    taken = json.loads(state.read_text())["folders"]
    if taken:
        _git(root, "reset", "-q", "--", *taken)
    exclude = git_dir / "info" / "exclude"
    if exclude.exists():
        lines, inside = [], False
        for line in exclude.read_text().splitlines(keepends=True):
            if line.startswith(MARK):
                inside = line.rstrip().endswith("begin")
            elif not inside:
                lines.append(line)
        exclude.write_text("".join(lines))
    hook = _hook(root)
    if hook.exists() and MARK in hook.read_text():
        hook.unlink()
    state.unlink()
    return taken


def _report(root: Path) -> None:
    sizes = travelling(root)
    total = sum(sizes.values())
    for top, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:12]:
        click.echo(f"{size / 2**20:8.1f} MiB  {top}")
    verdict = "fits" if total <= LIMIT_BYTES else "over the limit: python -m scripts.device_tree slim"
    click.echo(f"{total / 2**20:8.1f} MiB would travel ({verdict}; limit {LIMIT_BYTES // 2**20} MiB with carry)")


@click.command()
@click.argument("action", type=click.Choice(["size", "slim", "restore"]))
@click.option("--root", default=".", show_default=True, help="the checkout")
def main(action: str, root: str) -> None:
    path = Path(root).resolve()
    if action == "slim":
        click.echo(f"untracked and excluded for the device calls: {', '.join(slim(path)) or 'nothing'}")
    elif action == "restore":
        click.echo(f"restored: {', '.join(restore(path)) or 'nothing (the tree was not slim)'}")
    _report(path)


if __name__ == "__main__":
    sys.exit(main())
