"""Drafter training: ShareGPT formatting, the loop's checkpoints and exact resume, export."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sps_helpers import load_tiny_target, make_tiny_target_folder, write_sharegpt

from bench.core.errors import BenchError
from bench.training import TrainSettings
from bench.training import loop as loop_module
from bench.training.data import ShareGPTExamples, format_conversation, read_sharegpt
from bench.training.draft_lm import DraftDistillation, train_draft_lm

FP32 = {"num_layers": 1, "teacher_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


@pytest.fixture
def sharegpt(tmp_path):
    return write_sharegpt(tmp_path / "sharegpt.json")


def _settings(out_dir, data_path, **changes) -> TrainSettings:
    values = dict(out_dir=out_dir, max_steps=4, batch_size=2, max_len=64, lr=1e-3, warmup_steps=1,
                  checkpoint_every_s=0.0, data_path=data_path, progress=False, options=dict(FP32),
                  precision="float32")
    values.update(changes)
    return TrainSettings(**values)


# ---------------------------------------------------------------------- data
def test_truncated_sharegpt_file_is_read(sharegpt):
    conversations = read_sharegpt(sharegpt)
    assert len(conversations) == 11  # 12 written, the cut-off last one dropped, the gpt-only one skipped
    assert all(c[0]["role"] == "user" for c in conversations)
    assert [m["role"] for m in conversations[0]] == ["user", "assistant", "user", "assistant"]


def test_reply_mask_covers_exactly_the_replies(tiny_target, sharegpt):
    tokenizer = tiny_target.tokenizer
    messages = read_sharegpt(sharegpt)[1]
    example = format_conversation(tokenizer, messages, max_len=512)
    tokens, mask = example.tokens.tolist(), example.loss_mask.tolist()
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    full = full["input_ids"] if hasattr(full, "keys") else full
    assert tokens == list(full)
    predicted = tokenizer.decode([tokens[i + 1] for i in range(len(tokens)) if mask[i]])
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert predicted == "<|im_end|>".join(replies) + "<|im_end|>"
    first_reply = mask.index(True)
    short = format_conversation(tokenizer, messages, max_len=first_reply + 5)
    assert len(short.tokens) == first_reply + 5 and short.loss_mask.sum() == 4 and not short.loss_mask[-1]
    assert format_conversation(tokenizer, messages, max_len=first_reply) is None  # no reply left


def test_shuffle_is_deterministic(tiny_target, sharegpt):
    first = ShareGPTExamples(tiny_target.tokenizer, 64, seed=3, path=sharegpt)
    again = ShareGPTExamples(tiny_target.tokenizer, 64, seed=3, path=sharegpt)
    other = ShareGPTExamples(tiny_target.tokenizer, 64, seed=4, path=sharegpt)
    assert first.conversations == again.conversations != other.conversations


def test_real_sharegpt_package_loads():
    conversations = read_sharegpt()
    assert len(conversations) > 10_000
    assert all(c[0]["role"] == "user" and any(m["role"] == "assistant" for m in c) for c in conversations[:500])


# ---------------------------------------------------------------------- loop
def test_learning_rate_schedule():
    cfg = loop_module.LoopConfig(max_steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert loop_module.learning_rate(0, cfg) == pytest.approx(0.1)
    assert loop_module.learning_rate(9, cfg) == pytest.approx(1.0)
    assert loop_module.learning_rate(100, cfg) == pytest.approx(0.1)
    rates = [loop_module.learning_rate(s, cfg) for s in range(10, 100)]
    assert rates == sorted(rates, reverse=True)


def test_resume_reproduces_an_uninterrupted_run(tiny_target, sharegpt, tmp_path, monkeypatch):
    whole = train_draft_lm(tiny_target, _settings(tmp_path / "whole", sharegpt))
    assert whole["steps"] == 4 and whole["resumed_from"] is None

    calls = {"n": 0}
    real_loss = DraftDistillation.loss

    def interrupted(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed during step 3, after step 2's checkpoint
        return real_loss(self, batch)

    monkeypatch.setattr(DraftDistillation, "loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_draft_lm(tiny_target, _settings(tmp_path / "split", sharegpt))
    monkeypatch.setattr(DraftDistillation, "loss", real_loss)
    assert len(loop_module.read_log(tmp_path / "split")) == 2
    resumed = train_draft_lm(tiny_target, _settings(tmp_path / "split", sharegpt))
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4

    expected = loop_module.read_log(tmp_path / "whole")
    got = loop_module.read_log(tmp_path / "split")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for want, have in zip(expected, got, strict=True):
        for key in ("loss", "kl", "acc", "lr", "grad_norm", "tokens"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_resume_with_other_settings_is_refused(tiny_target, sharegpt, tmp_path):
    train_draft_lm(tiny_target, _settings(tmp_path / "run", sharegpt, max_steps=1))
    with pytest.raises(BenchError, match="other settings"):
        train_draft_lm(tiny_target, _settings(tmp_path / "run", sharegpt, max_steps=2, batch_size=3))
    extended = train_draft_lm(tiny_target, _settings(tmp_path / "run", sharegpt, max_steps=2))
    assert extended["resumed_from"] == 1 and extended["steps"] == 2  # more steps is allowed


def test_unknown_training_option(tiny_target, sharegpt, tmp_path):
    with pytest.raises(BenchError, match="unknown sps training option"):
        train_draft_lm(tiny_target, _settings(tmp_path / "x", sharegpt, options={"layers": 2}))


# -------------------------------------------------------------------- export
def test_exported_drafter_matches_the_trained_student(tiny_target, sharegpt, tmp_path):
    from methods.sps import load_draft_engine

    out = tmp_path / "drafter"
    train_draft_lm(tiny_target, _settings(out, sharegpt, max_steps=2))
    manifest = json.loads((out / "drafter.json").read_text())
    assert manifest["target"]["fingerprint"] == tiny_target.fingerprint
    assert manifest["training"]["steps"] == 2 and manifest["architecture"]["num_hidden_layers"] == 1
    assert {"first_10_steps", "last_10_steps", "git_sha", "reply_tokens_seen", "epochs"} <= set(manifest["training"])
    assert manifest["training"]["epochs"] > 0
    from safetensors.torch import load_file

    stored = load_file(str(out / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) for k in stored)  # shared, not stored

    # The draft engine built from the export computes what the student (bf16-rounded) computes.
    objective = DraftDistillation(tiny_target, _draft_settings(), "cpu")
    objective.student.load_state_dict({k: v.float() for k, v in stored.items()}, strict=False)
    draft, _ = load_draft_engine(tiny_target, out)
    tokens = torch.tensor([1, 504, 3213, 28, 1790, 12])
    with torch.no_grad():
        want = objective.student(tokens[None]).logits[0]
    assert (draft.prefill(tokens, logits_rows="all").logits - want).abs().max() < 1e-4


def test_chain_counts_follow_agreeing_prefixes_within_a_reply():
    from bench.training.draft_lm import chain_counts

    # Rows 10-13 are one reply, 20-21 another. Agreeing contiguous rows from each row: 2, 1, 0, 1, 2, 1.
    agree = [True, True, False, True, True, True]
    positions = [10, 11, 12, 13, 20, 21]
    # Position 0: 5 of 6 agree. Position 1: chains from 10, 11, 13, 20, 21 agreed at 0; 13 and 21
    # end their reply (no row ahead), so 2 of the 3 left (10, 11, 20) agree. Position 2: of the chains
    # from 10 and 20 that agreed twice, only 10 has a row two ahead in its reply (12), and it disagrees.
    assert chain_counts(agree, positions, 3) == [(5, 6), (2, 3), (0, 1)]


def test_sps_training_measures_held_out_chain_agreement(tiny_target, sharegpt, tmp_path):
    """The first conversations are held out; a draft equal to the target (all its layers,
    fp32) agrees at every draft position, so the predicted τ of a gamma-3 chain is 4."""
    out = tmp_path / "same"
    layers = tiny_target.config.num_hidden_layers
    summary = train_draft_lm(tiny_target, _settings(out, sharegpt, max_steps=1, lr=1e-12,
                                                    options=dict(FP32, num_layers=layers)))
    manifest = json.loads((out / "drafter.json").read_text())
    heldout = manifest["heldout"]
    assert heldout["held_out"] == "the first 1 conversations" and heldout["positions"] > 0
    assert heldout["top1_by_position"] == [1.0, 1.0, 1.0] and heldout["predicted_tau"] == 4.0
    # every round's first draft lands; only a reply's last round is cut short of 3 drafts
    assert heldout["rounds_a1"] == 1.0 and 3.5 < heldout["rounds_tau"] <= 4.0
    first = heldout["first_128"]  # the same replies cut to the grid's 128 new tokens
    assert first["rounds_a1"] == 1.0 and 0 < first["rounds"] <= heldout["rounds"] and first["rounds_tau"] <= 4.0
    assert summary["steps"] == 1


def test_cached_teacher_matches_the_online_one(tiny_target, sharegpt, tmp_path, monkeypatch):
    """`feature_tokens`: the teacher's logits are the lm_head projection of the final states in
    the shared feature cache, no target pass: the online teacher's logits up to the states'
    bf16 rounding, on the same conversations; training and the held-out evaluation run on it."""
    from bench.training.draft_lm import CachedExamples, DraftLMSettings
    from bench.training.features import FeatureData, ensure_features

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    cached = train_draft_lm(tiny_target, _settings(tmp_path / "cached", sharegpt, max_steps=2,
                                                   options=dict(FP32, feature_tokens=10_000)))
    assert cached["steps"] == 2 and all(row["kl"] > 0 for row in loop_module.read_log(tmp_path / "cached"))
    manifest = json.loads((tmp_path / "cached" / "drafter.json").read_text())
    assert manifest["heldout"]["positions"] > 0
    store = ensure_features(tiny_target, (tiny_target.config.num_hidden_layers,),
                            FeatureData(max_tokens=10_000, max_len=64, data_path=str(sharegpt)), progress=False)
    examples = CachedExamples(store, tiny_target.config.num_hidden_layers)
    online = DraftDistillation(tiny_target, DraftLMSettings(**FP32), "cpu")
    teacher = DraftDistillation(tiny_target, DraftLMSettings(**FP32, feature_tokens=10_000), "cpu")
    assert teacher.teacher is None  # no target engine: one lm_head product per row
    for i in range(len(examples)):
        example = examples.get(i)
        rows = example.loss_mask.nonzero().squeeze(-1)
        want = online.teacher_logits(dataclasses.replace(example, states=None), example.tokens, rows)
        got = teacher.teacher_logits(example, example.tokens, rows)
        assert (got - want).abs().max() < 0.05 * want.abs().max()


def _draft_settings():
    from bench.training.draft_lm import DraftLMSettings

    return DraftLMSettings(**FP32)


def test_init_from_target_layers(tiny_target):
    from bench.core.target import load_state_dict

    objective = DraftDistillation(tiny_target, _draft_settings(), "cpu")
    state = load_state_dict(tiny_target.path)
    student = objective.student.state_dict()
    assert torch.equal(student["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(student["lm_head.weight"], state["lm_head.weight"])
    trainable = {n for n, _ in objective.named_parameters()}
    assert "model.norm.weight" in trainable and not any(n.startswith(("lm_head", "model.embed")) for n in trainable)


# ----------------------------------------------------------------------- cli
def test_cli_train_needs_a_trainable_method():
    from click.testing import CliRunner

    from bench.cli import main

    result = CliRunner().invoke(main, ["train", "--method", "ar"])
    assert result.exit_code == 2 and "nothing to train" in result.output


def test_cli_train_refuses_epochs_beside_an_explicit_max_steps(tmp_path):
    """--epochs sets the step count, so an explicit --max-steps beside it would be dropped
    silently: a one-line error instead, before anything loads or trains."""
    from click.testing import CliRunner

    from bench.cli import main

    result = CliRunner().invoke(main, ["train", "--method", "mtp", "--epochs", "2", "--max-steps", "2",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "not both" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_cli_train_then_run(tiny_target, tmp_path, tiny_task):
    """`bench train` on the real ShareGPT file for two steps, keeping the drafter after the
    first trained token (--keep-at 1), then `bench run --drafter` with the kept one."""
    from click.testing import CliRunner

    from bench.cli import main

    out = tmp_path / "drafter"
    target = str(tiny_target.path)
    result = CliRunner().invoke(main, ["train", "--method", "sps", "--target", target, "--out", str(out),
                                       "--max-steps", "2", "--batch-size", "1", "--max-len", "48",
                                       "--keep-at", "1", "--option", "num_layers=1"])
    assert result.exit_code == 0, result.output
    kept = out / "kept" / "1-tokens"
    assert (out / "drafter.json").exists() and (kept / "drafter.json").exists()
    assert json.loads((kept / "drafter.json").read_text())["training"]["steps"] == 1
    result = CliRunner().invoke(main, ["run", "--method", "sps", "--task", str(tiny_task), "--target", target,
                                       "--drafter", str(kept), "--max-new-tokens", "12",
                                       "--results-dir", str(tmp_path / "results")])
    assert result.exit_code == 0, result.output
    assert "100.0% of turns match" in result.output


def test_cli_train_stopped_by_stop_after_exits_3_and_the_same_command_finishes(tiny_target, tmp_path):
    """--stop-after: the invocation exports and checkpoints, says it is unfinished and exits 3
    (so `bench train ... && bench ship` does not ship it); the same command resumes to the end."""
    from click.testing import CliRunner

    from bench.cli import main
    from bench.cli.train import STOPPED_EXIT

    out = tmp_path / "drafter"
    command = ["train", "--method", "sps", "--target", str(tiny_target.path), "--out", str(out), "--max-steps", "3",
               "--batch-size", "1", "--max-len", "48", "--option", "num_layers=1"]
    result = CliRunner().invoke(main, command + ["--stop-after", "1e-6"])
    assert result.exit_code == STOPPED_EXIT == 3, result.output
    assert "unfinished" in result.output and "Traceback" not in result.output
    assert json.loads((out / "drafter.json").read_text())["training"]["steps"] == 1
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 1
    assert json.loads((out / "checkpoint" / "state.json").read_text())["max_steps"] == 3  # for --status
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "drafter.json").read_text())["training"]["steps"] == 3


def test_heldout_prediction_is_the_chain_model():
    from bench.training import heldout_prediction

    assert heldout_prediction([0.5, 0.5, 0.5])["predicted_tau"] == 1.875  # 1 + .5 + .25 + .125
    assert heldout_prediction([1.0, 0.0, 1.0])["predicted_tau"] == 2.0  # nothing survives a miss
    assert heldout_prediction([])["predicted_tau"] == 1.0


def test_simulated_rounds_start_after_each_bonus_token() -> None:
    from bench.training import rounds_prediction, simulated_rounds

    # two steps over six rows; a round at s accepts the leading run of hit[0][s], hit[1][s]
    hit = [[True, False, True, True, False, True],
           [True, True, False, True, True, True]]
    # s=0: run 2, next s=3; s=3: run 2, next s=6
    assert simulated_rounds(hit, [True] * 6) == (2, 4, 2)
    # a round cannot start on row 0 (not a reply row): s=1: run 0, s=2: run 1, s=4: run 0, s=5: run 2
    assert simulated_rounds(hit, [False] + [True] * 5) == (4, 3, 2)
    # right on half the rows either way, but which half decides where rounds start
    assert rounds_prediction(*simulated_rounds([[True, False] * 3], [True] * 6)) == {
        "rounds": 3, "rounds_tau": 2.0, "rounds_a1": 1.0}
    assert rounds_prediction(*simulated_rounds([[False, True] * 3], [True] * 6)) == {
        "rounds": 4, "rounds_tau": 1.75, "rounds_a1": 0.75}


class Toy:
    """A loop objective of one weight matrix; each step trains 100 tokens."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.ones(2, 2))

    def named_parameters(self):
        return [("w", self.w)]

    def loss(self, batch):
        return (self.w * batch).sum() ** 2, {"tokens": 100.0}


