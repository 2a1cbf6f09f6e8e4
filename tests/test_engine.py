"""The compact engine against HF transformers, and KV-cache commit/rollback."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.core.draft import Draft
from bench.core.engine import Engine
from bench.core.errors import BenchError

TOLERANCE = 1e-4  # max abs logit difference allowed against HF in fp32


def tiny_model(model_type: str = "llama", seed: int = 0, vocab_size: int = 211, **extra):
    """A small random-weight model of a supported family (fast, no files)."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-inits some norms/biases; randomise so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def engine_for(model) -> Engine:
    return Engine(model.config, model.state_dict())


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {"head_dim": 16}),
])
def test_logits_and_hidden_match_hf(model_type, extra):
    model = tiny_model(model_type, **extra)
    engine = engine_for(model)
    tokens = torch.randint(0, 211, (23,))
    out = engine.prefill(tokens, taps=(0, 2, 3), logits_rows="all")
    with torch.no_grad():
        ref = model(tokens[None], output_hidden_states=True)
    assert (out.logits - ref.logits[0]).abs().max() <= TOLERANCE
    for tap in (0, 2, 3):
        assert (out.hidden[tap] - ref.hidden_states[tap][0]).abs().max() <= TOLERANCE
    # Incremental steps on the cache equal a full recompute.
    extra_tokens = torch.randint(0, 211, (5,))
    for i, token in enumerate(extra_tokens):
        step = engine.forward(token[None])
        with torch.no_grad():
            full = model(torch.cat([tokens, extra_tokens[: i + 1]])[None]).logits[0, -1]
        assert (step.logits[0] - full).abs().max() <= TOLERANCE


def test_unsupported_architecture_is_a_clear_error():
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(BenchError, match="not supported"):
        Engine(config, {})


def test_chain_verify_then_crop_equals_sequential():
    engine = engine_for(tiny_model())
    prompt = torch.randint(0, 211, (11,))
    engine.prefill(prompt)
    start = engine.length
    block = torch.randint(0, 211, (6,))
    multi = engine.forward(block)
    engine.crop(start + 3)  # keep root + 2 drafts
    after = engine.forward(torch.tensor([7]))
    # Reference: a fresh sequence fed token by token.
    ref = engine_for(tiny_model())
    ref.prefill(prompt)
    singles = [ref.forward(t[None]).logits[0] for t in block[:3]]
    ref_after = ref.forward(torch.tensor([7])).logits[0]
    for i in range(3):
        assert (multi.logits[i] - singles[i]).abs().max() <= TOLERANCE
    assert (after.logits[0] - ref_after).abs().max() <= TOLERANCE


def test_tree_verify_and_compaction_equal_the_accepted_path():
    model = tiny_model(seed=3)
    engine = engine_for(model)
    prompt = torch.randint(0, 211, (9,))
    engine.prefill(prompt)
    root = 5
    # root -> a(0) -> c(2) -> e(4); root -> b(1) -> d(3)
    draft = Draft(tokens=[10, 20, 30, 40, 50], parents=[-1, -1, 0, 1, 2])
    start = engine.length
    tokens, positions, mask = draft.verify_inputs(root, start)
    assert positions.tolist() == [start, start + 1, start + 1, start + 2, start + 2, start + 3]
    out = engine.forward(tokens, positions, mask)
    path = [root, 10, 30, 50]  # nodes 0, 2, 4 -> rows 1, 3, 5
    with torch.no_grad():
        ref = model(torch.cat([prompt, torch.tensor(path)])[None]).logits[0, -len(path):]
    for row, ref_row in zip([0, 1, 3, 5], ref):
        assert (out.logits[row] - ref_row).abs().max() <= TOLERANCE
    # Branch b/d sees the root but not a/c.
    with torch.no_grad():
        ref_b = model(torch.cat([prompt, torch.tensor([root, 20, 40])])[None]).logits[0, -2:]
    assert (out.logits[2] - ref_b[0]).abs().max() <= TOLERANCE
    assert (out.logits[4] - ref_b[1]).abs().max() <= TOLERANCE
    # Keep the accepted path, then decode on: must equal the plain sequence.
    engine.keep(start, [0, 1, 3, 5])
    assert engine.length == start + 4
    nxt = engine.forward(torch.tensor([77])).logits[0]
    with torch.no_grad():
        ref_next = model(torch.cat([prompt, torch.tensor(path + [77])])[None]).logits[0, -1]
    assert (nxt - ref_next).abs().max() <= TOLERANCE


def test_cache_grows_past_capacity():
    engine = engine_for(tiny_model())
    engine.reset(capacity=8)
    tokens = torch.randint(0, 211, (20,))
    out = engine.forward(tokens, logits_rows="last")
    assert engine.length == 20 and engine.cache.capacity >= 20
    ref = engine_for(tiny_model())
    assert (out.logits[0] - ref.prefill(tokens).logits[0]).abs().max() <= TOLERANCE


