"""MTP drafters: what predicts what (training rows vs decode steps), greedy equality with
AR on the real target, the draft KV cache after partial accepts, sampled drafts, the fused
distillation loss, a resumable training run, and loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from sps_helpers import load_tiny_target, make_tiny_target_folder, write_sharegpt

from bench.core.decode import DecodeConfig, DecodeState, Drafter, decode
from bench.core.drafters import MANIFEST, WEIGHTS, user_dir
from bench.core.engine import ForwardOutput
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from bench.training import TrainSettings
from bench.training.loop import read_log
from methods import mtp
from methods.mtp import build
from methods.mtp.drafter import ParallelDrafter, SequentialDrafter, make_drafter
from methods.mtp.loss import distill_loss
from methods.mtp.model import LayerShape, ttt_mask
from methods.mtp.store import FORMAT
from methods.mtp.training import MtpObjective, MtpSettings, init_model, windows_of

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def prompt(default_target) -> list[int]:
    from bench.core.target import chat_prompt

    return chat_prompt(default_target.tokenizer, [{"role": "user", "content": "Explain what a list is in Python."}])


@pytest.fixture(scope="module")
def reference(default_target, prompt) -> list[int]:
    """prompt + the target's greedy reply (the AR baseline through the shared loop)."""
    return prompt + decode(default_target.engine, Drafter(), prompt, DecodeConfig(max_new_tokens=NEW_TOKENS)).tokens


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


def random_module(target, variant: str, seed: int = 0, **options):
    """An untrained module (layers copied from the target) and the manifest fields drafting needs."""
    settings = MtpSettings(variant=variant, **options)
    torch.manual_seed(seed)
    model = init_model(target, settings)
    layers = target.engine.num_layers
    return model, {"variant": variant, "tap": settings.trunk_tap(layers) if variant == "parallel" else layers}


def drafter_for(target, variant: str, depth: int | None = None, sample: bool = False,
                dtype: torch.dtype = torch.float32, cls=None):
    model, manifest = random_module(target, variant)
    drafter = make_drafter(target, model, manifest, depth, sample, dtype)
    if cls is not None:
        drafter.__class__ = cls
    return drafter


def start_state(target, tokens: list[int], taps: tuple[int, ...]) -> tuple[DecodeState, ForwardOutput]:
    """Decode state with root tokens[-1] and the target's prefill of everything before it."""
    prefill = target.engine.prefill(torch.tensor(tokens[:-1]), taps=taps)
    state = DecodeState(tokens=list(tokens), prompt_len=len(tokens) - 1, engine=target.engine,
                        config=DecodeConfig(max_new_tokens=64), generator=None)
    return state, prefill


class Recording:
    """Mixin: draft the tokens in `forced` (position -> token) and record every step's
    output feature g; tokens not forced are the module's own argmax."""

    forced: dict[int, int] = {}

    def _choose(self, normed, state, step):
        self.outputs = getattr(self, "outputs", []) + [normed.detach().clone()]
        position = len(state.tokens) + step  # the draft's position: root at len-1
        token, q = super()._choose(normed, state, step)
        return self.forced.get(position, token), q


class RecordingSequential(Recording, SequentialDrafter):
    pass


class RecordingParallel(Recording, ParallelDrafter):
    pass


# ------------------------------------------------------------ what predicts what
def test_ttt_mask_layout():
    mask = ttt_mask(5, 2)
    assert mask.shape == (5, 15)
    step0, step1, step2 = mask[:, :5], mask[:, 5:10], mask[:, 10:]
    # row 4 of step 2: chain rooted at row 2 -> context rows 0..2, its step-1 row 3, itself
    assert step0[4].tolist() == [True, True, True, False, False]
    assert step1[4].nonzero().flatten().tolist() == [3] and step2[4].nonzero().flatten().tolist() == [4]
    assert all(step2[r, r] for r in range(5))  # every query sees at least itself


def test_windows_cover_every_row_once():
    windows = windows_of([0, 10, 13], 4)
    assert windows == [(0, 0, 4), (0, 3, 7), (0, 6, 10), (10, 10, 13)]
    rows = [j for _, a, b in windows for j in range(a + 1, b)]  # rows j predict from (h_{j-1}, x_j)
    assert rows == list(range(1, 10)) + [11, 12]


