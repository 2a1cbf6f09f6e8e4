"""The lossless audit of `bench run`: exact match, near ties vs real mismatches, --strict."""

from __future__ import annotations

import json

from click.testing import CliRunner

import bench.registry as registry
import bench.run as run_module
from bench.cli import main
from bench.core.decode import Drafter, LoopDecoder
from tasks import task_name


class _Records:
    def __init__(self, turn: dict) -> None:
        self.turn = turn

    def done(self, question_id, turn):
        return self.turn


class _Side:
    def __init__(self, turn: dict) -> None:
        self.records = _Records(turn)


def _record(tokens, prompt_hash="p"):
    return {"question_id": "q", "turn": 1, "tokens": tokens, "prompt_hash": prompt_hash}


def test_exact_match_and_prompt_mismatch():
    settings = run_module.RunSettings(method="x", task="t")
    same = run_module.compare_with_baseline(_record([1, 2, 3]), _Side(_record([1, 2, 3])), settings)
    assert same == {"exact_match": True, "first_divergence": None}
    other_prompt = run_module.compare_with_baseline(_record([1, 2]), _Side(_record([1, 2], "other")), settings)
    assert other_prompt == {"exact_match": None}
    sampled = run_module.RunSettings(method="x", task="t", temperature=1.0)
    assert run_module.compare_with_baseline(_record([1]), _Side(_record([2])), sampled) == {"exact_match": None}


def test_divergence_is_classified_by_the_target_margin(monkeypatch, default_target):
    settings = run_module.RunSettings(method="x", task="t")
    ours, base = _record([5, 6, 7, 8]), _Side(_record([5, 6, 9, 8]))
    monkeypatch.setattr(run_module, "divergence_margin", lambda target, prompt, prefix, ours, theirs: 3e-6)
    noise = run_module.compare_with_baseline(ours, base, settings, default_target, [1, 2])
    assert noise["exact_match"] is False and noise["first_divergence"] == 2 and noise["near_tie"] is True
    monkeypatch.setattr(run_module, "divergence_margin", lambda target, prompt, prefix, ours, theirs: 2.5)
    real = run_module.compare_with_baseline(ours, base, settings, default_target, [1, 2])
    assert real["near_tie"] is False


def test_margin_is_measured_on_the_target_between_the_parting_tokens(default_target):
    prompt = [1, 2, 3, 4]
    logits = default_target.engine.prefill(__import__("torch").tensor(prompt + [5])).logits[-1].float()
    top, runner_up = logits.topk(2).indices.tolist()
    bottom = int(logits.argmin())
    close = run_module.divergence_margin(default_target, prompt, [5], runner_up, top)
    assert abs(close - float(logits[top] - logits[runner_up])) < 1e-6
    # a token far below the top is a real mismatch, however close the top two are
    far = run_module.divergence_margin(default_target, prompt, [5], bottom, top)
    assert far == run_module.divergence_margin(default_target, prompt, [5], top, bottom) > close


class _CorruptingDrafter(Drafter):
    """A deliberately broken method: it overwrites the committed correction token."""

    name = "broken"

    def learn(self, state, draft, verdict, out, rows) -> None:
        if len(state.generated) == 3:
            state.tokens[-1] = (state.tokens[-1] + 1) % 1000


def test_strict_fails_on_a_real_mismatch(monkeypatch, tmp_path, tiny_task):
    original = registry.build_decoder

    def build(name, target, options=None):
        if name == "broken":
            return LoopDecoder(target, _CorruptingDrafter())
        return original(name, target, options)

    monkeypatch.setattr(registry, "build_decoder", build)
    # options as ar's (none): a run resolves them before building the decoder
    monkeypatch.setitem(registry.METHODS, "broken", registry.MethodInfo("broken", "methods.ar", "test only"))
    args = ["run", "--method", "broken", "--task", str(tiny_task), "--limit", "1", "--max-new-tokens", "8",
            "--results-dir", str(tmp_path)]
    result = CliRunner().invoke(main, args + ["--strict"])
    assert result.exit_code == 1, result.output
    assert "1 real mismatches" in result.output
    records = tmp_path / "smollm2-135m" / task_name(str(tiny_task)) / "broken.jsonl"
    turns = [json.loads(line) for line in records.open()]
    first = next(t for t in turns if t["type"] == "turn")
    assert first["exact_match"] is False and first["first_divergence"] == 2 and first["near_tie"] is False
    relaxed = CliRunner().invoke(main, args)  # without --strict: reported, exit 0
    assert relaxed.exit_code == 0 and "real mismatches" in relaxed.output