def test_crop_rejects_growth():
    engine = engine_for(tiny_model())
    engine.prefill(torch.randint(0, 211, (4,)))
    with pytest.raises(ValueError):
        engine.crop(9)


def test_logits_rows_selection():
    engine = engine_for(tiny_model())
    tokens = torch.randint(0, 211, (7,))
    full = engine.prefill(tokens, logits_rows="all").logits
    some = engine_for(tiny_model()).prefill(tokens).logits  # "last" by default
    assert some.shape == (1, 211) and torch.allclose(some[0], full[-1], atol=1e-5)


def test_default_target_matches_hf(default_target, hf_model):
    """The real embedded target: prefill and incremental logits within 1e-4 of HF."""
    tokenizer = default_target.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three prime numbers."}],
                                        add_generation_prompt=True, tokenize=True)
    ids = torch.tensor(ids["input_ids"] if hasattr(ids, "keys") else ids)
    engine = default_target.engine
    out = engine.prefill(ids, logits_rows="all", taps=(15,))
    with torch.no_grad():
        ref = hf_model(ids[None], output_hidden_states=True)
    assert (out.logits - ref.logits[0]).abs().max() <= TOLERANCE
    assert (out.hidden[15] - ref.hidden_states[15][0]).abs().max() <= TOLERANCE
    token = out.logits[-1].argmax()[None]
    step = engine.forward(token).logits[0]
    with torch.no_grad():
        full = hf_model(torch.cat([ids, token])[None]).logits[0, -1]
    assert (step - full).abs().max() <= TOLERANCE