def test_module_shapes(default_target):
    shape = LayerShape.of(default_target.engine)
    assert (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (576, 9, 3, 64)
    model, _ = random_module(default_target, "sequential")
    assert model.proj.shape == (576, 1152)
    assert model.layer.qkv.shape == ((9 + 2 * 3) * 64, 576) and model.layer.gate_up.shape == (2 * 1536, 576)
    assert torch.equal(model.layer.down, default_target.engine.layers[-1]["down"])  # init: the last layer
    parallel, manifest = random_module(default_target, "parallel", heads=2)
    assert len(parallel.heads) == 2 and manifest["tap"] == 28
    assert torch.equal(parallel.heads[1].layer.qkv, default_target.engine.layers[28]["qkv"])
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared weights are not parameters


def _features(target, tokens: list[int], taps: tuple[int, ...]) -> dict:
    out = target.engine.prefill(torch.tensor(tokens), taps=taps, logits_rows="none")
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    mask[len(tokens) // 2:-1] = True
    features = {"tokens": torch.tensor(tokens), "loss_mask": mask, "offsets": torch.tensor([0, len(tokens)])}
    features.update({f"h{t}": out.hidden[t] for t in taps})
    return features


def test_sequential_training_rows_match_decode_steps(default_target, reference):
    """Training row r (position j = r+1) reads (h_{j-1}, x_j) and is taught lm_head(h_j);
    step k of a chain rooted at position s is training row s+k-2 of recursion step k, and
    the target verifies that draft with lm_head(h_{s+k-1}): the same pair."""
    target, L, steps = default_target, default_target.engine.num_layers, 3
    tokens = reference[: len(reference) - 4]
    features = _features(target, tokens, (L,))
    model, manifest = random_module(target, "sequential", ttt_steps=steps)
    student, teacher, valid = MtpObjective(target, model, MtpSettings(ttt_steps=steps), features).pairs(
        [(0, 0, len(tokens))], steps)
    h, mask = features[f"h{L}"], features["loss_mask"]
    assert student.shape == (steps, len(tokens) - 1, 576)
    assert torch.equal(teacher, h[1:])
    for k in range(steps):
        rows = torch.arange(len(tokens) - 1)
        assert torch.equal(valid[k], mask[1:] & (rows >= k))
    s = len(tokens) - 6  # root position
    drafter = make_drafter(target, model, manifest, depth=steps)
    drafter.__class__ = RecordingSequential
    drafter.forced = {s + k: tokens[s + k] for k in range(1, steps + 1)}  # chain on the data, like training
    state, prefill = start_state(target, tokens[: s + 1], (L,))
    drafter.begin(state, prefill)
    draft = drafter.propose(state)
    assert draft.tokens == tokens[s + 1: s + 1 + steps]
    for k in range(1, steps + 1):
        assert torch.allclose(drafter.outputs[k - 1], student[k - 1, s + k - 2], atol=1e-4), k


def test_parallel_training_rows_match_decode_heads(default_target, reference):
    """Head k at position t is taught lm_head(h_{t+k}); drafting from root s uses every
    head at s-1, so d_k (position s+k) is checked against lm_head(h_{s+k-1}) at verify time."""
    target, L = default_target, default_target.engine.num_layers
    tokens = reference[: len(reference) - 4]
    model, manifest = random_module(target, "parallel", heads=3)
    tap = manifest["tap"]
    features = _features(target, tokens, (tap, L))
    student, teacher, valid = MtpObjective(target, model, MtpSettings(variant="parallel"), features).pairs(
        [(0, 0, len(tokens))], 3)
    assert torch.equal(teacher, features[f"h{L}"])
    rows = torch.arange(len(tokens))
    for k in range(1, 4):
        assert torch.equal(valid[k - 1], features["loss_mask"] & (rows >= k))
    s = len(tokens) - 5
    drafter = make_drafter(target, model, manifest)
    drafter.__class__ = RecordingParallel
    state, prefill = start_state(target, tokens[: s + 1], (tap,))
    drafter.begin(state, prefill)
    assert len(drafter.propose(state)) == 3
    for k in range(1, 4):
        assert torch.allclose(drafter.outputs[k - 1], student[k - 1, s + k - 1], atol=1e-4), k


def test_simulated_rounds_replay_the_decode_loop(default_target, prompt, one_thread):
    """Greedy, every accepted draft is the target's own token, so the rounds simulated from
    teacher-forced chains on the loop's output (what `bench train` reports as rounds_tau on
    held-out replies) accept what the loop accepted: the shipped drafter, fp32 throughout."""
    from methods.mtp.store import find_folder, load_model

    target, L = default_target, default_target.engine.num_layers
    model, manifest = load_model(target, find_folder(target, "sequential", None), "sequential")
    model = model.float()
    result = decode(target.engine, make_drafter(target, model, manifest, depth=4), prompt,
                    DecodeConfig(max_new_tokens=64))
    accepted = result.accept_lengths
    assert sum(accepted) > 0
    tokens = prompt + result.tokens
    features = _features(target, tokens, (L,))
    features["loss_mask"][:] = False
    features["loss_mask"][len(prompt):-1] = True  # rounds start once the prefill's reply token is known
    settings = MtpSettings.parse(dict(manifest["mtp_settings"], head_dtype="float32"))
    counts = MtpObjective(target, model, settings, features).round_counts([(0, 0, len(tokens))], 4)
    assert counts == (len(accepted), sum(accepted), sum(a > 0 for a in accepted))


# ---------------------------------------------------------------- decoding
@pytest.mark.parametrize("variant,depth,dtype", [
    ("sequential", 4, torch.float32), ("sequential", 1, torch.bfloat16),
    ("parallel", 3, torch.float32), ("parallel", 2, torch.bfloat16)])
@pytest.mark.slow  # the slow tier (make test-slow)
def test_greedy_equals_ar_on_real_target(default_target, prompt, reference, one_thread, variant, depth, dtype):
    drafter = drafter_for(default_target, variant, depth, dtype=dtype)
    result = decode(default_target.engine, drafter, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS))
    assert prompt + result.tokens == reference
    assert max(result.proposed_lengths) == depth


def _oracle(target, reference, variant: str, cls, depth: int):
    """Drafts the target's own continuation for a varying number of steps, then a wrong token:
    rounds accept 0, 1, 2, ... drafts, so every rollback length is exercised."""
    drafter = drafter_for(target, variant, depth, cls=cls)
    rounds = {"n": 0}
    choose = cls._choose

    def oracle(self, normed, state, step):
        if step == 0:
            rounds["n"] += 1
        token, q = choose(self, normed, state, step)
        position = len(state.tokens) + step
        right = step < rounds["n"] % (depth + 1) and position < len(reference)
        return (reference[position] if right else (reference[min(position, len(reference) - 1)] + 1)), q

    drafter._choose = oracle.__get__(drafter)
    return drafter


class CheckedSequential(RecordingSequential):
    """Snapshots the draft cache after every ingest (context rows 1..s only)."""

    def ingest(self, state):
        g = super().ingest(state)
        self.snapshots = getattr(self, "snapshots", []) + [
            (list(state.tokens), self.cache.k[..., : self.cache.length, :].clone(), g.clone())]
        return g


def test_draft_cache_after_partial_accepts_equals_recompute(default_target, prompt, reference, one_thread):
    target, L = default_target, default_target.engine.num_layers
    drafter = _oracle(target, reference, "sequential", CheckedSequential, depth=3)
    result = decode(target.engine, drafter, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS))
    assert prompt + result.tokens == reference
    assert {0, 1, 2, 3} <= set(result.accept_lengths)  # partial and full acceptance both ran
    model = drafter.model
    for tokens, keys, g in drafter.snapshots[1:]:
        s = len(tokens) - 1
        h = target.engine.prefill(torch.tensor(tokens[:s]), taps=(L,)).hidden[L]  # fresh features
        cache = model.layer.new_cache(torch.float32, torch.device("cpu"))
        x = model.fuse(h, target.engine.embed[torch.tensor(tokens[1:])])
        with torch.no_grad():
            out = model.layer.cached(x, torch.arange(0, s), cache, drafter.rope)
        assert keys.shape[-2] == s
        assert torch.allclose(keys, cache.k[..., :s, :], atol=1e-3)
        assert torch.allclose(g, model.out(out[-1]), atol=1e-3)