def next_batch(cursor):
    return torch.full((2, 2), 0.1), cursor + 1


def test_milestones_fire_once_across_a_resume(tmp_path):
    """on_milestone runs once per milestone of trained tokens, also when the run stops
    between milestones and resumes; the count is kept in the checkpoint."""
    from bench.training import loop

    fired = []
    cfg = loop.LoopConfig(max_steps=3, checkpoint_every_s=1e9)
    loop.train(Toy(), next_batch, cfg, tmp_path, progress=False, milestones=(150, 250, 450),
               on_milestone=lambda tokens, step: fired.append((tokens, step)))
    assert fired == [(150, 2), (250, 3)]
    summary = loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=5, checkpoint_every_s=1e9), tmp_path,
                         progress=False, milestones=(150, 250, 450),
                         on_milestone=lambda tokens, step: fired.append((tokens, step)))
    assert fired == [(150, 2), (250, 3), (450, 5)] and summary["tokens_seen"] == 500
    assert [row["tokens_seen"] for row in loop.read_log(tmp_path)] == [100, 200, 300, 400, 500]
    # Exports: not at every timed checkpoint (here every step) but once export_every_s have
    # passed, never again right after a milestone's, and at the end.
    exported = []
    loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=8, checkpoint_every_s=0, export_every_s=1e9),
               tmp_path, progress=False, milestones=(650,), on_checkpoint=exported.append,
               on_milestone=lambda tokens, step: fired.append((tokens, step)))
    assert exported == [8] and fired[-1] == (650, 7)
    loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=10, checkpoint_every_s=0, export_every_s=0),
               tmp_path, progress=False, on_checkpoint=exported.append)
    assert exported == [8, 9, 10]

    def stopped(step):
        raise KeyboardInterrupt  # the session ends during the last export

    with pytest.raises(KeyboardInterrupt):
        loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=11, checkpoint_every_s=1e9), tmp_path,
                   progress=False, on_checkpoint=stopped)
    summary = loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=11, checkpoint_every_s=1e9), tmp_path,
                         progress=False, on_checkpoint=exported.append)
    assert exported == [8, 9, 10, 11] and summary["resumed_from"] == 10  # the last step again, then its export
    assert [row["step"] for row in loop.read_log(tmp_path)][-2:] == [10, 11]