def test_full_slot_mask_hides_earlier_siblings():
    """A tree drafted level by level: level-2 nodes must not see level-1 siblings."""
    model = tiny_model(seed=5)
    engine = engine_for(model)
    prompt = torch.randint(0, 211, (8,))
    engine.prefill(prompt)
    start = engine.length
    engine.forward(torch.tensor([30, 40]), torch.tensor([start, start]), torch.eye(2, dtype=torch.bool))
    # child of 40 (slot start+1) at depth 2: sees the prompt and 40, not 30
    mask = torch.zeros(1, start + 3, dtype=torch.bool)
    mask[0, :start] = True
    mask[0, start + 1] = True
    mask[0, start + 2] = True
    out = engine.forward(torch.tensor([50]), torch.tensor([start + 1]), mask)
    with torch.no_grad():
        ref = model(torch.cat([prompt, torch.tensor([40, 50])])[None]).logits[0, -1]
    assert (out.logits[0] - ref).abs().max() <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_engine_runs_close_to_fp32(dtype):
    model = tiny_model(seed=2)
    tokens = torch.randint(0, 211, (12,))
    full = engine_for(model).prefill(tokens, logits_rows="all").logits
    half_engine = Engine(model.config, model.state_dict(), dtype=dtype)
    half = half_engine.prefill(tokens, logits_rows="all", taps=(2,))
    assert half.logits.dtype == torch.float32 and half.hidden[2].dtype == dtype
    assert (half.logits - full).abs().max() < 0.1
    step = half_engine.forward(torch.tensor([3]))
    assert torch.isfinite(step.logits).all()


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_slot_batch_decodes_each_slot_as_the_engine_alone(default_target, dtype_name):
    """bench.core.slots: slots of different lengths, one refilled and one moved mid-way,
    each produce the engine's own greedy tokens for their prompt; in bf16 on the CPU
    kernels (self-distillation's generator) bit for bit, the engine decoding alone."""
    import torch

    from bench.core.cpu_kernels import kernels

    dtype = getattr(torch, dtype_name)
    if dtype == torch.bfloat16 and kernels() is None:
        pytest.skip("no CPU kernels here: the bf16 slot step is not batch-invariant without them")

    from bench.core.decode import DecodeConfig, Drafter, decode
    from bench.core.engine import Engine
    from bench.core.sampling import SamplingConfig
    from bench.core.slots import SlotBatch
    from bench.core.target import load_state_dict

    target = default_target
    texts = ("The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village,")
    prompts = [target.tokenizer(text)["input_ids"] for text in texts]
    config = DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(0.0))
    engine = Engine(target.config, load_state_dict(target.path), dtype=dtype)
    alone = Engine(target.config, load_state_dict(target.path), dtype=dtype)
    expected = [decode(alone, Drafter(), p, config).tokens for p in prompts]
    batch = SlotBatch(engine, slots=2, capacity=64)
    got = [[batch.start(0, prompts[0])], [batch.start(1, prompts[1])], []]
    for _ in range(3):
        for row, token in enumerate(batch.step().tolist()):
            got[row].append(token)
    got[2].append(batch.start(0, prompts[2]))  # slot 0 refilled while slot 1 is mid-reply
    owner = [2, 1]
    for _ in range(4):
        for row, token in zip(owner, batch.step().tolist()):
            got[row].append(token)
    batch.move(1, 0)  # slot 1 packed into slot 0; slot 0's reply stops here
    owner = [1]
    got[1].append(batch.step(live=1).item())
    assert got[0] == expected[0][:4]
    assert got[1] == expected[1][:9]
    assert got[2] == expected[2][:5]
    assert torch.equal(batch.lengths[:1], torch.tensor([len(prompts[1]) + 8]))


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_passes_are_batch_invariant(default_target, threads):
    """Every row of a k-token pass (chains up to 40 rows, a tree) gets the bits of a
    one-token pass, on the machine at hand; NaN in stale cache slots reaches no real row."""
    import torch

    from bench.core.draft import Draft
    from bench.core.engine import Engine
    from bench.core.target import load_state_dict

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = Engine(default_target.config, load_state_dict(default_target.path), dtype=torch.bfloat16)
        assert engine.invariant
        prompt = torch.tensor(default_target.tokenizer("def fibonacci(n):\n    return")["input_ids"])
        tokens = torch.randint(0, engine.vocab_size, (40,), generator=torch.Generator().manual_seed(threads))
        for k in (2, 9, 17, 40):
            engine.prefill(prompt)
            start = engine.length
            engine.cache.k[:, :, :, start:] = float("nan")  # stale slots poisoned
            engine.cache.v[:, :, :, start:] = float("nan")
            block = engine.forward(tokens[:k]).logits
            engine.crop(start)
            single = torch.cat([engine.forward(tokens[i:i + 1]).logits for i in range(k)])
            assert torch.equal(block, single), k
            assert not block.isnan().any()
        generator = torch.Generator().manual_seed(10 + threads)
        for _ in range(6):  # random 24-node trees: a path's rows equal the chain of that path
            parents = [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(24)]
            draft = Draft(tokens[1:25].tolist(), parents)
            engine.prefill(prompt)
            start = engine.length
            block, positions, mask = draft.verify_inputs(int(tokens[0]), start)
            logits = engine.forward(block, positions, mask).logits
            node, path = max(range(24), key=lambda i: draft.depths()[i]), []
            while node >= 0:
                path, node = [node] + path, parents[node]
            engine.crop(start)
            chain = engine.forward(torch.tensor([int(tokens[0])] + [draft.tokens[i] for i in path])).logits
            assert torch.equal(logits[[0] + [i + 1 for i in path]], chain)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_bucket_padded_passes_equal_unpadded(default_target, dtype_name):
    """A pass padded to VERIFY_BUCKETS rows gives its real rows the argmax (fp32) or the
    bits (bf16, batch-invariant) of the unpadded pass; padding rows whose inputs are NaN
    and NaN in stale cache slots reach no real row; the cache keeps only the real rows."""
    import torch

    from bench.core.draft import Draft
    from bench.core.engine import PAD_TOKEN, VERIFY_BUCKETS, Engine
    from bench.core.target import load_state_dict

    dtype = getattr(torch, dtype_name)
    plain = Engine(default_target.config, load_state_dict(default_target.path), dtype=dtype)
    padded = Engine(default_target.config, load_state_dict(default_target.path), dtype=dtype)
    padded.buckets = VERIFY_BUCKETS
    poisoned = padded.embed.clone()
    poisoned[PAD_TOKEN] = float("nan")  # padding rows start from NaN (lm_head keeps the real rows)
    padded.embed = poisoned
    prompt = torch.tensor(default_target.tokenizer("def fibonacci(n):\n    return")["input_ids"])
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, plain.vocab_size, (40,), generator=generator)
    cases = [(tokens[:k], None, None) for k in (1, 3, 5, 13, 17, 30)]
    for nodes in (6, 20):
        parents = [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(nodes)]
        cases.append(Draft(tokens[1:nodes + 1].tolist(), parents).verify_inputs(int(tokens[0]), 0))
    for block, positions, mask in cases:
        outputs = []
        for engine in (plain, padded):
            engine.prefill(prompt)
            start = engine.length
            engine.cache.k[:, :, :, start:] = float("nan")  # stale slots poisoned
            engine.cache.v[:, :, :, start:] = float("nan")
            out = engine.forward(block, None if positions is None else positions + start, mask, taps=(15,))
            assert engine.length == start + len(block)
            assert out.logits.shape[0] == len(block) and out.hidden[15].shape[0] == len(block)
            assert not out.logits.isnan().any() and not out.hidden[15].isnan().any()
            after = engine.forward(torch.tensor([int(tokens[-1])])).logits  # decoding goes on from the real rows
            outputs.append((out.logits, after))
        (logits, after), (padded_logits, padded_after) = outputs
        assert padded.bucket(len(block)) > len(block) or len(block) in VERIFY_BUCKETS
        if dtype == torch.bfloat16:
            assert torch.equal(logits, padded_logits) and torch.equal(after, padded_after), len(block)
        else:
            assert torch.equal(logits.argmax(-1), padded_logits.argmax(-1)), len(block)
            assert torch.equal(after.argmax(-1), padded_after.argmax(-1))
