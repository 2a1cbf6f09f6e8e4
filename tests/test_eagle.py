"""EAGLE-1/2/3: tree construction, lossless decoding with untrained heads, the head's
context cache, training and resume, our drafter format and the published formats."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.errors import BenchError
from bench.core.sampling import SamplingConfig
from methods.eagle.drafter import EagleDrafter, TreeSettings, tree_from_accuracy
from methods.eagle.model import EagleConfig, EagleHead, rope_theta
from methods.eagle.training import eagle3_taps, shifted

STATIC = TreeSettings(mode="static", paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))


def prompt_of(target, text="Write a python function that adds two numbers."):
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def random_head(target, kind, seed=0, draft_vocab=None):
    torch.manual_seed(seed)
    layers = target.config.num_hidden_layers
    taps = eagle3_taps(layers) if kind == "eagle3" else [layers]
    head = EagleHead(EagleConfig.for_target(target.config, kind, taps, draft_vocab))
    if draft_vocab:
        head.draft_to_target.copy_(torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values)
    return head


def test_tree_from_accuracy_picks_the_best_paths():
    paths = tree_from_accuracy([0.6, 0.2, 0.1], nodes=4)
    # values: (0)=.6, (0,0)=.36, (0,0,0)=.216, (1)=.2, (0,1)=.12 ...
    assert paths == [(0,), (1,), (0, 0), (0, 0, 0)]
    assert all(p[:-1] in paths for p in paths if len(p) > 1)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_untrained_heads_are_lossless(default_target, one_thread, kind):
    target = default_target
    prompt = prompt_of(target)
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(0.0))
    reference = decode(target.engine, Drafter(), prompt, config).tokens
    head = random_head(target, kind, draft_vocab=4096 if kind == "eagle3" else None)
    for tree in (TreeSettings(total_token=8, depth=4, top_k=3), STATIC):
        result = decode(target.engine, EagleDrafter(target, head, tree), prompt, config)
        assert result.tokens == reference
        assert max(result.tree_sizes) == (7 if tree.mode == "dynamic" else 6)
    generator = torch.Generator().manual_seed(0)
    sampled = decode(target.engine, EagleDrafter(target, head, TreeSettings()), prompt,
                     DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(0.8)), generator)
    assert len(sampled.tokens) == 12


def test_draft_tokens_come_from_the_draft_vocabulary(default_target):
    head = random_head(default_target, "eagle3", draft_vocab=512)
    drafter = EagleDrafter(default_target, head, TreeSettings(total_token=10, depth=3, top_k=3))
    prompt = prompt_of(default_target)
    out = default_target.engine.prefill(torch.tensor(prompt), taps=drafter.taps, logits_rows="last")
    from bench.core.decode import DecodeState

    state = DecodeState(tokens=prompt + [int(out.logits[-1].argmax())], prompt_len=len(prompt),
                        engine=default_target.engine, config=DecodeConfig(), generator=None)
    drafter.begin(state, out)
    draft = drafter.propose(state)
    allowed = set(head.draft_to_target.tolist())
    assert len(draft) == 9 and set(draft.tokens) <= allowed
    depths = draft.depths()
    assert max(depths) <= 3 and depths == sorted(depths)


def test_context_cache_matches_a_fresh_pass(default_target, one_thread):
    """After decoding, the head's context rows (fed round by round from verify passes)
    equal one causal pass over all (feature, next token) pairs of the final sequence."""
    target = default_target
    head = random_head(target, "eagle1", seed=3)
    drafter = EagleDrafter(target, head, TreeSettings(total_token=6, depth=3, top_k=2))
    prompt = prompt_of(target)
    result = decode(target.engine, drafter, prompt, DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(0.0)))
    tokens = prompt + result.tokens
    rows = drafter.context_rows  # every committed row but the last round's (no accept after the end)
    assert len(prompt) <= rows < len(tokens) - 1
    features = target.engine.prefill(torch.tensor(tokens), taps=(30,), logits_rows="none").hidden[30][:rows]
    with torch.no_grad():
        embeds = torch.nn.functional.embedding(torch.tensor(tokens[1: rows + 1]), target.engine.embed)
        hidden = head.fuse([features], embeds)
        q, k, v = head.qkv(hidden[None], embeds[None], torch.arange(rows))
    torch.testing.assert_close(drafter.cache.view(0)[0][:, :, :rows], k, atol=2e-3, rtol=1e-3)


def test_shifted():
    x = torch.arange(6).view(1, 6)
    assert shifted(x, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    assert shifted(x, 0).tolist() == x.tolist()


@pytest.fixture
def tiny_training(default_target, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    from bench.training import TrainSettings

    def make(kind, steps, out):
        return TrainSettings(out_dir=tmp_path / out, max_steps=steps, batch_size=2, lr=1e-3, warmup_steps=1,
                             progress=False, checkpoint_every_s=1e9,
                             options={"feature_tokens": 1500, "draft_vocab": 1024, "ttt_steps": 2})
    return make


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("kind,method", [("eagle1", "eagle"), ("eagle3", "eagle3")])
def test_training_resumes_and_the_drafter_loads(default_target, tiny_training, one_thread, kind, method):
    import bench.registry as registry
    from methods.eagle.training import train_eagle

    first = train_eagle(default_target, tiny_training(kind, 2, method), kind, method)
    assert first["steps"] == 2 and first["resumed_from"] is None
    second = train_eagle(default_target, tiny_training(kind, 3, method), kind, method)
    assert second["resumed_from"] == 2 and second["steps"] == 3
    folder = tiny_training(kind, 3, method).out_dir
    manifest = json.loads((folder / "drafter.json").read_text())
    assert manifest["target"]["fingerprint"] == default_target.fingerprint
    assert manifest["training"]["steps"] == 3 and len(manifest["heldout_rank_accuracy"]["step0"]) == 10
    probe = manifest["heldout"].get("context_probe")  # EAGLE-1's first draft, real and with f_{a-1} withheld
    assert (probe is None) == (kind != "eagle1")
    if probe:  # the real context's first draft is the held-out step-0 top-1 (every position in both)
        assert probe["real"] == pytest.approx(manifest["heldout_rank_accuracy"]["step0"][0], abs=1e-3)
    names = ["eagle", "eagle2"] if kind == "eagle1" else ["eagle3"]
    prompt = prompt_of(default_target)
    config = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(0.0))
    reference = decode(default_target.engine, Drafter(), prompt, config).tokens
    for name in names:
        decoder = registry.build_decoder(name, default_target, {"drafter": str(folder)})
        assert decoder.run_turn(prompt, config).tokens == reference
    wrong = "eagle3" if kind == "eagle1" else "eagle"
    with pytest.raises(BenchError, match="head"):
        registry.build_decoder(wrong, default_target, {"drafter": str(folder)})


def test_a_drafter_for_other_weights_is_refused(default_target, tmp_path):
    import bench.registry as registry
    from methods.eagle.training import export_head

    head = random_head(default_target, "eagle1")
    export_head(head, tmp_path, {"method": "eagle", "target": {"name": "x", "fingerprint": "0" * 16,
                                                             "vocab_size": default_target.config.vocab_size}})
    with pytest.raises(BenchError, match="trained for target"):
        registry.build_decoder("eagle", default_target, {"drafter": str(tmp_path)})
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    manifest = json.loads((tmp_path / "drafter.json").read_text())
    manifest["target"]["fingerprint"] = default_target.fingerprint
    (tmp_path / "drafter.json").write_text(json.dumps(manifest))
    with pytest.raises(BenchError, match="corrupt"):
        registry.build_decoder("eagle", default_target, {"drafter": str(tmp_path)})


def _published_folder(folder, head, target, kind):
    """Write `head` in SafeAILab/EAGLE's layout (names, config fields)."""
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    weights = {"fc.weight": sd["fc.weight"]}
    for p in "qkvo":
        weights[f"{prefix}self_attn.{p}_proj.weight"] = sd[f"{p}_proj.weight"]
    for p in ("gate", "up", "down"):
        weights[f"{prefix}mlp.{p}_proj.weight"] = sd[f"{p}_proj.weight"]
    weights[f"{prefix}post_attention_layernorm.weight"] = sd["post_norm"]
    c = target.config
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size, "num_hidden_layers": 1,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "vocab_size": c.vocab_size,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": rope_theta(c)}
    if kind == "eagle3":
        weights.update({"midlayer.input_layernorm.weight": sd["embed_norm"],
                        "midlayer.hidden_norm.weight": sd["hidden_norm"], "norm.weight": sd["final_norm"],
                        "lm_head.weight": sd["lm_head.weight"]})
        draft_ids = sd["draft_to_target"]
        weights["d2t"] = draft_ids - torch.arange(draft_ids.numel())
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        weights["t2d"] = t2d
        config["draft_vocab_size"] = int(draft_ids.numel())
    else:
        weights["fc.bias"] = sd["fc.bias"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_published_layout_loads_the_same_head(default_target, tmp_path, kind):
    from methods.eagle.published import load_published

    source = random_head(default_target, kind, seed=5, draft_vocab=2048 if kind == "eagle3" else None)
    if kind == "eagle1":
        source.config.norm_hidden = False  # published EAGLE-1 heads have no input norm
    _published_folder(tmp_path, source, default_target, kind)
    loaded, manifest = load_published(default_target, tmp_path, kind)
    assert manifest["published"] == str(tmp_path)
    hidden, embeds = torch.randn(5, 576), torch.randn(5, 576)
    with torch.no_grad():
        expected = source.logits(source.forward_train(hidden[None], embeds[None], torch.arange(5)[None]),
                                 default_target.engine.lm_head)
        got = loaded.logits(loaded.forward_train(hidden[None], embeds[None], torch.arange(5)[None]),
                            default_target.engine.lm_head)
    torch.testing.assert_close(got, expected)
    if kind == "eagle3":
        assert torch.equal(loaded.draft_to_target, source.draft_to_target)
    other = "eagle3" if kind == "eagle1" else "eagle1"
    with pytest.raises(BenchError, match="holds an"):
        load_published(default_target, tmp_path, other)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(BenchError, match="has no"):
        load_published(default_target, tmp_path, kind)


def test_draft_vocabulary_sized_by_coverage():
    from methods.eagle.training import vocabulary_for_coverage

    tokens = torch.tensor([0, 5, 5, 5, 5, 7, 7, 9, 1, 2])  # reply tokens (mask on 1..8): 5 x4, 7 x2, 9, 1
    mask = torch.tensor([True] * 8 + [False] * 2)
    assert vocabulary_for_coverage(tokens, mask, 16, 0.5) == 1  # token 5 alone is half
    assert vocabulary_for_coverage(tokens, mask, 16, 0.75) == 2
    assert vocabulary_for_coverage(tokens, mask, 16, 1.0) == 4


@pytest.mark.slow  # the slow tier (make test-slow)
def test_shared_lm_head_is_the_targets_rows_frozen_and_not_stored(default_target, tiny_training, one_thread, tmp_path):
    """`--option shared_lm_head=true` (EAGLE-3): the head projects with the target's
    lm_head rows at its draft vocabulary; they stay frozen, the file omits them, and the
    loaded drafter (and its speculators export) has them back bit for bit."""
    from safetensors import safe_open

    from methods.eagle import load_head
    from methods.eagle.published import export_published, load_published
    from methods.eagle.training import train_eagle

    settings = tiny_training("eagle3", 2, "eagle3-shared")
    settings.options["shared_lm_head"] = True
    train_eagle(default_target, settings, "eagle3", "eagle3")
    with safe_open(str(settings.out_dir / "model.safetensors"), "pt") as handle:
        assert "lm_head.weight" not in handle.keys() and "draft_to_target" in handle.keys()
    options = type("Options", (), {"drafter": str(settings.out_dir), "dtype": "float32"})()
    head, manifest = load_head(default_target, "eagle3", options, "eagle3")
    assert head.config.shared_lm_head and manifest["architecture"]["shared_lm_head"]
    rows = default_target.engine.lm_head[head.draft_to_target]
    assert torch.equal(head.lm_head.weight, rows)
    exported = export_published(head, default_target, "speculators", tmp_path / "spec")
    again, _ = load_published(default_target, exported, "eagle3")
    assert torch.equal(again.lm_head.weight, rows)
    with pytest.raises(BenchError, match="EAGLE-3 option"):
        bad = tiny_training("eagle1", 1, "eagle1-shared")
        bad.options["shared_lm_head"] = True
        train_eagle(default_target, bad, "eagle1", "eagle")


def test_dynamic_tree_keeps_the_best_scoring_nodes(default_target, one_thread):
    """The device-built EAGLE-2 tree equals a plain host construction fed the same head
    outputs: expand the top_k best frontier nodes per level (score: summed log-probs, ties
    by creation order), keep the best total_token - 1 nodes, parents first."""
    from bench.core.decode import DecodeState

    head = random_head(default_target, "eagle3", seed=4, draft_vocab=2048)
    settings = TreeSettings(total_token=14, depth=4, top_k=3)
    drafter = EagleDrafter(default_target, head, settings)
    prompt = prompt_of(default_target)
    out = default_target.engine.prefill(torch.tensor(prompt), taps=drafter.taps, logits_rows="last")
    state = DecodeState(tokens=prompt + [int(out.logits[-1].argmax())], prompt_len=len(prompt),
                        engine=default_target.engine, config=DecodeConfig(), generator=None)
    drafter.begin(state, out)
    levels = []  # the log-probs each level's frontier got, in the order it was run
    run_nodes = drafter._run_nodes
    drafter._run_nodes = lambda tree, nodes: levels.append(run_nodes(tree, nodes)) or levels[-1]
    root_out = drafter._extend_context()
    root, vocab = drafter._log_probs(root_out[None])
    draft = drafter._dynamic(root[0], vocab, root_out)

    tokens, parents, scores = [], [], []  # the host construction
    values, ids = root[0].topk(3)
    frontier = []
    for v, i in zip(values.tolist(), ids.tolist()):
        frontier.append(len(tokens))
        tokens.append(int(vocab[i])), parents.append(-1), scores.append(v)
    for log_probs in levels:
        values, ids = log_probs.topk(3, dim=-1)
        candidates = []
        for row, node in enumerate(frontier):
            for v, i in zip(values[row].tolist(), ids[row].tolist()):
                candidates.append(len(tokens))
                tokens.append(int(vocab[i])), parents.append(node), scores.append(scores[node] + v)
        frontier = sorted(candidates, key=lambda n: -scores[n])[:3]
    best = sorted(range(len(tokens)), key=lambda n: (-scores[n], n))[:13]
    depth = [0] * len(tokens)
    for n, p in enumerate(parents):
        depth[n] = 1 if p < 0 else depth[p] + 1
    order = sorted(best, key=lambda n: (depth[n], n))
    assert all(parents[n] in best for n in best if parents[n] >= 0)  # ancestor-closed by the scores alone
    assert len(levels) == 3
    assert draft.tokens == [tokens[n] for n in order]
    assert draft.parents == [order.index(parents[n]) if parents[n] >= 0 else -1 for n in order]


def test_fr_spec_drafts_only_frequent_tokens_and_stays_lossless(default_target, one_thread, tmp_path, monkeypatch):
    """FR-Spec (draft_vocab=N on eagle / eagle2): the N most frequent tokens of the target's own
    distilled replies, EOS kept; the head drafts only those; the output is AR's; the run records
    where they were counted; eagle3 refuses the option."""
    import gzip

    from bench import registry
    from bench.training import distill
    from methods.eagle.fr_spec import frequent_tokens

    target = default_target
    folder = tmp_path / "distilled" / target.name / "bfloat16-test"
    folder.mkdir(parents=True)
    # replies: token 100 five times, 200 four, 300 three, 400 twice; the prompt tokens (7) never count
    rows = [{"tokens": [7, 7, 7, 100, 100, 200, 300, 400], "reply_spans": [[3, 8]]},
            {"tokens": [7, 100, 100, 100, 200, 200, 200, 300, 300, 400], "reply_spans": [[1, 10]]}]
    with gzip.open(folder / "shard_00000.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    (folder / "index.json").write_text(json.dumps({
        "target": target.name, "target_fingerprint": target.fingerprint,
        "shards": [{"shard": 0, "file": "shard_00000.jsonl.gz", "reply_tokens": 14}]}))
    monkeypatch.setattr(distill, "SHIPPED_ROOTS", [tmp_path / "distilled"])
    eos = set(target.eos_token_ids)
    ids, source = frequent_tokens(target, len(eos) + 3)
    assert ids.tolist() == sorted(eos | {100, 200, 300})
    assert source == {"size": len(eos) + 3, "counted_in": "bfloat16-test", "reply_tokens": 14, "coverage": 0.8571}

    ids, _ = frequent_tokens(target, 512)  # the rest by id among tokens never seen
    head = random_head(target, "eagle1")
    drafter = EagleDrafter(target, head, TreeSettings(total_token=10, depth=3, top_k=3), vocab=ids)
    assert drafter.lm_head.shape == (512, target.config.hidden_size)
    prompt = prompt_of(target)
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(0.0))
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda state: proposed.append(draft := propose(state)) or draft
    reference = decode(target.engine, Drafter(), prompt, config).tokens
    assert decode(target.engine, drafter, prompt, config).tokens == reference
    assert proposed and {t for d in proposed for t in d.tokens} <= set(ids.tolist())

    for method in ("eagle", "eagle2"):  # the shipped head; the run's records say where the vocabulary came from
        decoder = registry.build_decoder(method, target, registry.resolve_options(method, {"draft_vocab": "64"}))
        assert decoder.info["fr_spec"]["counted_in"] == "bfloat16-test" and decoder.drafter.lm_head.shape[0] == 64
    with pytest.raises(BenchError, match="own trained draft vocabulary"):
        registry.build_decoder("eagle3", target, {"draft_vocab": 512})