def test_run_loop_keeps_copies_of_the_folder_it_trains_into(tmp_path):
    """TrainSettings.run_loop: --keep-at copies come from the folder the trainer exports into,
    also where that is not settings.out_dir (MTP's parallel variant trains into its own)."""
    from bench.training import TrainSettings, loop

    folder = tmp_path / "mtp-parallel"

    def export(step: int) -> None:
        (folder / "drafter.json").write_text(json.dumps({"training": {"steps": step}}))

    settings = TrainSettings(out_dir=tmp_path / "mtp", keep_at=(150,), progress=False)
    summary = settings.run_loop(Toy(), next_batch, loop.LoopConfig(max_steps=3, checkpoint_every_s=1e9), {},
                                export, folder)
    assert summary["drafter"] == str(folder) and not (tmp_path / "mtp").exists()
    kept = folder / "kept" / "150-tokens" / "drafter.json"
    assert json.loads(kept.read_text())["training"]["steps"] == 2  # the copy as it was at the milestone
    assert json.loads((folder / "drafter.json").read_text())["training"]["steps"] == 3


def test_stop_at_exports_checkpoints_and_the_rerun_ends_where_one_run_would(tmp_path):
    """stop_at ends an invocation early (a lent machine's call, a session's end): it exports
    and checkpoints there, and the same settings again resume to the weights of an unbroken run."""
    from bench.training import loop

    class Toy:
        def __init__(self) -> None:
            self.w = torch.nn.Parameter(torch.linspace(-1, 1, 4).reshape(2, 2))

        def named_parameters(self):
            return [("w", self.w)]

        def loss(self, batch):
            return ((self.w * batch).sum() - 1) ** 2, {"tokens": 10.0}

    def next_batch(cursor):
        return torch.full((2, 2), 0.1 * (cursor % 3 + 1)), cursor + 1

    whole = Toy()
    loop.train(whole, next_batch, loop.LoopConfig(max_steps=6, checkpoint_every_s=1e9), tmp_path / "whole",
               progress=False)
    parts, exported = Toy(), []
    cfg = loop.LoopConfig(max_steps=6, checkpoint_every_s=1e9, stop_at=0.0)  # stops after its first step
    summary = loop.train(parts, next_batch, cfg, tmp_path / "parts", progress=False, on_checkpoint=exported.append)
    assert summary["stopped"] and summary["steps"] == 1 and summary["max_steps"] == 6 and exported == [1]
    assert json.loads((tmp_path / "parts" / "checkpoint" / "state.json").read_text())["step"] == 1
    summary = loop.train(parts, next_batch, cfg, tmp_path / "parts", progress=False, on_checkpoint=exported.append)
    assert summary["steps"] == 2 and summary["resumed_from"] == 1 and exported == [1, 2]
    summary = loop.train(parts, next_batch, loop.LoopConfig(max_steps=6, checkpoint_every_s=1e9),
                         tmp_path / "parts", progress=False, on_checkpoint=exported.append)
    assert not summary["stopped"] and summary["steps"] == 6 and exported == [1, 2, 6]
    assert torch.equal(parts.w, whole.w)


