"""Prose that cannot drift: every dotted name of the project (`bench.report.tables.contended_turns`)
and every repository path (`bench/core/verify.py`, `methods/mtp/model.FUSE_ORDERS`) that the
Markdown files, the Makefile's comments and the code's comments and docstrings mention
resolves to something that exists. Placeholders are written in capitals or angle brackets
(`methods.M`, `plots/SERIES`, `results/<target>/`)."""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "methods", "scripts", "tasks")
DOTTED = re.compile(r"(?<![\w./-])((?:bench|methods|scripts|tasks)(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"(?<![\w./-])((?:bench|methods|scripts|tasks|tests|results|plots)/[\w./-]*\w)")
EXTENSIONS = (".py", ".md", ".json", ".jsonl", ".cpp", ".txt", ".gz", ".csv", ".png", ".svg", ".html", ".bf16",
              ".safetensors", ".tex", ".yaml", ".toml")


def tracked() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # generated record series and tests' own fixtures (made-up paths) are not prose
    return [ROOT / n for n in names if (n.endswith((".md", ".py")) or n == "Makefile")
            and not n.startswith(("results/smollm2-135m/", "tests/", "plots/"))]


def prose(path: Path) -> str:
    """The text a reader takes as documentation: Markdown whole; the Makefile's comments; a
    Python file's comments and docstrings (not its code)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".md":
        return text
    if path.name == "Makefile":
        return "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    parts = []
    previous = tokenize.INDENT
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            parts.append(token.string)
        elif token.type == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL,
                                                             tokenize.DEDENT):
            parts.append(token.string)  # a string standing alone: a docstring
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    return "\n".join(parts)


def placeholder(name: str) -> bool:
    return any(part.isupper() or part in ("mine", "X") for part in re.split(r"[./]", name)) or \
        any(c in name for c in "<>*{}$")


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def path_exists(text: str) -> bool:
    if (ROOT / text).exists() or (ROOT / (text + ".py")).exists() or (ROOT / (text + ".md")).exists():
        return True
    folder, _, last = text.rpartition("/")
    module, dot, attr = last.partition(".")
    if dot and (ROOT / folder / (module + ".py")).exists():  # methods/mtp/model.FUSE_ORDERS
        return resolves(f"{folder.replace('/', '.')}.{module}.{attr}")
    return False


def test_every_name_and_path_in_the_prose_exists():
    dead = []
    for path in tracked():
        text = prose(path)
        where = path.relative_to(ROOT)
        for match in DOTTED.finditer(text):
            name = match.group(1)
            if name.endswith(EXTENSIONS) or placeholder(name) or resolves(name):
                continue
            dead.append(f"{where}: {name}")
        for match in PATH.finditer(text):
            name = match.group(1).rstrip(".")
            if placeholder(name) or path_exists(name):
                continue
            dead.append(f"{where}: {name}")
    assert not dead, "dead references:\n" + "\n".join(sorted(set(dead)))


WORK_LOG = re.compile(r"\b(?:issues?[ -]#?\d+|stops? \d+|sessions? \d+|(?:this|last|earlier|previous) session)\b",
                      re.IGNORECASE)


def test_no_issue_numbers_or_work_log_in_code_comments_or_the_makefile():
    """Code says why, not when: an issue or session belongs in the commit message."""
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in tracked()
             if path.suffix == ".py" or path.name == "Makefile"
             for match in WORK_LOG.finditer(prose(path))]
    assert not found, "\n".join(found)
