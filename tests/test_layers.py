"""The house's layers: imports run one way, core <- training <- methods/tasks <- harness <- scripts.

  bench/core/   engine, drafts, verification, the decode loop, targets, drafter I/O,
                the cost model: imports nothing else of the project
  bench/training/  what every trainer shares (features, self-distilled data, the loop,
                held-out replays): imports only the core
  methods/      one drafting method each: imports the core, training and its own package
  tasks/        evaluation suites: imports the core (and training)
  bench/        the harness (registry, run, records, metrics, grid, report, CLI)
  scripts/      GPU checks, comparisons, experiments: nothing imports them

Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "methods", "tasks", "scripts")


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def layer(module: str) -> tuple[int, str]:
    """(height, room) of a project module."""
    if module == "bench" or module.startswith("bench.core"):
        return 0, "core"
    if module == "bench.training" or module.startswith("bench.training."):
        return 1, "training"
    if module.split(".")[0] in ("methods", "tasks"):
        return 2, module.split(".")[0]
    if module.startswith("bench"):
        return 3, "harness"
    return 4, "scripts"


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` imports (a `from a import b` of a module b counts as a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
            found |= subs or {node.module}
    return found


def edges() -> list[tuple[str, str]]:
    modules = project_modules()
    return [(name, imported) for name, path in modules.items() for imported in sorted(imports(path, modules))
            if imported != name]


def test_no_module_imports_upward_or_sideways():
    wrong = []
    for source, imported in edges():
        (high, room), (target_high, target_room) = layer(source), layer(imported)
        if target_high > high or (target_high == high == 2 and room != target_room):
            wrong.append(f"{source} ({room}) imports {imported} ({target_room})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_files():
    graph: dict[str, set[str]] = {}
    for source, imported in edges():
        if not source.startswith(imported + "."):  # a module naming its own package is no cycle
            graph.setdefault(source, set()).add(imported)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule itself: a core module importing the harness is flagged."""
    assert layer("bench.core.engine") < layer("bench.training.loop") < layer("methods.pld") < layer("bench.run") \
        < layer("scripts.gpu_check")
    assert layer("methods.pld")[0] == layer("tasks")[0] == 2
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from bench.run import run\n    import methods.pld\n")
    modules = {"bench.run": probe, "methods.pld": probe}
    assert imports(probe, modules) == {"bench.run", "methods.pld"}
