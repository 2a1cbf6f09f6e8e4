"""Medusa-1: head offsets, the tree built from measured accuracies, lossless decoding
through the shared loop, Medusa's own checkpoint layout, training with resume, and the
(lossy) typical acceptance rule."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from sps_helpers import load_tiny_target, make_tiny_target_folder, write_sharegpt

import methods.medusa as medusa
from bench.core.decode import DecodeConfig, Drafter, LoopDecoder, decode
from bench.core.draft import Draft
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from bench.training import TrainSettings
from methods.medusa import (
    Features,
    MedusaDrafter,
    MedusaHeads,
    MedusaObjective,
    MedusaTraining,
    Tree,
    build,
    build_tree,
    cross_entropy_block,
    expected_accepted,
    rank_probabilities,
    typical_acceptance,
)

PROMPT = [1, 504, 3213, 28, 1790, 30, 2, 77, 9]
TEXT = [504, 1296, 3003, 4683, 359, 2382, 28, 5724, 284]  # "The three primary colors are red, yellow and"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


def random_heads(hidden: int, num_heads: int = 5, num_layers: int = 1, scale: float = 0.05, seed: int = 0):
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, num_heads, num_layers)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale)
    return heads


def save_ours(folder: Path, target, heads: MedusaHeads, paths=None, accuracy=None) -> Path:
    """A drafter folder in our format, written by the exporter itself."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"method": "medusa", "format": medusa.FORMAT, "weights": "model.safetensors",
                "target": {"name": target.name, "fingerprint": target.fingerprint,
                           "vocab_size": target.config.vocab_size},
                "architecture": {"num_heads": heads.num_heads, "num_layers": heads.num_layers,
                                 "hidden": heads.hidden}}
    if accuracy is not None:
        manifest["accuracy"] = {"topk": accuracy}
    if paths is not None:
        manifest["tree"] = {"paths": [list(p) for p in paths]}
    medusa.export_heads(heads, folder, manifest)
    return folder


def exported(heads: MedusaHeads) -> MedusaHeads:
    """The heads as the drafter sees them after the bf16 round trip."""
    copy = MedusaHeads(heads.hidden, heads.num_heads, heads.num_layers)
    copy.load_export_state({k: v.to(torch.bfloat16) for k, v in heads.export_state().items()}, Path("."))
    return copy


# ------------------------------------------------------------------ heads
def test_head_shapes_init_and_key_names():
    heads = MedusaHeads(16, num_heads=3, num_layers=2)
    x = torch.randn(7, 16)
    assert heads.states(x).shape == (3, 7, 16)
    assert heads.states(x, heads=2).shape == (2, 7, 16)
    lm_head = torch.randn(50, 16)
    assert heads.logits(x, lm_head).shape == (3, 7, 50)
    block = heads.blocks[1][0]
    assert torch.count_nonzero(block.linear.weight) == 0  # zero-initialised: x + SiLU(b)
    assert torch.allclose(block(x), x + F.silu(block.linear.bias))
    assert set(heads.export_state()) == {f"{i}.{j}.linear.{w}" for i in range(3) for j in range(2)
                                         for w in ("weight", "bias")}


def test_fused_cross_entropy_matches_autograd():
    torch.manual_seed(0)
    z = torch.randn(6, 11, requires_grad=True)
    p = torch.randn(6, 11).softmax(-1)
    tokens = torch.randint(11, (6,))
    soft_ref = -(p * z.log_softmax(-1)).sum(-1)
    (grad_soft,) = torch.autograd.grad(soft_ref.sum(), z)
    hard_ref = F.cross_entropy(z, tokens, reduction="none")
    (grad_hard,) = torch.autograd.grad(hard_ref.sum(), z)
    loss, soft, grad = cross_entropy_block(z.detach(), p)
    assert torch.allclose(loss, soft_ref, atol=1e-5) and torch.allclose(soft, soft_ref, atol=1e-5)
    assert torch.allclose(grad, grad_soft, atol=1e-6)
    loss, soft, grad = cross_entropy_block(z.detach(), p, tokens)
    assert torch.allclose(loss, hard_ref, atol=1e-5) and torch.allclose(soft, soft_ref, atol=1e-5)
    assert torch.allclose(grad, grad_hard, atol=1e-6)