def test_parallel_heads_accept_and_match_recompute(default_target, prompt, reference, one_thread):
    target = default_target
    drafter = _oracle(target, reference, "parallel", RecordingParallel, depth=3)
    result = decode(target.engine, drafter, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS))
    assert prompt + result.tokens == reference
    assert {0, 1, 2, 3} <= set(result.accept_lengths)
    length = drafter.caches[0].length  # every committed row before the last root, from verify passes
    tap = drafter.taps[0]
    trunk = target.engine.prefill(torch.tensor(reference[:length]), taps=(tap,)).hidden[tap]
    head = drafter.model.heads[2]
    cache = head.layer.new_cache(torch.float32, torch.device("cpu"))
    with torch.no_grad():
        head.layer.cached(trunk, torch.arange(length), cache, drafter.rope)
    assert torch.allclose(drafter.caches[2].k[..., :length, :], cache.k[..., :length, :], atol=1e-3)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("variant", ["sequential", "parallel"])
def test_sampled_drafts_record_q(default_target, prompt, one_thread, variant):
    sampling = SamplingConfig(temperature=0.8, top_k=50)
    config = DecodeConfig(max_new_tokens=16, sampling=sampling)
    drafter = drafter_for(default_target, variant, 2, sample=True)
    drafts = []
    propose = drafter.propose
    drafter.propose = lambda state: drafts.append(propose(state)) or drafts[-1]
    runs = [decode(default_target.engine, drafter, prompt, config, torch.Generator().manual_seed(3)).tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16
    for draft in drafts:
        if len(draft):
            assert draft.q.shape == (len(draft), default_target.config.vocab_size)
            assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens))
            assert torch.allclose(draft.q.sum(-1), torch.ones(len(draft)), atol=1e-4)
            assert int((draft.q[0] > 0).sum()) <= 50  # the target's top-k warp is applied
    argmax = drafter_for(default_target, variant, 2)  # sample=0: deterministic drafts, q one-hot
    seen = []
    propose2 = argmax.propose
    argmax.propose = lambda state: seen.append(propose2(state)) or seen[-1]
    decode(default_target.engine, argmax, prompt, DecodeConfig(max_new_tokens=8, sampling=sampling),
           torch.Generator().manual_seed(3))
    assert all(d.q is None for d in seen)