def test_stretches_say_which_steps_ran_where_across_resumes(tmp_path, monkeypatch):
    """A run resumed with another thread count (or on another machine) records each stretch of
    steps in its checkpoint; the manifest's machine names them all, and a checkpoint from
    before stretches were kept leaves its steps 'not recorded' rather than claiming them."""
    from bench.core.drafters import describe_stretches, record_training_run, write_drafter
    from bench.training import loop

    threads = torch.get_num_threads()
    try:
        cfg = loop.LoopConfig(max_steps=6, checkpoint_every_s=1e9, stop_at=0.0)  # one step per invocation
        torch.set_num_threads(1)
        loop.train(Toy(), next_batch, cfg, tmp_path, progress=False)
        loop.train(Toy(), next_batch, cfg, tmp_path, progress=False)
        torch.set_num_threads(2)
        summary = loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=6, checkpoint_every_s=1e9), tmp_path,
                             progress=False)
    finally:
        torch.set_num_threads(threads)
    stretches = summary["stretches"]
    assert [(s["from_step"], s["to_step"]) for s in stretches] == [(0, 1), (1, 2), (2, 6)]
    assert stretches == json.loads((tmp_path / "checkpoint" / "state.json").read_text())["stretches"]
    assert stretches[0]["machine"].endswith(", 1 thread") and stretches[2]["machine"].endswith(", 2 threads")
    machine = describe_stretches(stretches)
    assert machine.count("(steps ") == 2 and "1 thread (steps 0-2); " in machine and "2 threads (steps 2-6)" in machine
    assert describe_stretches(stretches[2:]) == stretches[2]["machine"]  # one machine: as before
    old = [{"from_step": 0, "to_step": 4, "machine": None}, {"from_step": 4, "to_step": 6, "machine": "A, 1 thread"}]
    assert describe_stretches(old) == "not recorded (steps 0-4); A, 1 thread (steps 4-6)"
    write_drafter(tmp_path / "drafter", {"w": torch.zeros(2)}, {"method": "eagle3", "training": {}})
    record_training_run(tmp_path / "drafter", "bench train --method eagle3", "cpu", stretches)
    run = json.loads((tmp_path / "drafter" / "drafter.json").read_text())["training"]["runs"][0]
    assert run["machine"] == machine and run["stretches"] == stretches


def test_a_run_lengthened_on_resume_records_both_schedules(tmp_path):
    """A finished run resumed with more steps (`--epochs` raised) trains its extra steps under a new
    cosine, which restarts above the old run's last LR: the stretches and the manifest line say so."""
    from bench.core.drafters import describe_stretches
    from bench.training import loop

    loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=4, warmup_steps=1, checkpoint_every_s=1e9), tmp_path,
               progress=False)
    summary = loop.train(Toy(), next_batch, loop.LoopConfig(max_steps=6, warmup_steps=1, checkpoint_every_s=1e9),
                         tmp_path, progress=False)
    assert [(s["from_step"], s["to_step"], s["max_steps"]) for s in summary["stretches"]] == [(0, 4, 4), (4, 6, 6)]
    line = describe_stretches(summary["stretches"])
    assert line.endswith("; LR schedule 4 steps from step 0, then 6 steps from step 4")
    lrs = [row["lr"] for row in loop.read_log(tmp_path)]
    assert lrs[4] > lrs[3]  # the new schedule's step 4 sits higher on its cosine than the old run's last step