def _synthetic_features(d: int = 8, vocab: int = 23):
    torch.manual_seed(1)
    lengths = [9, 7, 12, 10]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    n = int(offsets[-1])
    mask = torch.rand(n) < 0.7
    mask[offsets[1:] - 1] = False  # the last position of a conversation predicts nothing
    data = {"tokens": torch.randint(vocab, (n,)), "loss_mask": mask, "offsets": offsets,
            "h5": torch.randn(n, d).to(torch.bfloat16)}
    return data, torch.randn(vocab, d)


@pytest.mark.parametrize("labels", ["soft", "data"])
def test_training_loss_pairs_head_i_with_token_t_plus_2_plus_i(labels):
    """The objective's loss and gradients equal a naive per-pair computation: head i at
    position t is scored against the target's distribution at t+1+i (the token t+2+i),
    only when t+1+i is a reply prediction inside t's conversation."""
    data, lm_head = _synthetic_features()
    features = Features(data, tap=5, heldout=0.25, data_limit=None)
    assert features.split == int(data["offsets"][3])  # the last of 4 conversations is held out
    heads = random_heads(8, num_heads=3, scale=0.3)
    opts = MedusaTraining(num_heads=3, labels=labels, head_decay=0.8)
    objective = MedusaObjective(heads, lm_head, features, opts, torch.device("cpu"))
    windows = [(0, 8), (10, 14), (16, 27)]
    loss, metrics = objective.loss(windows)
    loss.backward()
    fast = [p.grad.clone() for p in heads.parameters()]
    heads.zero_grad()

    hidden, tokens, mask, ends = data["h5"].float(), data["tokens"], data["loss_mask"], features.end
    reference = torch.zeros(())
    for i in range(3):
        terms = []
        for start, stop in windows:
            for t in range(start, stop):
                label = t + 1 + i
                if label >= ends[t] or not mask[label]:
                    continue
                logq = F.linear(heads.blocks[i](hidden[t]), lm_head).log_softmax(-1)
                if labels == "soft":
                    terms.append(-(F.linear(hidden[label], lm_head).softmax(-1) * logq).sum())
                else:
                    terms.append(-logq[tokens[t + 2 + i]])
        reference = reference + 0.8 ** i * torch.stack(terms).mean()
    reference.backward()
    assert torch.allclose(loss, reference, atol=1e-5)
    for a, p in zip(fast, heads.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-5)
    assert metrics["tokens"] == sum(1 for s, e in windows for t in range(s, e) if mask[t + 1] and t + 1 < ends[t])
    assert 0.0 <= metrics["acc_h2"] <= 1.0


# ------------------------------------------------------------------- tree
def test_tree_is_expected_length_optimal_on_a_small_case():
    accuracy = [[0.5, 0.7, 0.8], [0.3, 0.45, 0.5]]  # cumulative top-1..3 per head
    ranks = rank_probabilities(accuracy)
    assert ranks[0] == pytest.approx([0.5, 0.2, 0.1]) and ranks[1] == pytest.approx([0.3, 0.15, 0.05])
    universe = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    for size in range(1, 8):
        best = max(expected_accepted(list(nodes), accuracy) for nodes in itertools.combinations(universe, size)
                   if all(len(p) == 1 or p[:1] in nodes for p in nodes))
        tree = build_tree(accuracy, size)
        assert len(tree) == size and all(len(p) == 1 or p[:1] in tree for p in tree)
        assert expected_accepted(tree, accuracy) == pytest.approx(best)
    assert build_tree(accuracy, 4) == [(0,), (1,), (0, 0), (2,)]


def test_tree_order_parents_and_depth_cut():
    tree = Tree.from_paths([[1, 0, 2], [0], [1], [1, 0], [0, 3]], num_heads=3)
    assert tree.paths == ((0,), (1,), (0, 3), (1, 0), (1, 0, 2))
    assert tree.parents == (-1, -1, 0, 1, 3)
    topk = torch.arange(30).view(3, 10)  # head h, rank r -> token 10h + r
    draft = tree.draft(topk, max_depth=3)
    assert draft.tokens == [0, 1, 13, 10, 22] and draft.parents == [-1, -1, 0, 1, 3]
    cut = tree.draft(topk, max_depth=2)
    assert cut.tokens == [0, 1, 13, 10] and len(tree.draft(topk, max_depth=0)) == 0
    with pytest.raises(BenchError, match="lacks its parent"):
        Tree.from_paths([[0], [1, 1]], num_heads=3)
    with pytest.raises(BenchError, match="ranks"):
        Tree.from_paths([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], num_heads=3)