@pytest.mark.slow  # the slow tier (make test-slow)
def test_taps_and_fc_norm_options_and_old_checkpoints_still_resume(default_target, tiny_training, one_thread):
    """`--option taps=2,15,30` and `--option fc_norm=true` (EAGLE-3, named options): the head
    fuses those layers, each RMS-normed before fc, and the drafter reads both back; left at
    their defaults the options are not in the run's identity, so a checkpoint made before
    they existed resumes; bad values are one-line errors."""
    import bench.registry as registry
    from methods.eagle.training import train_eagle

    settings = tiny_training("eagle3", 1, "eagle3-taps")
    settings.options.update(taps="2,15,30", fc_norm="true")
    train_eagle(default_target, settings, "eagle3", "eagle3")
    manifest = json.loads((settings.out_dir / "drafter.json").read_text())
    assert manifest["architecture"]["taps"] == [2, 15, 30] and manifest["architecture"]["fc_norm"] is True
    state = json.loads((settings.out_dir / "checkpoint" / "state.json").read_text())
    assert state["settings"]["train"]["taps"] == "2,15,30" and state["settings"]["train"]["fc_norm"] is True
    prompt = prompt_of(default_target)
    config = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(0.0))
    decoder = registry.build_decoder("eagle3", default_target, {"drafter": str(settings.out_dir)})
    assert decoder.run_turn(prompt, config).tokens == decode(default_target.engine, Drafter(), prompt, config).tokens
    default = tiny_training("eagle3", 1, "eagle3-default-taps")
    train_eagle(default_target, default, "eagle3", "eagle3")
    assert not {"taps", "fc_norm"} & set(json.loads((default.out_dir / "checkpoint" / "state.json").read_text())
                                        ["settings"]["train"])
    for bad, message in (("2,x", "separated by commas"), ("2,2", "distinct"), ("0,15", "between 1 and 30")):
        wrong = tiny_training("eagle3", 1, "eagle3-bad")
        wrong.options["taps"] = bad
        with pytest.raises(BenchError, match=message):
            train_eagle(default_target, wrong, "eagle3", "eagle3")
    eagle1 = tiny_training("eagle1", 1, "eagle1-taps")
    for option, value in (("taps", "2,15,30"), ("fc_norm", "true")):
        eagle1 = tiny_training("eagle1", 1, "eagle1-" + option)
        eagle1.options[option] = value
        with pytest.raises(BenchError, match="EAGLE-3 option"):
            train_eagle(default_target, eagle1, "eagle1", "eagle")


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.parametrize("method,loop,kind", [("eagle3", "eagle3", "eagle3"), ("eagle", "eagle2", "eagle1")])
def test_chain_rounds_replay_the_loops_rounds(default_target, one_thread, method, loop, kind, monkeypatch):
    """rank_accuracy's replay: the head's unrolled pass over a turn (EAGLE-3's TTT pass; EAGLE-1
    fed its own predicted features) drafts, at every row, what a top-1 chain as deep as its
    steps drafts there in the decode loop, so the rounds it replays on a turn the loop decoded
    (the shipped head, fp32) are the loop's own rounds."""
    import bench.registry as registry
    from bench.core.drafters import find_drafter, read_manifest
    from methods.eagle import load_head
    from methods.eagle.training import EagleObjective, EagleTrainSettings, FeatureBatches, rank_accuracy

    folder = find_drafter(default_target.name, method, None)
    steps = read_manifest(folder)["training"]["settings"]["ttt_steps"]
    chain = {"drafter": str(folder), "top_k": 1, "depth": steps, "total_token": steps + 1, "dtype": "float32"}
    decoder = registry.build_decoder(loop, default_target, chain)
    prompt = prompt_of(default_target)
    turn = decoder.run_turn(prompt, DecodeConfig(max_new_tokens=48, sampling=SamplingConfig(0.0)))
    accepted = turn.accept_lengths
    assert max(turn.proposed_lengths) == steps and sum(accepted) > len(accepted) // 2  # the head drafts well

    engine = default_target.engine
    head, _ = load_head(default_target, method, type("Options", (), {"drafter": str(folder), "dtype": "float32"}), kind)
    taps = tuple(sorted(set(head.config.taps) | {engine.num_layers}))
    tokens = torch.tensor(prompt + turn.tokens)
    states = engine.prefill(tokens, taps=taps, logits_rows="none").hidden
    n = len(tokens)
    mask = torch.zeros(n, dtype=torch.bool)  # row t: token t+1 is a reply token (the prefill's row drafts too)
    mask[len(prompt) - 1: n - 1] = True
    pad = 4  # a second, empty conversation: FeatureBatches holds the last one out
    tensors = {"tokens": torch.cat([tokens, torch.zeros(pad, dtype=torch.long)]),
               "loss_mask": torch.cat([mask, torch.zeros(pad, dtype=torch.bool)]),
               "offsets": torch.tensor([0, n, n + pad]),
               **{f"h{t}": torch.cat([states[t].float(), torch.zeros(pad, states[t].shape[-1])]) for t in taps}}
    batches = FeatureBatches(tensors, list(head.config.taps), engine.num_layers, 1, 0)
    batches.heldout_spans = [(0, n)]
    objective = EagleObjective(head, engine.embed.float(), engine.lm_head.float(), engine.num_layers,
                               EagleTrainSettings(ttt_steps=steps))
    accuracy, replay = rank_accuracy(objective, batches)
    assert len(accuracy) == steps
    import methods.eagle.training as training

    monkeypatch.setattr(training, "TEACHER_CHUNK_POSITIONS", 5)  # the teacher's argmax a few positions at a time
    assert rank_accuracy(objective, batches) == (accuracy, replay)
    assert (replay["rounds"], replay["rounds_tau"], replay["rounds_a1"]) == (
        len(accepted), round(1 + sum(accepted) / len(accepted), 4),
        round(sum(a > 0 for a in accepted) / len(accepted), 4)), (replay, accepted)