# ------------------------------------------------------------------ training
def test_distill_loss_matches_autograd():
    torch.manual_seed(0)
    head = torch.randn(300, 16)
    student = torch.randn(2, 7, 16, requires_grad=True)
    teacher = torch.randn(7, 16)
    weight = torch.rand(2, 7) * (torch.rand(2, 7) > 0.3)
    loss, stats = distill_loss(student, teacher, weight, head, chunk=3, dtype=torch.float32)
    loss.backward()
    reference = student.detach().clone().requires_grad_(True)
    log_p = (teacher @ head.T).log_softmax(-1)
    log_q = (reference @ head.T).log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    expected = (weight * kl).sum()
    expected.backward()
    assert torch.allclose(loss, expected, atol=1e-5)
    assert torch.allclose(student.grad, reference.grad, atol=1e-5)
    valid = weight > 0
    agree = ((log_q.argmax(-1) == log_p.argmax(-1)) & valid).sum(1)
    assert torch.equal(stats[:, 1].long(), agree) and torch.equal(stats[:, 3].long(), valid.sum(1))


def _settings(out_dir, data_path, max_steps: int = 2, **options) -> TrainSettings:
    options = {"feature_tokens": 1200, "holdout": 2, "eval_rows": 64, "head_dtype": "float32", **options}
    return TrainSettings(out_dir=out_dir, max_steps=max_steps, batch_size=2, max_len=48, lr=1e-3, warmup_steps=1,
                         checkpoint_every_s=0.0, data_path=data_path, progress=False, options=options)