# ------------------------------------------------------------- decoding
class CheckedMedusa(MedusaDrafter):
    """Asserts the offset at every proposal: the state the heads read is the one whose
    target logits produced the root (greedy)."""

    checked = 0

    def propose(self, state):
        assert int(F.linear(self.hidden, self.lm_head).argmax()) == state.root
        self.checked += 1
        return super().propose(state)


@pytest.mark.slow  # the slow tier (make test-slow)
def test_greedy_decode_reproduces_ar_on_the_default_target(default_target, tmp_path, one_thread):
    folder = save_ours(tmp_path / "ours", default_target, random_heads(default_target.config.hidden_size))
    decoder = build(default_target, {"drafter": str(folder)})
    assert decoder.lossless and decoder.info["tree_size"] == 63 and decoder.info["tree_source"] == "prior accuracies"
    drafter = decoder.drafter
    drafter.__class__ = CheckedMedusa
    config = DecodeConfig(max_new_tokens=24)
    base = decode(default_target.engine, Drafter(), TEXT, config)
    result = decode(default_target.engine, drafter, TEXT, config)
    assert result.tokens == base.tokens and len(base.tokens) == 24
    assert drafter.checked == len(result.accept_lengths)
    assert max(result.tree_sizes) == 63 and max(result.proposed_lengths) == drafter.tree.depth


class OracleMedusa(MedusaDrafter):
    """Heads that know the greedy continuation: head 0 ranks the true token second,
    the others rank it first, so every round accepts the path (1, 0, 0)."""

    def __init__(self, *args, continuation: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.continuation = continuation

    def propose(self, state):
        self.position = len(state.tokens)  # index of the token after the root
        return super().propose(state)

    def head_logits(self, hidden, heads):
        logits = torch.randn(heads, self.lm_head.shape[0])
        for i in range(heads):
            if self.position + i < len(self.continuation):
                logits[i, self.continuation[self.position + i]] = 50.0
        logits[0, (self.continuation[self.position] + 1) % logits.shape[1]] = 60.0
        return logits


def test_accepted_paths_commit_and_move_the_heads_state(tiny_target):
    config = DecodeConfig(max_new_tokens=30)
    base = decode(tiny_target.engine, Drafter(), PROMPT, config)
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0], [1, 0, 0], [1, 1]], num_heads=3)
    drafter = OracleMedusa(random_heads(64, 3), tiny_target.engine.lm_head, tiny_target.engine.num_layers, tree,
                           continuation=PROMPT + base.tokens)
    drafter.__class__ = type("CheckedOracle", (CheckedMedusa, OracleMedusa), {})
    result = decode(tiny_target.engine, drafter, PROMPT, config)
    assert result.tokens == base.tokens
    assert result.accept_lengths[:-1] == [3] * (len(result.accept_lengths) - 1)  # 4 tokens per round
    assert drafter.checked == len(result.accept_lengths)


def test_sampling_decode_runs(default_target, tmp_path, one_thread):
    folder = save_ours(tmp_path / "ours", default_target, random_heads(default_target.config.hidden_size),
                       paths=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    decoder = build(default_target, {"drafter": str(folder)})
    assert decoder.info["tree_source"] == "manifest" and decoder.info["tree_size"] == 5
    config = DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0.8, top_k=20))
    result = decoder.run_turn(TEXT, config, torch.Generator().manual_seed(0))
    assert len(result.tokens) == 16
    assert all(a <= p <= 3 for a, p in zip(result.accept_lengths, result.proposed_lengths))