@pytest.mark.slow  # the slow tier (make test-slow)
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on a CPU needs a C++ compiler")
def test_compiled_training_step_trains_the_same_head(default_target, one_thread, tmp_path, monkeypatch):
    """`bench train --compile`: EAGLE-3's training-time-test layer step, scoring and teacher
    through torch.compile give the eager step's loss, metrics and gradients (fp32, batches of
    different lengths: the graphs' shapes are dynamic); methods without a compiled path refuse
    the flag."""
    from click.testing import CliRunner

    from bench.cli import main
    from methods.eagle.training import EagleObjective, EagleTrainSettings

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    engine = default_target.engine
    head = random_head(default_target, "eagle3")  # the full vocabulary: every position is scored
    settings = EagleTrainSettings(ttt_steps=2)
    embed, lm_head = engine.embed.float(), engine.lm_head.float()
    eager = EagleObjective(head, embed, lm_head, 30, settings)
    compiled = EagleObjective(head, embed, lm_head, 30, settings, compile=True)
    generator = torch.Generator().manual_seed(0)
    for width in (24, 17):
        lengths = torch.tensor([width, width - 5])
        batch = {"tokens": torch.randint(0, 49152, (2, width), generator=generator), "lengths": lengths,
                 "mask": torch.arange(width)[None] < lengths[:, None]}
        for tap in sorted(set(head.config.taps) | {30}):
            batch[f"h{tap}"] = torch.randn(2, width, 576, generator=generator) * 3
        grads = []
        for objective in (eager, compiled):
            head.zero_grad()
            loss, metrics = objective.loss(batch)
            loss.backward()
            grads.append((loss.detach(), metrics, [p.grad.clone() for _, p in objective.named_parameters()]))
        (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = grads
        assert torch.allclose(loss_a, loss_b, rtol=1e-5) and metrics_a["tokens"] == metrics_b["tokens"]
        assert all(abs(metrics_a[k] - metrics_b[k]) < 1e-4 for k in metrics_a)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads_a, grads_b))
    result = CliRunner().invoke(main, ["train", "--method", "medusa", "--compile", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no compiled path (methods with one: eagle3, dflash, dspark)" in result.output
    assert not (tmp_path / "out").exists()


def test_length_grouped_batches_cover_every_conversation_once_with_little_padding():
    """group_by_length: each epoch still serves every training conversation once (whole
    batches), in a seeded order that differs by epoch; a batch's conversations are of about one
    length, so far less padding than random batches; off, the order is the plain shuffle."""
    import torch

    from methods.eagle.training import FeatureBatches

    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 1024, (2000,), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tensors = {"offsets": offsets}
    plain = FeatureBatches(tensors, [2], 30, 4, seed=0)
    grouped = FeatureBatches(tensors, [2], 30, 4, seed=0, group_by_length=True)
    span_length = [b - a for a, b in grouped.train_spans]
    usable = len(grouped.train_spans) // 4 * 4

    def padding(batches: FeatureBatches, epoch: int) -> float:
        order = batches.order(epoch)[:usable]
        cut = [order[i: i + 4] for i in range(0, usable, 4)]
        return 1 - sum(span_length[j] for j in order) / sum(4 * max(span_length[j] for j in b) for b in cut)

    for epoch in (0, 1):
        assert sorted(grouped.order(epoch)) == list(range(len(grouped.train_spans)))
        assert grouped.order(epoch) == FeatureBatches(tensors, [2], 30, 4, seed=0, group_by_length=True).order(epoch)
        assert padding(grouped, epoch) < 0.02 < 0.2 < padding(plain, epoch)
    assert grouped.order(0) != grouped.order(1)
    generator = torch.Generator().manual_seed(0)
    assert plain.order(0) == torch.randperm(len(plain.train_spans), generator=generator).tolist()


def test_the_probes_attention_over_earlier_keys_is_causal_attention_when_nothing_is_withheld():
    """first_draft_probe's attention (earlier rows' keys, then the row's own withheld-feature
    key) with the row's own key left as it is equals plain causal attention."""
    import torch.nn.functional as F

    from methods.eagle.training import _earlier_keys_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(_earlier_keys_attention(q, k, v, k, v), expected, atol=1e-5)