def test_training_resumes_and_exports(tiny_target, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    data = write_sharegpt(tmp_path / "sharegpt.json")
    out = tmp_path / "seq"
    first = mtp.train(tiny_target, _settings(out, data))
    assert first["steps"] == 2 and first["resumed_from"] is None
    resumed = mtp.train(tiny_target, _settings(out, data, max_steps=3))
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 3
    assert [row["step"] for row in read_log(out)] == [1, 2, 3]
    assert {"kl1", "acc1", "acc2"} <= set(read_log(out)[-1])  # TTT: the second recursion step is trained
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["method"] == "mtp" and manifest["variant"] == "sequential" and manifest["tap"] == 2
    assert manifest["fuse_order"] == "embedding_first"  # DeepSeek-V3's order is what `bench train` trains
    assert manifest["target"]["fingerprint"] == tiny_target.fingerprint
    training = manifest["training"]
    assert training["steps"] == 3 and "git_sha" in training and len(training["heldout"]["acc"]) == 4
    # decode rounds replayed on the held-out replies, whole and cut to the grid's 128 tokens
    heldout = training["heldout"]
    assert heldout["rounds"] >= heldout["first_128"]["rounds"] > 0 and heldout["first_128"]["rounds_tau"] >= 1
    # what the README's drafter table reads: the data, the pool's tokens, epochs over the training windows
    assert training["data"] == "ShareGPT V3 prompts, teacher-forced ShareGPT replies" and training["feature_tokens"] > 0
    assert training["epochs"] == round(3 * training["batch_size"] / training["train_windows"], 2) > 0
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS), "pt") as handle:
        assert handle.get_tensor("proj").dtype == torch.bfloat16
        assert not any("embed" in k or "lm_head" in k for k in handle.keys())
    decoder = build(tiny_target, {"drafter": str(out), "depth": 3, "draft_dtype": "float32"})
    assert decoder.info["variant"] == "sequential" and decoder.info["trained_steps"] == 3
    assert decoder.info["fuse_order"] == "embedding_first" and decoder.info["layout"] == "spec-bench"
    prompt = [1, 504, 3213, 28, 1790]
    base = decode(tiny_target.engine, Drafter(), prompt, DecodeConfig(max_new_tokens=20))
    assert decoder.run_turn(prompt, DecodeConfig(max_new_tokens=20)).tokens == base.tokens