# --------------------------------------------------- Medusa's own layout
def _their_folder(folder: Path, heads: MedusaHeads, lm_heads: list[torch.Tensor] | None, pt: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    state = {k: v.clone().to(torch.float16) for k, v in heads.export_state().items()}
    for i, w in enumerate(lm_heads or []):
        state[f"{i}.{heads.num_layers}.weight"] = w.to(torch.float16)
    if pt:
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["non-legacy safetensors", "legacy pt"])
def test_published_medusa_heads_load_and_decode_losslessly(tiny_target, tmp_path, layout):
    heads = random_heads(64, num_heads=3, num_layers=2, scale=0.2)
    vocab = tiny_target.config.vocab_size
    own = [torch.randn(vocab, 64) * 0.3 for _ in range(3)] if layout.startswith("non") else None
    folder = _their_folder(tmp_path / "theirs", heads, own, pt=layout.endswith("pt"))
    decoder = build(tiny_target, {"drafter": str(folder), "tree_size": 10})
    assert decoder.info["format"] == "medusa" and decoder.info["own_lm_heads"] == (own is not None)
    assert decoder.info["tree_size"] == 10
    x = torch.randn(64)
    got = decoder.drafter.head_logits(x, 3)
    for i in range(3):
        state = x
        for j in range(2):
            w = heads.export_state()
            state = state + F.silu(F.linear(state, w[f"{i}.{j}.linear.weight"].half().float(),
                                            w[f"{i}.{j}.linear.bias"].half().float()))
        lm_head = own[i].half().float() if own else tiny_target.engine.lm_head
        assert torch.allclose(got[i], F.linear(state, lm_head), atol=1e-3)
    config = DecodeConfig(max_new_tokens=12)
    assert decoder.run_turn(PROMPT, config).tokens == decode(tiny_target.engine, Drafter(), PROMPT, config).tokens


# -------------------------------------------------------------- training
def _train_settings(out_dir: Path, data_path: Path, max_steps: int) -> TrainSettings:
    options = {"num_heads": 3, "window": 8, "eval_positions": 32, "tree_size": 10, "feature_tokens": 2000}
    return TrainSettings(out_dir=out_dir, max_steps=max_steps, batch_size=2, lr=1e-2, warmup_steps=1,
                         checkpoint_every_s=0.0, data_path=data_path, progress=False, options=options)


def test_training_exports_resumes_exactly_and_builds(tiny_target, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    data = write_sharegpt(tmp_path / "sharegpt.json")
    straight = medusa.train(tiny_target, _train_settings(tmp_path / "straight", data, 4))
    assert straight["steps"] == 4 and straight["resumed_from"] is None

    real_export = medusa.export_heads
    calls = []

    def interrupted(*args):
        calls.append(1)
        real_export(*args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed right after the step-2 checkpoint

    monkeypatch.setattr(medusa.training, "export_heads", interrupted)
    with pytest.raises(KeyboardInterrupt):
        medusa.train(tiny_target, _train_settings(tmp_path / "resumed", data, 4))
    monkeypatch.setattr(medusa.training, "export_heads", real_export)
    resumed = medusa.train(tiny_target, _train_settings(tmp_path / "resumed", data, 4))
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "straight" / "model.safetensors")), load_file(
        str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    manifest = json.loads((tmp_path / "straight" / "drafter.json").read_text())
    assert manifest["method"] == "medusa" and manifest["target"]["fingerprint"] == tiny_target.fingerprint
    assert manifest["architecture"] == {**manifest["architecture"], "num_heads": 3, "num_layers": 1, "hidden": 64}
    accuracy = manifest["accuracy"]["topk"]
    assert len(accuracy) == 3 and all(len(row) == 10 and row == sorted(row) for row in accuracy)
    assert len(manifest["tree"]["paths"]) == 10 and manifest["training"]["steps"] == 4
    heldout = manifest["heldout"]  # the stored tree's rounds replayed on held-out replies, whole and cut
    assert heldout["tree_size"] == 10 and heldout["rounds"] >= heldout["first_128"]["rounds"] > 0
    assert 1.0 <= heldout["rounds_tau"] <= 1 + max(len(p) for p in manifest["tree"]["paths"])
    assert set(manifest["training"]["last_20_steps"]) >= {"loss", "kl", "acc_h0", "acc_h2"}
    assert manifest["training"]["epochs"] > 0 and manifest["training"]["data"].startswith("ShareGPT V3 prompts")
    log = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log] == [1, 2, 3, 4] and all("acc_h1" in row for row in log)

    decoder = build(tiny_target, {"drafter": str(tmp_path / "straight"), "tree_size": "manifest"})
    assert decoder.info["tree_source"] == "manifest" and decoder.info["expected_accepted"] >= 0
    config = DecodeConfig(max_new_tokens=10)
    assert decoder.run_turn(PROMPT, config).tokens == decode(tiny_target.engine, Drafter(), PROMPT, config).tokens


