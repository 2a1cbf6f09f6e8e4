"""Typed method options and `--budget`: bad options are one line (exit 2) before any model
loads, every method maps the budget to its own knobs, and runs record the resolved options."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Literal

import pytest
from click.testing import CliRunner

import bench.core.target
from bench import registry
from bench.cli import main
from bench.core.errors import BenchError
from bench.core.options import changed, draft_budget, option, parse_options
from bench.run import RunSettings, record_settings

# method -> (a wrong type, an out-of-range value or a non-choice), as `--option` text
BAD = {
    "pld": ("num_pred_tokens=abc", "num_pred_tokens=0"),
    "suffix": ("max_tree_depth=abc", "min_token_prob=2"),
    "lookahead": ("window=abc", "ngram=1"),
    "sps": ("gamma=abc", "schedule=fast"),
    "specinfer": ("widths=a,b", "widths=0,1"),
    "medusa": ("posterior_alpha=abc", "posterior_alpha=2"),
    "mtp": ("depth=1.5", "depth=17"),
    "eagle": ("tree_nodes=abc", "tree_nodes=0"),
    "eagle2": ("total_token=abc", "total_token=1"),
    "eagle3": ("top_k=[1]", "depth=0"),
    "dflash": ("block=abc", "block=0"),
    "ddtree": ("budget=abc", "budget=2000"),
    "dspark": ("threshold=abc", "schedule=always"),
}

# method -> the knobs --budget K sets, for K = 4, 8, 16
BUDGET = {
    "pld": lambda k: {"num_pred_tokens": k},
    "suffix": lambda k: {"max_spec_tokens": k},
    "lookahead": lambda k: {"ngram": 5, "window": k // 4, "guesses": k // 4},
    "sps": lambda k: {"gamma": k, "schedule": "constant"},
    "specinfer": lambda k: {"widths": {4: (1, 1, 1, 1), 8: (2, 1, 1, 1), 16: (4, 1, 1, 1)}[k]},
    "medusa": lambda k: {"tree_size": k, "choices": None},
    "mtp": lambda k: {"depth": k},
    "eagle": lambda k: {"tree_nodes": k, "paths": None},
    "eagle2": lambda k: {"total_token": k + 1, "depth": min(k, 8)},
    "eagle3": lambda k: {"total_token": k + 1, "depth": min(k, 8)},
    "dflash": lambda k: {"block": k},
    "ddtree": lambda k: {"budget": k},
    "dspark": lambda k: {"block": k, "schedule": "none"},
}

# What `make block-sweep` recorded before --budget (tags b4, b8, b16): --budget must give the same.
SWEEP = {
    "dflash": lambda k: {"block": k},
    "dspark": lambda k: {"block": k, "schedule": "none"},
    "ddtree": lambda k: {"budget": k},
    "eagle3": lambda k: {"total_token": k + 1, "depth": min(k, 8)},
    "mtp": lambda k: {"depth": k},
}

NO_OPTIONS = ("ar", "hf")


def test_every_method_is_covered():
    assert set(registry.METHODS) == set(BAD) | set(NO_OPTIONS) == set(BUDGET) | set(NO_OPTIONS)


@pytest.fixture
def no_target_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target model was loaded")

    monkeypatch.setattr(bench.core.target, "load_target", refuse)


def run_cli(tiny_task, method: str, *args: str):
    return CliRunner().invoke(main, ["run", "--method", method, "--task", str(tiny_task), *args])


def assert_one_line(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


@pytest.mark.parametrize("method", sorted(registry.METHODS))
def test_bad_options_fail_in_one_line_before_the_target_loads(method, tiny_task, no_target_load):
    cls = type(registry.resolve_options(method))
    names = [f.name for f in dataclasses.fields(cls)]
    listing = [f"{name} (" for name in names] or ["options: none"]
    assert_one_line(run_cli(tiny_task, method, "--option", "bogus=1"), f"unknown {method} option 'bogus'", *listing)
    for text in BAD.get(method, ()):
        key = text.split("=")[0]
        assert_one_line(run_cli(tiny_task, method, "--option", text), f"{method} option {key} must be", *listing)


@pytest.mark.parametrize("method", NO_OPTIONS)
def test_ar_and_hf_take_no_budget(method, tiny_task, no_target_load):
    assert_one_line(run_cli(tiny_task, method, "--budget", "4"), f"{method} takes no --budget")


@pytest.mark.parametrize("method", sorted(BUDGET))
def test_budget_sets_the_documented_knobs(method):
    cls = type(registry.resolve_options(method))
    for k in (4, 8, 16):
        options = registry.resolve_options(method, {}, k)
        assert {key: getattr(options, key) for key in BUDGET[method](k)} == BUDGET[method](k)
        assert draft_budget(options) == k  # and it reads back as the same budget
        if method in SWEEP:
            assert registry.recorded_options(method, {}, k) == SWEEP[method](k)
    hard = [key for key in BUDGET[method](4) if key not in getattr(cls, "BUDGET_SOFT", ())]
    with pytest.raises(BenchError, match=f"--budget 4 sets .*{hard[0]}") as info:
        registry.resolve_options(method, {hard[0]: getattr(registry.resolve_options(method), hard[0])}, 4)
    assert "\n" not in str(info.value)


def test_defaults_are_unchanged_and_recorded_as_nothing():
    defaults = {
        "pld": {"max_ngram": 3, "num_pred_tokens": 10},
        "lookahead": {"ngram": 5, "window": 7, "guesses": 7, "seed": 0},
        "sps": {"gamma": 3, "schedule": "constant", "max_gamma": 16, "draft_dtype": "bfloat16"},
        "specinfer": {"widths": (2, 2, 2, 1), "mode": "topk"},
        "medusa": {"tree_size": "auto", "choices": None, "acceptance": "exact", "posterior_threshold": 0.09,
                   "posterior_alpha": 0.3},
        "mtp": {"variant": None, "depth": None, "sample": False, "draft_dtype": "bfloat16"},
        "eagle": {"tree_nodes": 10, "paths": None, "dtype": "bfloat16"},
        "eagle2": {"total_token": 12, "depth": 5, "top_k": 4, "dtype": "bfloat16"},
        "eagle3": {"total_token": 12, "depth": 5, "top_k": 4, "dtype": "bfloat16"},
        "dflash": {"block": None, "dtype": "bfloat16"},
        "ddtree": {"budget": 16, "dtype": "bfloat16"},
        "dspark": {"block": None, "schedule": "throughput", "threshold": 0.5, "dtype": "bfloat16"},
    }
    for method in registry.METHODS:
        options = registry.resolve_options(method)
        assert {k: getattr(options, k) for k in defaults.get(method, {})} == defaults.get(method, {})
        assert changed(options) == {} and registry.recorded_options(method) == {}
    # the old defaults' budgets, as the τ-vs-budget figure reads them from records without one
    assert registry.resolve_options("specinfer", {}, 22).widths == (2, 2, 2, 1)
    assert registry.resolve_options("lookahead", {}, 28) == registry.resolve_options("lookahead")


def test_soft_knobs_and_conflicts():
    dspark = registry.resolve_options("dspark", {"schedule": "threshold"}, 6)
    assert (dspark.block, dspark.schedule) == (6, "threshold")  # an explicit schedule wins; K is the cap
    eagle3 = registry.resolve_options("eagle3", {"depth": 3}, 16)
    assert (eagle3.total_token, eagle3.depth) == (17, 3)
    for method, options in [("dflash", {"block": 8}), ("eagle", {"paths": "0;1"}), ("medusa", {"choices": "[[0]]"}),
                            ("sps", {"schedule": "heuristic"}), ("specinfer", {"widths": "2,1"})]:
        with pytest.raises(BenchError, match=f"{method}: --budget 4 sets"):
            registry.resolve_options(method, options, 4)
    with pytest.raises(BenchError, match=r"mtp option depth must be int in 1..16 or none, got 20 \(from --budget 20\)"):
        registry.resolve_options("mtp", {}, 20)
    with pytest.raises(BenchError, match="--budget must be an integer >= 1"):
        registry.resolve_options("pld", {}, 0)
    assert registry.resolve_options("lookahead", {}, 2) == registry.resolve_options(
        "lookahead", {"ngram": 3, "window": 1, "guesses": 1})


def test_runs_record_the_resolved_options_and_the_budget():
    target = SimpleNamespace(name="tiny", fingerprint="f", engine=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    decoder = SimpleNamespace(lossless=True)
    settings = RunSettings(method="eagle3", task="mtbench", method_options={"top_k": "3"}, budget=8)
    recorded = record_settings(settings, "eagle3", target, decoder)
    assert recorded["method_options"] == {"top_k": 3, "total_token": 9, "depth": 8} and recorded["budget"] == 8
    baseline = record_settings(settings, "ar", target, decoder)
    assert baseline["method_options"] == {} and "budget" not in baseline
    plain = record_settings(RunSettings(method="specinfer", task="mtbench", method_options={"widths": "3,1"}),
                            "specinfer", target, decoder)
    assert plain["method_options"] == {"widths": [3, 1]} and "budget" not in plain
    assert registry.recorded_options("pld", {"max_ngram": "3"}) == {"max_ngram": 3}  # as given, typed


def test_recorded_budget_reads_old_records():
    assert registry.recorded_budget({"method": "dflash", "method_options": {"block": 4}, "budget": 4}) == 4
    assert registry.recorded_budget({"method": "dflash", "method_options": {"block": 8}}) == 8
    assert registry.recorded_budget({"method": "eagle3", "method_options": {"total_token": 17, "depth": 8}}) == 16
    assert registry.recorded_budget({"method": "dspark", "method_options": {"block": 4, "schedule": "none"}}) == 4
    assert registry.recorded_budget({"method": "pld", "method_options": {}}) == 10
    assert registry.recorded_budget({"method": "eagle2", "method_options": {}}) == 11
    for settings in [{"method": "dspark", "method_options": {}}, {"method": "medusa", "method_options": {}},
                     {"method": "ar", "method_options": {}}, {"method": "pld", "method_options": {"gone": 1}},
                     {"method": "nonesuch"}]:
        assert registry.recorded_budget(settings) is None


@dataclasses.dataclass(frozen=True)
class _Example:
    count: int = option(2, min=1, max=9)
    scale: float = option(0.5, above=0.0)
    flag: bool = False
    name: str | None = None
    kind: Literal["a", "b"] = "a"
    sizes: tuple[int, ...] = option((1, 2), min=1)
    paths: tuple[tuple[int, ...], ...] | None = option(None, min=0)


def test_parse_options_types():
    parse = lambda raw: parse_options(_Example, raw, "demo")  # noqa: E731
    got = parse({"count": "3", "scale": 2, "flag": "true", "name": 123, "kind": "b", "sizes": "4, 5",
                 "paths": "[[0], [0, 1]]"})
    assert got == _Example(3, 2.0, True, "123", "b", (4, 5), ((0,), (0, 1)))
    assert parse({"flag": 1, "sizes": 7, "paths": [[1]], "name": "none"}) == _Example(
        flag=True, sizes=(7,), paths=((1,),))
    assert parse({"flag": "0", "sizes": [3]}) == _Example(sizes=(3,))
    assert parse(_Example(count=4)) == _Example(count=4)  # an instance passes through
    for raw in [{"count": True}, {"count": 2.5}, {"count": 10}, {"scale": 0}, {"scale": "nan"},
                {"scale": float("inf")}, {"flag": "yes"}, {"flag": 2}, {"kind": "c"}, {"sizes": ""},
                {"sizes": "1,0"}, {"paths": "[[0], [-1]]"}, {"name": ["x"]}]:
        with pytest.raises(BenchError) as info:
            parse(raw)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"demo option {next(iter(raw))} must be"), message
        assert "demo options: count (int in 1..9), scale (float > 0.0), flag (true|false), name (str or none)" \
            in message


def test_a_run_with_bad_options_writes_nothing(tiny_task, tmp_path, no_target_load):
    result = run_cli(tiny_task, "sps", "--option", "gamma=0", "--results-dir", str(tmp_path / "r"))
    assert_one_line(result, "sps option gamma must be int >= 1, got 0")
    assert not (tmp_path / "r").exists()


def test_the_grid_takes_a_budget(monkeypatch, tmp_path, tiny_task, no_target_load):
    import bench.run
    from bench.grid import run_grid

    with pytest.raises(BenchError, match="ar takes no --budget"):  # before the target loads
        run_grid({str(tiny_task): {}}, ["pld", "ar"], "g", str(tmp_path), budget=4, echo=lambda line: None)
    target = SimpleNamespace(name="tiny", fingerprint="f", engine=SimpleNamespace(device=SimpleNamespace(type="cpu")))
    built, ran = [], []
    monkeypatch.setattr(bench.core.target, "load_target", lambda *a, **k: target)
    def build(name, target, options=None):
        built.append((name, options))
        return SimpleNamespace(lossless=True)

    monkeypatch.setattr(registry, "build_decoder", build)
    monkeypatch.setattr(bench.run, "run", lambda settings: ran.append(settings))
    run_grid({str(tiny_task): {}}, ["dflash"], "g", str(tmp_path), budget=4, echo=lambda line: None)
    assert ("dflash", registry.resolve_options("dflash", {"block": 4})) in built
    assert [s.budget for s in ran] == [4]
    assert record_settings(ran[0], "dflash", target, SimpleNamespace(lossless=True))["budget"] == 4