def test_parallel_trains_into_its_own_folder(tiny_target, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    data = write_sharegpt(tmp_path / "sharegpt.json")
    summary = mtp.train(tiny_target, _settings(user_dir(tiny_target.name, "mtp"), data, variant="parallel", heads=2))
    assert summary["drafter"] == str(user_dir(tiny_target.name, "mtp-parallel"))
    manifest = json.loads((user_dir(tiny_target.name, "mtp-parallel") / MANIFEST).read_text())
    assert manifest["variant"] == "parallel" and manifest["architecture"]["heads"] == 2 and manifest["tap"] == 0
    assert "fuse_order" not in manifest  # the heads fuse nothing
    assert len(manifest["training"]["heldout"]["acc"]) == 2
    decoder = build(tiny_target, {"variant": "parallel", "draft_dtype": "float32"})
    assert decoder.info["depth"] == 2
    prompt = [1, 77, 9, 4000, 12, 12, 12, 880]
    base = decode(tiny_target.engine, Drafter(), prompt, DecodeConfig(max_new_tokens=20))
    assert decoder.run_turn(prompt, DecodeConfig(max_new_tokens=20)).tokens == base.tokens
    with pytest.raises(BenchError, match="no mtp drafter \\(variant sequential\\)"):
        build(tiny_target, {})  # the sequential drafter was not trained: separate folders


# ---------------------------------------------------------------- bad input
def write_drafter(folder, owner, kind: str = "sequential", heads: int = 3, **changes):
    """A random module saved as a drafter of `owner`; `changes` overwrite manifest fields."""
    model, manifest = random_module(owner, kind, heads=heads)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()},
              str(folder / WEIGHTS))
    architecture = dict(vars(LayerShape.of(owner.engine)), kind=kind, heads=heads)
    manifest = {"format": FORMAT, "method": "mtp", "variant": kind, "tap": manifest["tap"],
                "architecture": architecture, "weights": WEIGHTS,
                "target": {"name": owner.name, "fingerprint": owner.fingerprint,
                           "vocab_size": owner.config.vocab_size}, **changes}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_bad_options_and_drafters(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    seq = str(write_drafter(tmp_path / "seq", tiny_target))
    par = str(write_drafter(tmp_path / "par", tiny_target, "parallel", heads=2))
    assert build(tiny_target, {"drafter": par}).info["variant"] == "parallel"  # variant from the manifest
    cases = [
        ({"drafter": seq, "gamma": 3}, "unknown mtp option 'gamma'"),
        ({"drafter": seq, "variant": "tree"}, r"option variant must be sequential\|parallel or none, got 'tree'"),
        ({"drafter": seq, "depth": 0}, "depth must be int in 1..16"),
        ({"drafter": seq, "depth": "x"}, "depth must be int"),
        ({"drafter": par, "depth": 3}, "depth must be in 1..2"),
        ({"drafter": seq, "variant": "parallel"}, "is an mtp sequential drafter, not parallel"),
        ({"variant": "parallel"}, "variant=parallel"),
        ({"drafter": str(tmp_path / "nowhere")}, "not a folder"),
    ]
    for options, message in cases:
        with pytest.raises(BenchError, match=message) as info:
            build(tiny_target, options)
        assert "\n" not in str(info.value)
    broken = [
        (write_drafter(tmp_path / "fp", tiny_target, target={"name": "x", "fingerprint": "0" * 16,
                                                             "vocab_size": tiny_target.config.vocab_size}),
         "trained for target"),
        (write_drafter(tmp_path / "sps", tiny_target, method="sps"), "not mtp"),
        (write_drafter(tmp_path / "var", tiny_target, variant="tree"), "unknown mtp variant"),
        (write_drafter(tmp_path / "arch", tiny_target, architecture={"hidden_size": 32}), "hidden_size"),
    ]
    corrupt = write_drafter(tmp_path / "corrupt", tiny_target)
    (corrupt / WEIGHTS).write_bytes(b"not safetensors")
    broken.append((corrupt, "corrupt or missing drafter weights"))
    partial = write_drafter(tmp_path / "partial", tiny_target)
    save_file({"proj": torch.zeros(64, 128, dtype=torch.bfloat16)}, str(partial / WEIGHTS))
    broken.append((partial, "lack"))
    shaped = write_drafter(tmp_path / "shaped", tiny_target)
    model, _ = random_module(tiny_target, "sequential")
    weights = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    weights["proj"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    save_file(weights, str(shaped / WEIGHTS))
    broken.append((shaped, "proj .* has shape"))
    for folder, message in broken:
        with pytest.raises(BenchError, match=message) as info:
            build(tiny_target, {"drafter": str(folder)})
        assert "\n" not in str(info.value)


def test_bad_training_options(tiny_target, tmp_path):
    for options, message in [({"varient": "parallel"}, "unknown mtp training option"),
                             ({"variant": "tree"}, "variant 'tree' unknown"),
                             ({"variant": "parallel", "tap": 2}, "tap must be in 0..1"),
                             ({"ttt_steps": 0}, ">= 1"), ({"init": "zeros"}, "init 'zeros'"),
                             ({"fuse_order": "sideways"}, "fuse_order 'sideways' unknown")]:
        with pytest.raises(BenchError, match=message):
            mtp.train(tiny_target, _settings(tmp_path / "x", None, **options))


def test_first_reply_tokens_cuts_each_reply_from_start():
    from bench.training import first_reply_tokens

    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert first_reply_tokens(mask, 0, 2).int().tolist() == [1, 1, 0, 0, 1, 1, 0, 0, 1]
    assert first_reply_tokens(mask, 4, 1).int().tolist() == [1, 1, 1, 0, 1, 0, 0, 0, 1]  # rows before start kept