# ---------------------------------------------------- typical acceptance
def _tree_logits(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    """Logits whose softmax at T=1 is the given distribution per row (rest spread evenly)."""
    out = []
    for row in rows:
        rest = (1.0 - sum(row.values())) / (vocab - len(row))
        p = torch.tensor([row.get(v, rest) for v in range(vocab)])
        out.append(p.log())
    return torch.stack(out)


def test_typical_acceptance_takes_the_deepest_likeliest_passing_path():
    # root -> a (token 1) -> c (token 3);  root -> b (token 2) -> d (token 4) -> e (token 5)
    draft = Draft(tokens=[1, 2, 3, 4, 5], parents=[-1, -1, 0, 1, 3])
    cfg = SamplingConfig(temperature=1.0)
    logits = _tree_logits([{1: 0.4, 2: 0.3}, {3: 0.5}, {4: 0.6}, {}, {5: 0.9}, {}])
    assert typical_acceptance(draft, logits, cfg, None).accepted == [1, 3, 4]  # deepest, though a is likelier
    logits = _tree_logits([{1: 0.4, 2: 0.3}, {3: 0.5}, {4: 0.6}, {}, {6: 0.9}, {}])  # e now fails (p = 0.017)
    assert typical_acceptance(draft, logits, cfg, None).accepted == [0, 2]  # depth tie: 0.4 * 0.5 > 0.3 * 0.6
    logits = _tree_logits([{1: 0.3, 2: 0.4}, {3: 0.5}, {4: 0.6}, {}, {6: 0.9}, {}])
    assert typical_acceptance(draft, logits, cfg, None).accepted == [1, 3]  # the likelier path, not the first
    # The next token comes from p at the last accepted node, without the tokens below the cutoff.
    logits = _tree_logits([{1: 0.9}, {6: 0.5, 7: 0.45}])
    drawn = set()
    for seed in range(40):
        verdict = typical_acceptance(Draft([1], [-1]), logits, cfg, torch.Generator().manual_seed(seed))
        assert verdict.accepted == [0]
        drawn.add(verdict.next_token)
    assert drawn == {6, 7}


def test_typical_cutoff_is_min_of_threshold_and_entropy_term():
    cfg = SamplingConfig(temperature=1.0)
    uniform = torch.zeros(2, 100)  # p = 0.01 everywhere, exp(-H) = 0.01
    for threshold, alpha, passes in [(0.09, 0.3, True),  # cutoff = alpha * exp(-H) = 0.003
                                     (0.005, 0.9, True),  # cutoff = threshold = 0.005
                                     (0.5, 1.5, False),  # 0.015
                                     (0.011, 5.0, False)]:  # 0.011
        verdict = typical_acceptance(Draft([5], [-1]), uniform, cfg, None, threshold, alpha)
        assert verdict.accepted == ([0] if passes else [])
    greedy = typical_acceptance(Draft([5], [-1]), _tree_logits([{5: 0.2, 3: 0.3}, {}]), SamplingConfig(), None)
    assert greedy.accepted == [] and greedy.next_token == 3  # temperature 0: exact greedy


def test_typical_acceptance_is_labelled_lossy(tiny_target):
    tree = Tree.from_paths([[0], [0, 0]], num_heads=2)
    args = (random_heads(64, 2), tiny_target.engine.lm_head, tiny_target.engine.num_layers, tree)
    assert MedusaDrafter(*args).lossless
    drafter = MedusaDrafter(*args, acceptance="typical")
    assert not drafter.lossless and not LoopDecoder(tiny_target, drafter).lossless
    draft = Draft([1, 2], [-1, 0])
    logits = _tree_logits([{1: 0.2}, {2: 0.2}, {}], vocab=10)
    cfg = SamplingConfig(temperature=1.0)
    assert drafter.verify(draft, logits, cfg, None).accepted == [0, 1]


def test_typical_through_build(tiny_target, tmp_path):
    folder = save_ours(tmp_path / "ours", tiny_target, random_heads(64, 2), paths=[[0], [0, 0]])
    options = {"drafter": str(folder), "acceptance": "typical"}
    decoder = build(tiny_target, options)
    assert not decoder.lossless
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0.7))
    assert len(decoder.run_turn(PROMPT, config, torch.Generator().manual_seed(0)).tokens) == 12