def test_epochs_set_the_steps_from_the_data(tiny_target, sharegpt, tmp_path):
    """`bench train --epochs E`: max_steps = E passes over the trainer's own data."""
    import dataclasses

    settings = dataclasses.replace(_settings(tmp_path / "epochs", sharegpt, max_steps=1000), epochs=1.5, batch_size=2)
    summary = train_draft_lm(tiny_target, settings)
    conversations = len(ShareGPTExamples(tiny_target.tokenizer, settings.max_len, settings.seed, path=sharegpt))
    conversations -= conversations // 8  # the held-out ones (at most an eighth) are not training data
    assert summary["steps"] == -(-3 * conversations // 4)  # ceil(1.5 * n / 2)
    manifest = json.loads((tmp_path / "epochs" / "drafter.json").read_text())
    assert manifest["training"]["max_steps"] == summary["steps"]
    with pytest.raises(BenchError, match="epochs"):
        dataclasses.replace(settings, epochs=1.0).loop_config()


def test_ship_drafter_stores_bf16_and_makes_the_folder_that_drafter(tmp_path):
    """bench ship's copy: float weights stored in bf16 (exactly what a bf16 drafter computes
    with), integer tables as they are, the stored dtype in the manifest, logs gzipped, other
    side files copied, the trainer's resume files and the previous drafter's files gone."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from bench.core.drafters import MANIFEST, WEIGHTS, ship_drafter, shipped_bytes

    source = tmp_path / "trained"
    source.mkdir()
    weights = {"w": torch.randn(8, 4), "vocab": torch.arange(5)}
    save_file(weights, str(source / WEIGHTS))
    (source / MANIFEST).write_text(json.dumps({"method": "eagle3", "training": {"steps": 3}}))
    (source / "draft_vocab.json").write_text("[1, 2]")  # a trainer's resume files: not shipped
    from bench.training.features import POOL

    (source / POOL).write_text('{"cache": "c", "shards": 1, "tokens": 9}')
    (source / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n' * 50)
    (source / "tokenizer.json").write_text("{}")
    root = tmp_path / "shipped"
    (root / "target" / "eagle3").mkdir(parents=True)
    (root / "target" / "eagle3" / "old_side_file.bin").write_bytes(b"x")  # the previous drafter's
    size = ship_drafter(source, root / "target" / "eagle3")
    shipped = load_file(str(root / "target" / "eagle3" / WEIGHTS))
    assert shipped["w"].dtype == torch.bfloat16 and torch.equal(shipped["w"], weights["w"].bfloat16())
    assert torch.equal(shipped["vocab"], weights["vocab"])
    manifest = json.loads((root / "target" / "eagle3" / MANIFEST).read_text())
    assert manifest["stored_dtype"] == "bfloat16" and manifest["training"] == {"steps": 3}
    import gzip

    folder = root / "target" / "eagle3"
    assert sorted(p.name for p in folder.iterdir()) == ["drafter.json", "log.jsonl.gz", "model.safetensors",
                                                         "tokenizer.json"]
    assert gzip.decompress((folder / "log.jsonl.gz").read_bytes()) == (source / "log.jsonl").read_bytes()
    assert size == shipped_bytes(root) > 0


def test_ship_thins_a_long_training_log_and_says_so(tmp_path):
    """An at-scale run logs thousands of steps: the shipped log keeps every k-th line, the first
    and the last among them, at most SHIPPED_LOG_LINES; the manifest records k and the full count."""
    import gzip
    import json

    import torch
    from safetensors.torch import save_file

    from bench.core.drafters import MANIFEST, SHIPPED_LOG_LINES, WEIGHTS, ship_drafter, thin_log

    assert thin_log("a\nb\n") == ("a\nb\n", 1, 2)
    assert thin_log("".join(f"{i}\n" for i in range(10)), max_lines=4) == ("0\n3\n6\n9\n", 3, 10)
    assert thin_log("".join(f"{i}\n" for i in range(11)), max_lines=4) == ("0\n3\n6\n9\n10\n", 3, 11)
    source = tmp_path / "trained"
    source.mkdir()
    save_file({"w": torch.randn(2, 2)}, str(source / WEIGHTS))
    (source / MANIFEST).write_text(json.dumps({"method": "eagle3"}))
    steps = 4632
    (source / "log.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, steps + 1)))
    dest = tmp_path / "shipped" / "target" / "eagle3"
    ship_drafter(source, dest)
    shipped = [json.loads(line)["step"] for line in gzip.decompress((dest / "log.jsonl.gz").read_bytes()).splitlines()]
    every = -(-steps // SHIPPED_LOG_LINES)
    assert shipped[0] == 1 and shipped[-1] == steps and len(shipped) <= SHIPPED_LOG_LINES + 1
    assert all(b - a == every for a, b in zip(shipped[:-2], shipped[1:-1]))
    assert json.loads((dest / MANIFEST).read_text())["shipped_logs"] == {
        "log.jsonl": {"every_kth_line": every, "lines_in_training_folder": steps}}


def test_bench_ship_without_a_trained_drafter_is_one_line(tmp_path):
    from click.testing import CliRunner

    from bench.cli import main

    result = CliRunner().invoke(main, ["ship", "--method", "eagle3", "--drafter", str(tmp_path / "none")])
    assert result.exit_code != 0 and "no drafter in" in result.output and "Traceback" not in result.output
    assert CliRunner().invoke(main, ["ship", "--method", "pld"]).exit_code != 0  # nothing to ship


@pytest.mark.slow  # the slow tier (make test-slow)
def test_bench_ship_says_when_a_user_trained_drafter_would_shadow_the_shipped_one(tmp_path, monkeypatch):
    """Runs load the user-trained drafter before the shipped one, so shipping another folder
    while one sits there would leave every run on the older drafter: ship says so."""
    import json

    import torch
    from click.testing import CliRunner
    from safetensors.torch import save_file

    import methods
    from bench.cli import main
    from bench.core.drafters import MANIFEST, WEIGHTS, user_dir

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(methods, "__file__", str(tmp_path / "methods" / "__init__.py"))
    source = tmp_path / "at-scale"
    for folder in (source, user_dir("smollm2-135m", "eagle")):
        folder.mkdir(parents=True)
        save_file({"w": torch.randn(4, 4)}, str(folder / WEIGHTS))
        (folder / MANIFEST).write_text(json.dumps({"method": "eagle"}))
    result = CliRunner().invoke(main, ["ship", "--method", "eagle", "--drafter", str(source)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "methods" / "checkpoints" / "smollm2-135m" / "eagle" / WEIGHTS).exists()
    assert "user-trained drafter" in result.output and str(user_dir("smollm2-135m", "eagle")) in result.output
    own = CliRunner().invoke(main, ["ship", "--method", "eagle"])  # shipping the user's own: no note
    assert own.exit_code == 0 and "user-trained drafter" not in own.output


def test_memory_cap_purges_jemalloc_only_past_its_limit():
    from bench.training.memory import MemoryCap, anonymous_bytes, purge_all_arenas

    if "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
        assert not purge_all_arenas() and not MemoryCap(limit=0).enabled  # glibc: nothing to purge
    jemalloc = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    if not jemalloc.exists():
        pytest.skip("libjemalloc2 not installed")
    child = (
        "import torch\n"
        "from bench.training.memory import MemoryCap, anonymous_bytes\n"
        "cap = MemoryCap(limit=0)\n"
        "x = torch.ones(100_000_000); del x\n"  # 400 MB freed: jemalloc keeps it (decay off)
        "kept = anonymous_bytes()\n"
        "for _ in range(cap.WARMUP): cap.after_step()\n"  # the working set: what the first steps held
        "assert cap.purges == 0 and cap.cap() == 2 * cap.working_set >= 2 * kept - 2**25\n"
        "y = torch.ones(50_000_000); del y; cap.after_step()\n"  # within the working set: nothing purged
        "assert cap.purges == 0 and anonymous_bytes() >= kept - 2**25\n"
        "cap.working_set = kept // 4; cap.after_step()\n"
        "print(cap.enabled, cap.purges, kept - anonymous_bytes() > 300_000_000)\n")
    env = dict(os.environ, LD_PRELOAD=str(jemalloc), MALLOC_CONF="dirty_decay_ms:-1,muzzy_decay_ms:-1")
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1", "True"]
    assert anonymous_bytes() > 0


def test_memory_cap_set_by_the_user_gives_way_to_the_working_set_alone(monkeypatch):
    from bench.training.memory import MemoryCap

    monkeypatch.delenv("BENCH_TRAIN_MEMORY_GB", raising=False)
    default = MemoryCap()
    default.working_set = 6 * 2**30
    assert default.cap() == max(default.limit, 12 * 2**30)  # twice the working set, or the 30% share
    monkeypatch.setenv("BENCH_TRAIN_MEMORY_GB", "10")
    mine = MemoryCap()
    mine.working_set = 6 * 2**30
    assert mine.cap() == 10 * 2**30
    mine.working_set = 11 * 2**30
    assert mine.cap() == 11 * 2**30  # never below what every step needs
    assert MemoryCap(limit=2**30).margin == 2  # a limit passed in keeps the default margin


def test_draft_lm_loss_is_kl_plus_weighted_ce(tiny_target):
    """The fused reductions (vocab_rows) give the textbook loss: sum KL(p || q) + ce_weight * CE
    over the reply positions, divided by their count; and its metrics."""
    from bench.training.data import Example
    from bench.training.draft_lm import DraftLMSettings

    objective = DraftDistillation(tiny_target, DraftLMSettings(**FP32, ce_weight=0.3), "cpu")
    torch.manual_seed(0)
    tokens = torch.randint(tiny_target.config.vocab_size, (12,))
    mask = torch.zeros(12, dtype=torch.bool)
    mask[4:11] = True
    example = Example(tokens, mask)
    loss, metrics = objective.loss([example])
    rows = mask.nonzero().squeeze(-1)
    with torch.no_grad():
        log_p = objective.teacher_logits(example, tokens, rows).log_softmax(-1)
        log_q = objective.student_logits(tokens, rows).float().log_softmax(-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
    ce = F.nll_loss(log_q, tokens[rows + 1], reduction="sum")
    assert abs(float(loss) - float(kl + 0.3 * ce) / len(rows)) < 1e-4 * float(loss)  # fp32 sums, other orders
    assert abs(metrics["kl"] - float(kl) / len(rows)) < 1e-4 * metrics["kl"]
    assert metrics["acc"] == pytest.approx(float((log_q.argmax(-1) == log_p.argmax(-1)).float().mean()))


def test_soft_cross_entropy_is_the_textbook_loss_and_gradient():
    """vocab_rows.soft_cross_entropy: -(p . log_softmax(z)) per row, and the logit gradient
    autograd gives that expression (EAGLE-3's per-step loss)."""
    from bench.training.vocab_rows import soft_cross_entropy

    generator = torch.Generator().manual_seed(0)
    z = (torch.randn(7, 300, generator=generator) * 4).requires_grad_(True)
    p = torch.randn(7, 300, generator=generator).softmax(-1)
    weights = torch.rand(7, generator=generator)
    (soft_cross_entropy(z, p) * weights).sum().backward()
    ours, z.grad = z.grad, None
    textbook = -(p * z.log_softmax(-1)).sum(-1)
    (textbook * weights).sum().backward()
    assert torch.allclose(soft_cross_entropy(z.detach(), p), textbook.detach(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours, z.grad, rtol=1e-5, atol=1e-6)


def test_a_second_run_into_the_same_folder_stops_with_one_line(tmp_path):
    from bench.training.loop import exclusive_folder

    with exclusive_folder(tmp_path / "run"):
        with pytest.raises(BenchError, match=r"another training run \(pid \d+\) is writing to"):
            with exclusive_folder(tmp_path / "run"):
                pass
    with exclusive_folder(tmp_path / "run"):  # released when the first run ends
        pass


def _training_folder(folder: Path, saved_at: str) -> Path:
    """A training folder as a run leaves it: checkpoint at step 10, log to step 12 at 2 s/step,
    an export at step 10 with its held-out numbers, one kept copy, the command that started it."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "state.json").write_text(json.dumps(
        {"step": 10, "tokens_seen": 1000, "saved_at": saved_at, "settings": {"method": "eagle3"}}))
    (folder / "drafter.json").write_text(json.dumps(
        {"method": "eagle3", "heldout": {"top1_by_position": [0.5, 0.4], "predicted_tau": 1.9},
         "training": {"steps": 10, "max_steps": 100, "epochs": 0.1}}))
    rows = [{"step": s, "loss": 1.0, "elapsed_s": 2.0 * s, "tokens_seen": 100 * s} for s in range(1, 13)]
    (folder / "log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "kept" / "200000-tokens").mkdir(parents=True)
    (folder / "kept" / "200000-tokens" / "drafter.json").write_text("{}")
    (folder / ".train.command").write_text("bench train --method eagle3 --epochs 2\n")
    return folder


def test_training_status_reads_a_run_from_its_folder(tmp_path):
    """How far a run is, how fast, what is left, its held-out numbers and kept copies, and
    whether a live process holds it: from the folder alone, a damaged file costing only its fields."""
    from datetime import UTC, datetime

    from bench.training.loop import LOCK
    from bench.training.status import describe, read_status, training_folders

    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC).timestamp()
    run = _training_folder(tmp_path / "scale" / "eagle3", "2026-01-01T11:50:00Z")
    assert training_folders([tmp_path]) == [run] == training_folders([run])

    status = read_status(run, now=now)
    assert (status.method, status.step, status.checkpoint_step, status.max_steps) == ("eagle3", 12, 10, 100)
    assert status.tokens_seen == 1200 and status.epochs == pytest.approx(0.12) and status.kept == [200000]
    assert status.seconds_per_step == pytest.approx(2.0) and status.hours_left == pytest.approx(88 * 2 / 3600)
    assert status.checkpoint_age_s == pytest.approx(600) and status.pid is None and not status.finished
    text = describe(status)
    assert "stopped; resumes from step 10" in text and "step 12/100 (12%)" in text and "10 min old" in text
    assert "0.50 / 0.40; predicted tau 1.90" in text and "0.2M tokens" in text and "replayed" not in text
    assert "pool:" not in text  # a run from before the pool was pinned
    (run / "pool.json").write_text(json.dumps({"cache": "selfdistill-len512-x", "shards": 3, "tokens": 4373615}))
    assert "pool: 4.37M tokens of feature cache selfdistill-len512-x" in describe(read_status(run, now=now))
    from bench.training.status import replayed_tau

    replayed = {"rounds_tau": 1.7, "first_128": {"rounds_tau": 1.5}, "first_x": 3}
    assert replayed_tau(replayed) == {"whole": 1.7, "first_128": 1.5}
    status.rounds_tau = replayed_tau(replayed)
    assert "predicted tau 1.90; replayed rounds tau 1.70; over their first 128 tokens 1.50" in describe(status)
    assert "command: bench train --method eagle3 --epochs 2" in text
    # a folder moved since its run started (set aside, or brought from another machine): the
    # command shown resumes it here
    (run / ".train.command").write_text(f"bench train --method eagle3 --out {tmp_path / 'elsewhere'} --epochs 2\n")
    assert f"command: bench train --method eagle3 --out {run} --epochs 2  (moved here from" in describe(
        read_status(run, now=now))
    (run / ".train.command").write_text(f"bench train --method eagle3 --out {run} --epochs 2\n")
    assert describe(read_status(run, now=now)).endswith(f"command: bench train --method eagle3 --out {run} --epochs 2")

    holder = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)", "train"],
                              stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # until it has exec'd, /proc shows the forking pytest's command line
        (run / LOCK).write_text(str(holder.pid))
        assert read_status(run, now=now).pid == holder.pid
        assert f"running (pid {holder.pid})" in describe(read_status(run, now=now))
    finally:
        holder.kill()
        holder.wait()
    assert read_status(run, now=now).pid is None  # the pid stays in the file; the process is gone

    (run / "checkpoint" / "state.json").write_text("{not json")
    (run / "drafter.json").write_text('{"training": {"max_steps": "many"}}')
    damaged = read_status(run, now=now)
    assert (damaged.step, damaged.checkpoint_step, damaged.max_steps, damaged.checkpoint_age_s) == (12, 0, None, None)
    assert "step 12/?" in describe(damaged)
    (run / "drafter.json").write_text("[1, 2]")
    (run / "checkpoint" / "state.json").write_text('{"settings": "eagle3", "step": "ten"}')
    assert describe(read_status(run, now=now)).startswith("eagle3 in")  # the method read from the command
    (run / ".train.command").unlink()
    assert "? in" in describe(read_status(run, now=now))


def test_training_status_of_a_run_before_its_first_checkpoint(tmp_path):
    """A run still extracting its features or compiling (or stopped there) has only its command
    in its folder: --status lists it, its method read from that command; a checkpoint's step
    count is shown before any export holds one, and a newer checkpoint's count wins."""
    from bench.training.status import describe, read_status, training_folders

    early = tmp_path / "scale" / "eagle3"
    early.mkdir(parents=True)
    (early / ".train.command").write_text("bench train --method eagle3 --epochs 3\n")
    assert training_folders([tmp_path]) == [early] == training_folders([early])
    status = read_status(early)
    assert (status.method, status.checkpointed, status.step) == ("eagle3", False, 0)
    text = describe(status)
    assert "stopped before its first checkpoint; starts at step 0" in text and "step 0" not in text.splitlines()[1]

    run = _training_folder(tmp_path / "scale" / "dspark", "2026-01-01T11:50:00Z")
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    (run / "checkpoint" / "state.json").write_text(json.dumps({**state, "max_steps": 300}))
    assert read_status(run).max_steps == 300 and read_status(run).checkpointed  # the manifest's said 100
    (run / "drafter.json").unlink()
    assert "step 12/300 (4%)" in describe(read_status(run))


def test_cli_train_status(tmp_path):
    from click.testing import CliRunner

    from bench.cli import main

    run = _training_folder(tmp_path / "run", "2026-01-01T11:50:00Z")
    result = CliRunner().invoke(main, ["train", "--status", "--out", str(run)])
    assert result.exit_code == 0 and "eagle3 in" in result.output and "held out at step 10" in result.output
    result = CliRunner().invoke(main, ["train", "--status", "--out", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no training folder" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["train", "--status"], env={"BENCH_CACHE": str(tmp_path / "empty")})
    assert result.exit_code == 0 and "no training run" in result.output
    result = CliRunner().invoke(main, ["train"])
    assert result.exit_code == 2 and "give --method" in result.output and len(result.output.strip().splitlines()) == 1


def test_export_interval_is_a_setting_a_resume_may_change(tmp_path):
    """--export-minutes reaches the loop; the interval is not part of the run's identity, so a run
    resumed with another one goes on (the held-out evaluation of an export costs minutes)."""
    from bench.training.loop import RESUMABLE_CHANGES

    settings = TrainSettings(out_dir=tmp_path, export_every_s=7200.0)
    assert settings.loop_config().export_every_s == 7200.0
    assert TrainSettings(out_dir=tmp_path).loop_config().export_every_s is None  # the loop's default
    assert settings.loop_config(grad_clip=0.5).grad_clip == 0.5 and "export_every_s" in RESUMABLE_CHANGES


def test_first_draft_curves_count_the_examples_each_drafter_saw(tmp_path):
    """scripts.first_draft_curves: EAGLE's examples are a step's reply positions, a block
    drafter's its anchors x batch (at most the reply positions); a shipped log that keeps every
    k-th line counts k steps a line; the accuracy at a size is the steps' mean near it."""
    import gzip

    from scripts.first_draft_curves import accuracy_at, curve

    def drafter(name, rows, batch, anchors=None, every=1):
        folder = tmp_path / name
        folder.mkdir()
        settings = {"anchors": anchors} if anchors else {}
        manifest = {"training": {"batch_size": batch, "steps": rows[-1]["step"], "settings": str(settings)}}
        if every > 1:
            manifest["shipped_logs"] = {"log.jsonl": {"every_kth_line": every}}
        (folder / "drafter.json").write_text(json.dumps(manifest))
        with gzip.open(folder / "log.jsonl.gz", "wt") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
        return folder

    eagle = drafter("eagle", [{"step": s, "tokens": 1000, "acc": 0.1 * s} for s in (1, 2, 3)], batch=4)
    assert curve(eagle, "eagle") == [(1000, 1000, 0.1), (2000, 1000, 0.2), (3000, 1000, 0.30000000000000004)]
    block = drafter("dflash", [{"step": s, "tokens": 900 if s < 10 else 100, "acc0": 0.5} for s in (1, 5, 10)],
                    batch=4, anchors=64, every=5)
    seen = [p[0] for p in curve(block, "dflash")]
    assert seen == [256, 256 + 4 * 256, 256 + 4 * 256 + 5 * 100]  # 64 anchors x 4; a batch with 100 replies caps it
    assert accuracy_at(curve(eagle, "eagle"), 2000) == 0.2 and accuracy_at(curve(eagle, "eagle"), 10**6) is None


def test_medusa_rounds_accept_the_tree_path_of_the_data_ranks():
    """methods.medusa.rounds: head i at row t ranks token t+2+i; a round starting at t accepts
    the longest tree path whose ranks are the data tokens' (next round after its bonus);
    rows outside the reply start none; a one-node tree is head 0's top-1 chain."""
    import types

    import torch

    from methods.medusa.rounds import heldout_rounds, sequence_rounds, tree_hits

    one = [(0,)]
    heads = types.SimpleNamespace(blocks=[torch.nn.Identity()])
    tokens = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    drafts = [2, 3, 9, 5, 9, 7]  # row t drafts tokens[t+2] right at t = 0, 1, 3, 5
    hidden = torch.nn.functional.one_hot(torch.tensor(drafts + [0, 0]), 10).float()
    mask = torch.tensor([False, True, True, True, True, True, True, False])  # token t+1 a reply token
    # rounds start at 1 (hit: 1 accepted), 3 (hit), 5 (hit) -> 7 is past the reply: 3 rounds, 3 accepted
    assert sequence_rounds(heads, torch.eye(10), hidden, tokens, mask, one) == (3, 3, 3)
    mask[1] = False  # the reply begins a row later: 2 (miss), 3 (hit), 5 (hit)
    assert sequence_rounds(heads, torch.eye(10), hidden, tokens, mask, one) == (3, 2, 2)

    # ranks [depth, n]: row 0's data tokens are head 0's rank 1 and head 1's rank 0
    ranks = torch.tensor([[1, 0, 0, 2, -1, -1], [0, 2, 0, -1, -1, -1]])
    reply = torch.tensor([True, True, True, True, True, False])  # token t+1 a reply token; 6 is none
    tree = [(0,), (1,), (0, 0), (1, 0)]
    assert tree_hits(ranks, reply, tree) == [[True, True, True, False, False, False],
                                             [True, False, True, False, False, False]]
    assert tree_hits(ranks, reply, one)[0][:3] == [False, True, True]
    reply[2] = False  # token 3 is no reply token: row 1 drafts nothing, row 0 stops after one
    assert tree_hits(ranks, reply, tree)[0][:3] == [True, False, True]
    assert tree_hits(ranks, reply, tree)[1][:3] == [False, False, True]

    # held out: the whole-reply and first-k replays over a two-head identity drafter
    heads2 = types.SimpleNamespace(blocks=[torch.nn.Identity(), torch.nn.Identity()])
    features = {"tokens": tokens, "loss_mask": torch.tensor([False] + [True] * 6 + [False]), "h": hidden}
    found = heldout_rounds(heads2, torch.eye(10), features, [(0, 8)], one, keep=2)
    assert (found["rounds"], found["tree_size"]) == (3, 1) and found["first_2"]["rows"] == 1


