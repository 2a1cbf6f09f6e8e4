"""DFlash, DDTree and DSpark: the best-first tree, the throughput scheduler, the training
blocks' visibility and labels under both conventions, lossless decoding with untrained
drafters, training and resume, legacy drafters, and the drafter folder's checks.
Parity with z-lab's reference is in tests/test_dflash_reference.py, the published layouts
in tests/test_dflash_formats.py."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from methods.dflash.drafter import BlockDrafter, BlockSettings, admit_by_throughput, ddtree
from methods.dflash.model import BlockConfig, BlockDraftModel, block_diagonal_attention, block_taps, zlab_taps
from methods.dflash.training import BlockObjective, BlockTrainSettings, export_model


def prompt_of(target, text="Write a python function that adds two numbers."):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def random_model(target, block=8, markov=0, confidence=False, draft_vocab=2048, seed=0, anchor=False):
    torch.manual_seed(seed)
    config = BlockConfig.for_target(target.config, zlab_taps(target.config.num_hidden_layers, 2), num_layers=2,
                                    block_size=block, draft_vocab_size=draft_vocab, markov_rank=markov,
                                    enable_confidence_head=confidence, mask_token_id=16, sample_from_anchor=anchor)
    model = BlockDraftModel(config)
    if draft_vocab:
        model.draft_to_target.copy_(torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values)
    return model


def test_block_taps_span_the_target():
    # z-lab's build_target_layer_ids over [1, L-3] (Python's round), read at hidden_states[id + 1]
    assert zlab_taps(30, 3) == [2, 15, 28] and zlab_taps(30, 5) == [2, 9, 15, 21, 28] and zlab_taps(30, 1) == [16]
    assert zlab_taps(36, 5) == [2, 10, 18, 26, 34]  # DeepSpec's Qwen3 taps [1, 9, 17, 25, 33], + 1
    assert block_taps(30) == [2, 9, 15, 21, 27]  # ours before the z-lab convention


def test_ddtree_is_best_first_and_ancestor_closed():
    log_probs = torch.tensor([[0.9, 0.1, 0.0], [0.6, 0.4, 0.0], [0.5, 0.5, 0.0]]).log()
    tokens, parents, depths = ddtree(log_probs, budget=4)
    # scores: (0)=.9, (0,0)=.54, (0,1)=.36, (0,0,0)=(0,0,1)=.27, (1)=.1
    assert tokens == [0, 0, 1, 0] and parents == [-1, 0, 0, 1] and depths == [1, 2, 2, 3]
    tokens, parents, _ = ddtree(log_probs, budget=20)
    assert len(tokens) == 20 and all(p < i for i, p in enumerate(parents))
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(tokens[node])
    assert all(len(set(c)) == len(c) for c in children.values())  # siblings are distinct tokens


def test_throughput_admission_stops_at_the_first_drop():
    costs = [1.0, 1.0, 1.1, 1.2, 1.3, 1.4]  # t_v(k), k = 1..5 (index 0 unused)
    assert admit_by_throughput([0.9, 0.8, 0.7, 0.6], costs, draft_seconds=0.1) == 4
    assert admit_by_throughput([0.9, 0.8, 0.7, 0.6], costs[:5] + [10.0], draft_seconds=0.1) == 3
    assert admit_by_throughput([0.9, 0.8, 0.7, 0.6], [1.0, 1.0, 5.0, 1.0, 1.0, 1.0], 0.1) == 0
    # a later slot that would pay off is not reached once one slot does not
    assert admit_by_throughput([0.01, 0.99], [1.0, 1.0, 1.5, 1.5], 0.1) == 0
    # ... unless looking ahead is allowed (greedy decoding): a cheaper 3-token pass wins
    assert admit_by_throughput([0.01, 0.99], [1.0, 1.0, 1.5, 1.5], 0.1, look_ahead=True) == 2
    assert admit_by_throughput([0.5, 0.5], [1.0, 1.0, 2.0, 1.0], 0.0, look_ahead=True) == 2


@pytest.mark.parametrize("anchor", [False, True])
def test_training_blocks_see_only_their_past_and_themselves(default_target, anchor):
    model = random_model(default_target, block=4, anchor=anchor, draft_vocab=None)
    objective = BlockObjective(model, default_target.engine.embed.float(), default_target.engine.lm_head.float()[
        model.draft_to_target], default_target.config.num_hidden_layers, BlockTrainSettings(block_size=4, anchors=3))
    tokens = torch.arange(12)[None]
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 5:10] = True  # positions 5..9 predict reply tokens 6..10
    blocks = objective.blocks({"tokens": tokens, "mask": mask, "lengths": torch.tensor([12])})
    anchors = blocks["anchors"][0].tolist()
    assert all(5 <= a <= 9 for a in anchors)
    context_visible = blocks["context_visible"][0]  # [A*b, T]; and each slot sees its own block
    for j, anchor_at in enumerate(anchors):
        for slot in range(4):
            assert context_visible[j * 4 + slot].tolist() == [t < anchor_at for t in range(12)]
            # z-lab: slot i >= 1 drafts x_{a+i} (labelled at row a+i-1); anchor drafts: slot i drafts x_{a+i+1}
            first = 0 if anchor else 1
            label = anchor_at + slot - first
            scored = bool(blocks["scored"][0, j, slot])
            assert scored == (slot >= first and bool(mask[0, label]) and label + 1 < 12
                              and bool(objective.in_draft_vocab[label + 1]))
            if scored:
                assert int(blocks["label_rows"][0, j, slot]) == label
    assert not anchor or bool(blocks["scored"][0, :, 0].any())
    assert anchor or not bool(blocks["scored"][0, :, 0].any())  # a z-lab anchor slot drafts nothing
    out = objective.forward({"tokens": tokens, "mask": mask, "lengths": torch.tensor([12]),
                             **{f"h{t}": torch.randn(1, 12, 576) for t in set(model.config.taps) | {30}}})
    assert int(out["slots"].min()) >= 0 and int(out["slots"].max()) <= model.config.drafts_per_block - 1
    weights = objective.slot_weights  # exp(-k/gamma) for the k-th draft (gamma 4 for a block of 4)
    assert torch.allclose(weights, torch.exp(-torch.arange(3 + int(anchor)) / 4.0))


def test_block_diagonal_attention_is_sdpa_with_the_block_mask():
    torch.manual_seed(0)
    size, heads, kv_heads, blocks, block, width, hd = 2, 6, 2, 3, 4, 7, 8
    n = blocks * block
    q = torch.randn(size, heads, n, hd, dtype=torch.float64)
    context_k, context_v = torch.randn(2, size, kv_heads, width, hd, dtype=torch.float64)
    k, v = torch.randn(2, size, kv_heads, n, hd, dtype=torch.float64)
    anchors = torch.tensor([[0, 3, 6], [2, 5, 7]])  # anchor 0: the first block sees no context
    visible = torch.arange(width)[None, None] < anchors.repeat_interleave(block, dim=1)[:, :, None]
    block_id = torch.arange(n) // block
    mask = torch.cat([visible, (block_id[:, None] == block_id[None])[None].expand(size, -1, -1)], dim=-1)
    reference = F.scaled_dot_product_attention(q, torch.cat([context_k, k], 2), torch.cat([context_v, v], 2),
                                               attn_mask=mask[:, None], scale=0.3, enable_gqa=True)
    got = block_diagonal_attention(q, context_k, context_v, k, v, visible, block, 0.3)
    assert torch.allclose(got, reference, atol=1e-12)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("mode", ["chain", "tree", "scheduled"])
def test_untrained_block_drafters_are_lossless(default_target, one_thread, mode):
    target = default_target
    prompt = prompt_of(target)
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(0.0))
    reference = decode(target.engine, Drafter(), prompt, config).tokens
    model = random_model(target, markov=16 if mode == "scheduled" else 0, confidence=mode == "scheduled")
    settings = BlockSettings(mode=mode, block=6, budget=10, schedule="throughput")
    costs = [0.06, 0.06, 0.07, 0.07, 0.08, 0.08, 0.09, 0.1]
    result = decode(target.engine, BlockDrafter(target, model, settings, mode, costs), prompt, config)
    assert result.tokens == reference
    if mode == "chain":
        generated = [1 + sum(a + 1 for a in result.accept_lengths[:r]) for r in range(len(result.tree_sizes))]
        # 6 drafts a round, at most what is left to generate (as z-lab's last rounds)
        assert result.tree_sizes == [min(6, 20 - g) for g in generated] and 6 in result.tree_sizes
    if mode == "tree":
        assert set(result.tree_sizes) == {10}
    generator = torch.Generator().manual_seed(0)
    sampled = decode(target.engine, BlockDrafter(target, model, settings, mode, costs), prompt,
                     DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(0.8)), generator)
    assert len(sampled.tokens) == 12


def test_dspark_q_is_the_distribution_each_draft_was_drawn_from(default_target):
    target = default_target
    model = random_model(target, markov=16, confidence=True, anchor=True).eval()
    drafter = BlockDrafter(target, model, BlockSettings(mode="scheduled", block=5, schedule="none"), "dspark")
    prefill = target.engine.prefill(torch.tensor(prompt_of(target)), taps=drafter.taps)
    from bench.core.decode import DecodeState

    state = DecodeState(tokens=prompt_of(target) + [int(prefill.logits[-1].argmax())],
                        prompt_len=len(prompt_of(target)), engine=target.engine,
                        config=DecodeConfig(sampling=SamplingConfig(1.0)), generator=torch.Generator().manual_seed(3))
    drafter.begin(state, prefill)
    draft = drafter.propose(state)
    assert len(draft) == 5 and draft.q.shape == (5, target.config.vocab_size)
    assert torch.allclose(draft.q.sum(-1), torch.ones(5), atol=1e-5)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[model.draft_to_target] = False
    assert float(draft.q[:, outside].sum()) == 0.0  # only draft-vocabulary tokens can be drawn
    assert all(float(draft.q[i, t]) > 0 for i, t in enumerate(draft.tokens))
    # the Markov correction makes q_i depend on the previous draft token: recompute slot 1
    hidden = drafter._backbone(state.root, 5)
    logits = model.logits(hidden, drafter.lm_head)
    previous = torch.tensor(draft.tokens[0])
    row = logits[1] + model.markov_bias(model.markov_state(previous)).float()
    assert torch.allclose(draft.q[1, model.draft_to_target], row.softmax(-1), atol=1e-5)


class HeldOutFeatures:
    """Six fixed held-out conversations (two batches of four spans and two), as FeatureBatches
    gives them to heldout_slot_accuracy."""

    def __init__(self, taps, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.heldout_spans = [(0, 12)] * 6
        self.features = {f"h{t}": torch.randn(6, 12, 576, generator=generator) for t in taps}
        self.tokens = torch.randint(0, 2048, (6, 12), generator=generator)

    def batch(self, spans):
        rows = slice(0, len(spans)) if len(spans) == 4 else slice(4, 6)
        mask = torch.zeros(len(spans), 12, dtype=torch.bool)
        mask[:, 4:11] = True
        return {"tokens": self.tokens[rows], "mask": mask, "lengths": torch.full((len(spans),), 12),
                **{k: v[rows] for k, v in self.features.items()}}


def test_heldout_teacher_tokens_are_kept_and_used_only_for_the_same_rows(default_target, tmp_path, one_thread,
                                                                        monkeypatch):
    """An export reuses the target's greedy tokens of the held-out positions from the training
    folder (the same anchors every time); other teacher rows or another lm_head compute them again."""
    import types

    import methods.dflash.training as training
    from methods.dflash.training import HELDOUT_TEACHER, heldout_slot_accuracy, read_teacher_cache

    teacher_passes = []

    def linear(*args):
        teacher_passes.append(1)
        return F.linear(*args)

    monkeypatch.setattr(training, "F", types.SimpleNamespace(linear=linear))  # the module's own lm_head passes
    model = random_model(default_target, block=4, markov=8, draft_vocab=None, anchor=True)
    lm_head = default_target.engine.lm_head.float()[model.draft_to_target]
    objective = BlockObjective(model, default_target.engine.embed.float(), lm_head, 30,
                               BlockTrainSettings(block_size=4, anchors=3))
    data = HeldOutFeatures(set(model.config.taps) | {30})

    def passes(*args) -> tuple[dict, int]:
        teacher_passes.clear()
        return heldout_slot_accuracy(objective, *args), len(teacher_passes)

    plain = heldout_slot_accuracy(objective, data)
    cache = {}
    assert passes(data, cache) == (plain, 2) and sorted(k for k in cache if k != "lm_head") == [0, 4]
    torch.save(cache, tmp_path / HELDOUT_TEACHER)
    kept = read_teacher_cache(tmp_path / HELDOUT_TEACHER)
    assert passes(data, kept) == (plain, 0)  # both batches read from the folder's file
    other = HeldOutFeatures(set(model.config.taps) | {30}, seed=1)
    assert passes(other, kept) == (heldout_slot_accuracy(objective, other), 2)  # other rows: computed
    objective.lm_head = lm_head.flip(0)  # another head: everything computed again
    assert passes(data, kept) == (heldout_slot_accuracy(objective, data), 2)
    (tmp_path / HELDOUT_TEACHER).write_bytes(b"damaged")
    assert read_teacher_cache(tmp_path / HELDOUT_TEACHER) == {}
    torch.save({"lm_head": 1, 0: "no tensor", 4: kept[4]}, tmp_path / HELDOUT_TEACHER)
    assert sorted(read_teacher_cache(tmp_path / HELDOUT_TEACHER), key=str) == [4, "lm_head"]


@pytest.fixture
def tiny_training(default_target, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    from bench.training import TrainSettings

    def make(steps, out, **options):
        return TrainSettings(out_dir=tmp_path / out, max_steps=steps, batch_size=2, lr=1e-3, warmup_steps=1,
                             progress=False, checkpoint_every_s=1e9,
                             options={"feature_tokens": 1500, "draft_vocab": 1024, "block_size": 4, "anchors": 4,
                                      **options})
    return make


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_training_resumes_and_the_drafter_loads(default_target, tiny_training, one_thread, method):
    import bench.registry as registry
    from methods.dflash.training import DSPARK_DEFAULTS, train_block

    defaults = DSPARK_DEFAULTS if method == "dspark" else None
    first = train_block(default_target, tiny_training(2, method), method, defaults)
    assert first["steps"] == 2 and first["resumed_from"] is None
    second = train_block(default_target, tiny_training(3, method), method, defaults)
    assert second["resumed_from"] == 2 and second["steps"] == 3
    folder = tiny_training(3, method).out_dir
    assert (folder / ".heldout_teacher.pt").is_file()  # kept for the next export, in the folder only
    manifest = json.loads((folder / "drafter.json").read_text())
    assert manifest["target"]["fingerprint"] == default_target.fingerprint
    # a block of 4 slots: 3 drafts under z-lab's convention (dflash), 4 with sample_from_anchor (dspark)
    assert len(manifest["heldout"]["slot_accuracy"]) == (4 if method == "dspark" else 3)
    # decode rounds replayed on held-out replies, whole and cut to the grid's 128 tokens
    rounds, first = manifest["heldout"], manifest["heldout"]["first_128"]
    assert rounds["rounds"] >= first["rounds"] > 0 and 1 <= first["rounds_tau"] <= 1 + len(rounds["slot_accuracy"])
    arch = manifest["architecture"]
    assert arch["enable_confidence_head"] == (method == "dspark") and arch["sample_from_anchor"] == (method == "dspark")
    assert arch["mask_token_id"] == 16 and arch["qk_norm"] and arch["draft_vocab_size"] == 1024
    assert arch["taps"] == zlab_taps(30, 3) and arch["num_layers"] == 3
    prompt = prompt_of(default_target)
    config = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(0.0))
    reference = decode(default_target.engine, Drafter(), prompt, config).tokens
    names = ["dflash", "ddtree"] if method == "dflash" else ["dspark", "dflash"]
    for name in names:
        options = {"drafter": str(folder), "schedule": "threshold"} if name == "dspark" else {"drafter": str(folder)}
        decoder = registry.build_decoder(name, default_target, options)
        assert decoder.run_turn(prompt, config).tokens == reference
    if method == "dflash":
        with pytest.raises(BenchError, match="confidence head"):
            registry.build_decoder("dspark", default_target, {"drafter": str(folder)})
    with pytest.raises(BenchError, match="block"):
        registry.build_decoder("dflash", default_target, {"drafter": str(folder), "block": 9})
    with pytest.raises(BenchError, match="unknown dflash training option"):
        train_block(default_target, tiny_training(1, "x", blocks=3), "dflash")


def test_a_foreign_or_corrupt_drafter_is_refused(default_target, tmp_path):
    import bench.registry as registry

    model = random_model(default_target)
    export_model(model, tmp_path, {"method": "dflash", "target": {"name": "x", "fingerprint": "0" * 16,
                                                                  "vocab_size": default_target.config.vocab_size}})
    with pytest.raises(BenchError, match="trained for target"):
        registry.build_decoder("dflash", default_target, {"drafter": str(tmp_path)})
    manifest = json.loads((tmp_path / "drafter.json").read_text())
    manifest["target"]["fingerprint"] = default_target.fingerprint
    (tmp_path / "drafter.json").write_text(json.dumps(manifest))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BenchError, match="corrupt"):
        registry.build_decoder("dflash", default_target, {"drafter": str(tmp_path)})
    with pytest.raises(BenchError, match="ddtree drafts with the dflash drafter"):
        from methods.ddtree import train

        train(default_target, None)


def test_calibration_metrics():
    from scripts.dflash_calibration import auroc, calibration_pairs, expected_calibration_error

    assert auroc([0.9, 0.8, 0.3, 0.1], [1, 1, 0, 0]) == 1.0
    assert auroc([0.1, 0.9], [1, 0]) == 0.0
    assert auroc([0.5, 0.5], [1, 0]) == 0.5
    assert expected_calibration_error([0.95, 0.95, 0.15, 0.15], [1, 1, 0, 0]) == pytest.approx(0.1)
    pairs = calibration_pairs([([0.9, 0.5, 0.5], 1)])
    assert pairs["survival"] == [(1, 0.9, 1), (2, 0.45, 0), (3, 0.225, 0)]
    assert pairs["conditional"] == [(1, 0.9, 1), (2, 0.5, 0)]  # slot 3 was never reached


@pytest.mark.slow  # the slow tier (make test-slow)
def test_dspark_confidence_label_greedy_trains_and_bad_labels_are_refused(default_target, tiny_training, one_thread):
    """The confidence head can learn greedy acceptance (what T=0 verification keeps), the
    sampled one (1 - TV) or their mean; anything else is one line."""
    from methods.dflash.training import DSPARK_DEFAULTS, train_block

    summary = train_block(default_target, tiny_training(1, "dspark", confidence_label="greedy"), "dspark",
                          DSPARK_DEFAULTS)
    assert summary["steps"] == 1 and "bce" in summary["last"]
    with pytest.raises(BenchError, match="confidence_label must be"):
        train_block(default_target, tiny_training(1, "dspark-bad", confidence_label="always"), "dspark",
                    DSPARK_DEFAULTS)


def test_block_ce_labels_are_the_data_tokens_or_the_target_distribution(default_target, tiny_training, one_thread):
    """labels=data (DFlash's default, SpecForge's CE) scores each draft against the data's
    token at its position; labels=target against the target's softmax there; other values
    are one line."""
    import torch.nn.functional as F

    from methods.dflash.training import train_block

    model = random_model(default_target, block=4, anchor=False, draft_vocab=None)
    lm_head = default_target.engine.lm_head.float()[model.draft_to_target]
    width, final = 12, default_target.config.num_hidden_layers
    torch.manual_seed(0)
    batch = {"tokens": torch.randint(0, 1000, (1, width)), "mask": torch.ones(1, width, dtype=torch.bool),
             "lengths": torch.tensor([width]),
             **{f"h{t}": torch.randn(1, width, 576) for t in set(model.config.taps) | {final}}}
    losses = {}
    for labels in ("data", "target"):
        objective = BlockObjective(model, default_target.engine.embed.float(), lm_head, final,
                                   BlockTrainSettings(block_size=4, anchors=3, labels=labels))
        torch.manual_seed(1)  # the same anchors for both
        loss, _ = objective.loss(batch)
        torch.manual_seed(1)
        out = objective.forward(batch)
        log_p = model.logits(out["hidden"], lm_head).log_softmax(-1)
        rows = out["slots"]
        weights = objective.slot_weights[rows]
        if labels == "data":
            expected = F.nll_loss(log_p, out["label"], reduction="none")
            drafted = model.draft_to_target[out["label"]]
            assert torch.isin(drafted, batch["tokens"][0]).all()
        else:
            expected = -(F.linear(out["teacher"], lm_head).softmax(-1) * log_p).sum(-1)
        losses[labels] = float(loss.detach())
        assert abs(float(loss) - float((weights * expected).sum() / weights.sum())) < 1e-4
    assert losses["data"] != losses["target"]
    with pytest.raises(BenchError, match="labels must be"):
        train_block(default_target, tiny_training(1, "dflash-bad", labels="soft"), "dflash")


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("dspark", [False, True])
def test_the_loss_in_row_chunks_equals_the_loss_at_once(default_target, dspark):
    """loss_chunk_rows computes the loss over the scored slots a chunk at a time (each chunk's
    logits recomputed in the backward) and checkpoint_layers recomputes the draft layers there:
    the same loss, metrics and gradients as all at once, up to the order of the sums; with
    DSpark's Markov head, L1 and confidence terms too; and so do the slots' terms through
    torch.compile (`bench train --compile`), chunked and recomputed."""
    from methods.dflash.training import DSPARK_DEFAULTS

    model = random_model(default_target, block=4, markov=8 if dspark else 0, confidence=dspark, anchor=dspark,
                         draft_vocab=None)
    lm_head = default_target.engine.lm_head.float()[model.draft_to_target]
    width, final = 24, default_target.config.num_hidden_layers
    torch.manual_seed(0)
    batch = {"tokens": torch.randint(0, 1000, (2, width)), "mask": torch.ones(2, width, dtype=torch.bool),
             "lengths": torch.tensor([width, width - 5]),
             **{f"h{t}": torch.randn(2, width, 576) for t in set(model.config.taps) | {final}}}
    options = {k: v for k, v in DSPARK_DEFAULTS.items() if k in ("ce_weight", "l1_weight", "bce_weight")} \
        if dspark else {}
    results = []
    compiles = shutil.which("g++") is not None  # torch.compile on a CPU needs a C++ compiler
    for chunk, recompute, compiled in ((0, False, False), (7, True, False)) + (((7, True, True),) if compiles else ()):
        objective = BlockObjective(model, default_target.engine.embed.float(), lm_head, final,
                                   BlockTrainSettings(block_size=4, anchors=5, loss_chunk_rows=chunk,
                                                      checkpoint_layers=recompute, **options), compile=compiled)
        model.zero_grad()
        torch.manual_seed(1)  # the same anchors
        loss, metrics = objective.loss(batch)
        loss.backward()
        results.append((float(loss), metrics, {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}))
    (whole, whole_metrics, whole_grads) = results[0]
    assert not dspark or any("markov" in n for n in whole_grads)
    for chunked, chunked_metrics, chunked_grads in results[1:]:
        assert whole_metrics["tokens"] == chunked_metrics["tokens"] and set(whole_metrics) == set(chunked_metrics)
        assert chunked == pytest.approx(whole, rel=1e-5)
        assert all(chunked_metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6) for k, v in whole_metrics.items())
        assert set(whole_grads) == set(chunked_grads)
        for name, grad in whole_grads.items():
            assert float((chunked_grads[name] - grad).norm()) <= 1e-4 * float(grad.norm()) + 1e-9, name  # fp32 sums


def test_no_more_blocks_than_the_row_with_most_reply_positions(default_target):
    """anchors=512 on short replies: the blocks are as many as the row with the most candidate
    anchors has (the rest would be computed and never scored), every candidate among them."""
    model = random_model(default_target, block=4, draft_vocab=None)
    lm_head = default_target.engine.lm_head.float()[model.draft_to_target]
    objective = BlockObjective(model, default_target.engine.embed.float(), lm_head, 30,
                               BlockTrainSettings(block_size=4, anchors=512))
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 10:17], mask[1, 20:23] = True, True  # 7 and 3 candidate anchors
    blocks = objective.blocks({"tokens": torch.zeros(2, 40, dtype=torch.long), "mask": mask,
                               "lengths": torch.tensor([40, 40])})
    assert blocks["anchors"].shape[1] == 7
    assert sorted(blocks["anchors"][0].tolist()) == list(range(10, 17))
    assert set(range(20, 23)) <= set(blocks["anchors"][1].tolist())


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("anchor_context", [False, True])
def test_block_rounds_replay_the_loops_drafts(default_target, one_thread, monkeypatch, anchor_context):
    """methods/dflash/rounds (bench train's held-out τ, bench rounds): every round's
    drafts come back from one target pass over the finished turn (each block sees the features
    strictly before its root), so the replayed rounds are the loop's; also where every slot's
    input adds the context row before the root (`anchor_context`)."""
    from bench.rounds import recorded_rounds
    from methods.dflash import Options, load_model
    from methods.dflash.rounds import chain_drafts, sequence_rounds

    target = default_target
    prompt = prompt_of(target)
    model, _ = load_model(target, "dflash", Options(dtype="float32"))  # the shipped drafter: it accepts some
    model.config.anchor_context = model.config.anchor_embedding = anchor_context
    size = model.config.drafts_per_block
    drafter = BlockDrafter(target, model, BlockSettings(mode="chain", block=size), "dflash")
    seen, propose = [], drafter.propose

    def recording(state):
        draft = propose(state)
        seen.append((len(state.tokens) - 1, draft.tokens))
        return draft

    drafter.propose = recording
    result = decode(target.engine, drafter, prompt, DecodeConfig(max_new_tokens=48, sampling=SamplingConfig(0.0)))
    tokens = torch.tensor(prompt + result.tokens)
    hidden = target.engine.prefill(tokens, taps=tuple(model.config.taps), logits_rows="none").hidden
    lm_head = target.engine.lm_head[model.draft_to_target]
    roots, counts = [root for root, _ in seen], [len(draft) for _, draft in seen]
    assert size in counts and min(counts) < size  # full blocks, and the last rounds' shorter ones
    taps = [hidden[t] for t in model.config.taps]
    replayed = chain_drafts(model, target.engine.embed, lm_head, tokens, taps, roots, counts)
    assert replayed == [draft for _, draft in seen]
    from methods.dflash import rounds as rounds_module

    monkeypatch.setattr(rounds_module, "ARGMAX_CHUNK_ROWS", 7)  # the drafts scored a few rows at a time
    assert chain_drafts(model, target.engine.embed, lm_head, tokens, taps, roots, counts) == replayed
    # a block that also saw its root's own feature would draft otherwise: the replay tells them apart
    shifted = [torch.cat([t[1:], t[-1:]]) for t in taps]
    assert chain_drafts(model, target.engine.embed, lm_head, tokens, shifted, roots, counts) != replayed
    # and the loop's rounds follow from the replayed drafts
    reply = torch.arange(len(tokens)) >= len(prompt)
    rounds = sequence_rounds(model, target.engine.embed, lm_head, tokens, taps, reply,
                             reply & (torch.arange(len(tokens)) < len(tokens) - 1), 48)
    assert rounds == recorded_rounds({"accept_lengths": result.accept_lengths}) and rounds[1] > 0


@pytest.mark.slow  # the slow tier (make test-slow)
def test_recipe_deviations_train_decode_losslessly_and_are_probed(default_target, tiny_training, one_thread):
    """The ablation's named deviations (a norm per tap, a learned mask input, the final norm at
    ones, a draft vocabulary sized by coverage) reach the drafter config, decode losslessly,
    cannot be exported to a published layout, and the export's context probe scores the first
    draft with the real context, position a-1 withheld and the anchor masked."""
    import bench.registry as registry
    from methods.dflash.formats import export_drafter
    from methods.dflash.training import train_block

    settings = tiny_training(2, "deviations", tap_norm="true", learned_mask="true", anchor_context="true",
                             anchor_embedding="true",
                             norm_init="ones",
                             vocab_coverage="0.5", draft_vocab=0)
    train_block(default_target, settings, "dflash")
    manifest = json.loads((settings.out_dir / "drafter.json").read_text())
    arch = manifest["architecture"]
    assert arch["tap_norm"] and arch["learned_mask"] and arch["anchor_context"] and arch["anchor_embedding"]
    assert 0 < arch["draft_vocab_size"] < 49152
    probe = manifest["heldout"]["context_probe"]
    assert set(probe) == {"real", "drop_previous", "anchor_masked", "positions"} and probe["positions"] > 0
    assert all(0 <= probe[k] <= 1 for k in ("real", "drop_previous", "anchor_masked"))
    prompt = prompt_of(default_target)
    config = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(0.0))
    reference = decode(default_target.engine, Drafter(), prompt, config).tokens
    for name in ("dflash", "ddtree"):
        decoder = registry.build_decoder(name, default_target, {"drafter": str(settings.out_dir)})
        assert decoder.run_turn(prompt, config).tokens == reference
    with pytest.raises(BenchError, match="tap_norm and learned_mask"):
        export_drafter(default_target, settings.out_dir, "speculators", settings.out_dir / "x", ("dflash",))
    with pytest.raises(BenchError, match="norm_init must be"):
        train_block(default_target, tiny_training(1, "bad", norm_init="zeros"), "dflash")


def test_probes_change_only_what_they_name(default_target):
    """hide=1 hides exactly each block's position a-1 from its context; mask_anchor swaps the
    anchor slot's input for the mask slots' and nothing else."""
    model = random_model(default_target, block=4, draft_vocab=None)
    lm_head = default_target.engine.lm_head.float()[model.draft_to_target]
    objective = BlockObjective(model, default_target.engine.embed.float(), lm_head, 30,
                               BlockTrainSettings(block_size=4, anchors=3))
    width = 16
    batch = {"tokens": torch.randint(0, 1000, (1, width)), "mask": torch.ones(1, width, dtype=torch.bool),
             "lengths": torch.tensor([width])}
    torch.manual_seed(3)
    seen = objective.blocks(batch)
    torch.manual_seed(3)
    hidden = objective.blocks(batch, hide=1)
    assert torch.equal(seen["anchors"], hidden["anchors"])
    changed = seen["context_visible"] & ~hidden["context_visible"]
    anchors = seen["anchors"][0].repeat_interleave(4)
    assert changed[0].sum(-1).tolist() == [int(a >= 1) for a in anchors.tolist()]
    assert all(changed[0, i, a - 1] for i, a in enumerate(anchors.tolist()) if a >= 1)
    assert not (hidden["context_visible"] & ~seen["context_visible"]).any()