# ------------------------------------------------------------- bad input
def test_bad_drafters_fail_in_one_line(tiny_target, tmp_path):
    def fails(options, match):
        with pytest.raises(BenchError, match=match) as info:
            build(tiny_target, options)
        assert "\n" not in str(info.value)

    fails({"drafter": str(tmp_path / "nowhere")}, "not a folder")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fails({"drafter": str(plain)}, "medusa_num_heads")
    (plain / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    fails({"drafter": str(plain)}, "neither")
    (plain / "medusa_lm_head.safetensors").write_bytes(b"not safetensors")
    fails({"drafter": str(plain)}, "corrupt or missing drafter weights")

    wrong = save_ours(tmp_path / "wrong-hidden", tiny_target, random_heads(64, 2))
    manifest = json.loads((wrong / "drafter.json").read_text())
    (wrong / "drafter.json").write_text(json.dumps(dict(manifest, architecture={**manifest["architecture"],
                                                                                 "hidden": 32})))
    fails({"drafter": str(wrong)}, "hidden size 32")
    (wrong / "drafter.json").write_text(json.dumps(dict(manifest, architecture={**manifest["architecture"],
                                                                                 "num_heads": 3})))
    fails({"drafter": str(wrong)}, "lacks weights 2.0.linear")
    (wrong / "drafter.json").write_text(json.dumps(dict(manifest, target={**manifest["target"],
                                                                           "fingerprint": "elsewhere"})))
    fails({"drafter": str(wrong)}, "trained for target")
    (wrong / "drafter.json").write_text(json.dumps(manifest))
    save_file({k: v.contiguous() for k, v in random_heads(32, 2).export_state().items()},
              str(wrong / "model.safetensors"))
    fails({"drafter": str(wrong)}, r"0.0.linear.weight has shape \(32, 32\), expected \(64, 64\)")
    (wrong / "model.safetensors").unlink()
    fails({"drafter": str(wrong)}, "no weights file")

    theirs = _their_folder(tmp_path / "theirs-small", random_heads(32, 2), None, pt=False)
    fails({"drafter": str(theirs)}, "is for a target with hidden size 32; target 'tiny' has 64")
    vocab = tiny_target.config.vocab_size
    theirs = _their_folder(tmp_path / "theirs-vocab", random_heads(64, 2), [torch.zeros(vocab - 1, 64)] * 2, pt=True)
    fails({"drafter": str(theirs)}, f"vocabulary {vocab - 1}")
    theirs = _their_folder(tmp_path / "theirs-ragged", random_heads(64, 2), [torch.zeros(vocab, 64),
                                                                              torch.zeros(vocab - 1, 64)], pt=True)
    fails({"drafter": str(theirs)}, "per-head lm_head")

    good = save_ours(tmp_path / "good", tiny_target, random_heads(64, 2))
    fails({"drafter": str(good), "beam": 3}, "unknown medusa option 'beam'")
    fails({"drafter": str(good), "acceptance": "loose"}, "acceptance must be exact\\|typical, got 'loose'")
    fails({"drafter": str(good), "choices": "[[0], [2, 1]]"}, "lacks its parent")
    fails({"drafter": str(good), "choices": "[[0], [0, 0], [0, 0, 0]]"}, "ranks")
    fails({"drafter": str(good), "tree_size": 0}, "tree_size must be int >= 1")
    fails({"drafter": str(good), "posterior_alpha": 2}, "posterior_alpha")


def test_bad_training_options(tiny_target, tmp_path):
    for options, match in [({"heads": 3}, "unknown medusa training option 'heads'"),
                           ({"labels": "hard"}, "labels 'hard'"), ({"window": 0}, ">= 1"),
                           ({"heldout": 1.5}, "heldout")]:
        settings = TrainSettings(out_dir=tmp_path, options=options, progress=False)
        with pytest.raises(BenchError, match=match):
            medusa.train(tiny_target, settings)


@pytest.mark.slow  # the slow tier (make test-slow)
def test_default_tree_is_sized_for_the_device(default_target, tmp_path, one_thread):
    accuracy = [[0.6, 0.75, 0.8], [0.4, 0.5, 0.55], [0.2, 0.3, 0.35]]  # per head, top-1..3 cumulative
    folder = save_ours(tmp_path / "ours", default_target, random_heads(default_target.config.hidden_size, 3),
                       paths=[[0], [1], [0, 0]], accuracy=accuracy)
    decoder = build(default_target, {"drafter": str(folder)})
    assert decoder.info["tree_source"].startswith("sized for this device")
    assert 1 <= decoder.info["tree_size"] < 63
    assert build(default_target, {"drafter": str(folder), "tree_size": "manifest"}).info["tree_size"] == 3
