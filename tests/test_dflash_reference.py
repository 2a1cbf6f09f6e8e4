"""Parity with z-lab's reference DFlash (PyPI `dflash` 0.1.0, `dflash/model.py`).

A tiny random target in Llama and in Qwen3 layout (saved as an HF folder, loaded by our
`load_target`; the transformers model of the same folder is the reference's target) and a
random z-lab-format drafter made by the reference's own `DFlashDraftModel` (saved with
save_pretrained, loaded by our dflash method from the folder). The reference
`dflash_generate` and our decode loop then run the same prompts greedily in fp32: the same
tokens and the same committed tokens per round (accepted drafts + 1, cut at max_new_tokens
and at a stop token, the reference's `acceptance_lengths`).

Random drafters rarely agree with the target, so one drafter is steered: its mask token is
the token the tiny target repeats once it settles, its residual branches are scaled down,
and the target's embedding is tied to its lm_head, so its mask slots draft that token and
whole blocks are accepted (the reference's and our last-round truncation included).
"""

from __future__ import annotations

import time

import pytest
import torch

dflash_model = pytest.importorskip("dflash.model")

from bench.core.decode import DecodeConfig  # noqa: E402
from bench.core.sampling import SamplingConfig  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_clock(monkeypatch):
    """The reference times rounds with torch.cuda.synchronize; a CPU clock instead."""
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def tiny_target(folder, kind: str, tokenizer, seed: int = 0, tie: bool = True):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from bench.core.target import load_target

    torch.manual_seed(seed)
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=6, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=tie,
                 rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1)
    config = LlamaConfig(**shape) if kind == "llama" else Qwen3Config(**shape)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger logits than the init's, so greedy ties are unlikely
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_target(str(folder), "cpu", "float32"), model.eval()


def zlab_drafter(folder, target_model, block_size: int, mask_token_id: int, seed: int = 0, layers: int = 2,
                 steer: bool = False):
    """A random drafter built by the reference itself, saved as z-lab publishes them."""
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    t = target_model.config
    config = Qwen3Config(hidden_size=t.hidden_size, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=layers, vocab_size=t.vocab_size,
                         rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = t.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {"target_layer_ids": dflash_model.build_target_layer_ids(t.num_hidden_layers, layers),
                            "mask_token_id": mask_token_id}
    model = dflash_model.DFlashDraftModel(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_proj):
                proj.weight.mul_(5.0)  # attention that is not uniform, features that matter
            if steer:
                layer.self_attn.o_proj.weight.mul_(0.01)
                layer.mlp.down_proj.weight.mul_(0.01)
    model.save_pretrained(folder)
    return model


def ours(target, folder, prompt, max_new, stops, block=None):
    import bench.registry as registry

    options = {"drafter": str(folder), "dtype": "float32", **({"block": block} if block else {})}
    decoder = registry.build_decoder("dflash", target, options)
    result = decoder.run_turn(prompt, DecodeConfig(max_new_tokens=max_new, sampling=SamplingConfig(0.0),
                                                   eos_token_ids=tuple(stops)))
    committed = [a + 1 for a in result.accept_lengths]  # accepted drafts + the target's own token
    if committed:  # the last round keeps what the turn keeps (max_new_tokens, a stop token)
        committed[-1] = len(result.tokens) - 1 - sum(committed[:-1])
    return result.tokens, committed, decoder


def reference(model, target_model, prompt, max_new, stops, block_size=None):
    out = dflash_model.dflash_generate(model, target_model, torch.tensor([prompt]), max_new, list(stops),
                                       temperature=0.0, block_size=block_size, return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (8 + 3 * i,), generator=generator).tolist() for i in range(count)]


def test_default_taps_are_zlabs():
    from methods.dflash.model import zlab_layer_ids

    for layers in range(5, 80):
        for count in range(1, 9):
            assert zlab_layer_ids(layers, count) == dflash_model.build_target_layer_ids(layers, count)


@pytest.fixture(scope="module")
def tokenizer(default_target):
    return default_target.tokenizer


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_random_drafter_matches_the_reference(kind, tmp_path, tokenizer, one_thread):
    target, hf = tiny_target(tmp_path / "target", kind, tokenizer, seed=3, tie=False)
    model = zlab_drafter(tmp_path / "drafter", hf, block_size=5, mask_token_id=7, seed=4)
    for prompt in prompts(3):
        expected, rounds = reference(model, hf, prompt, 23, [2])
        tokens, committed, decoder = ours(target, tmp_path / "drafter", prompt, 23, [2])
        assert tokens == expected and committed == rounds
    assert decoder.info["layout"] == "z-lab" and decoder.info["convention"] == "z-lab"
    assert decoder.info["drafts_per_block"] == 4 and decoder.info["taps"] == [2, 4]  # z-lab ids 1, 3 (+1)
    # a smaller block than trained: the reference's block_size counts the anchor's slot
    expected, rounds = reference(model, hf, prompts(1)[0], 17, [2], block_size=3)
    assert ours(target, tmp_path / "drafter", prompts(1)[0], 17, [2], block=2)[:2] == (expected, rounds)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_accepting_drafter_matches_the_reference(kind, tmp_path, tokenizer, one_thread):
    target, hf = tiny_target(tmp_path / "target", kind, tokenizer, seed=5)
    prompt = prompts(1, seed=7)[0]
    plain = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    settled = plain[-1]  # the token the tiny target repeats (checked below through acceptance)
    model = zlab_drafter(tmp_path / "drafter", hf, block_size=6, mask_token_id=settled, seed=6, steer=True)
    for max_new in (29, 30, 31):  # the last round cut inside a block, at its end, one past it
        expected, rounds = reference(model, hf, prompt, max_new, [2])
        tokens, committed, _ = ours(target, tmp_path / "drafter", prompt, max_new, [2])
        assert tokens == expected and committed == rounds
        assert max(rounds) == 6  # whole blocks accepted: 5 drafts + the bonus token
    # a stop token inside an accepted block ends the turn there, in both loops
    stop = [plain[3]]
    expected, rounds = reference(model, hf, prompt, 30, stop)
    tokens, committed, _ = ours(target, tmp_path / "drafter", prompt, 30, stop)
    assert tokens == expected and committed == rounds and tokens[-1] == stop[0]


def test_our_export_runs_in_the_reference(tmp_path, tokenizer, one_thread):
    """A drafter of ours (z-lab convention) exported to z-lab's layout loads in the reference's
    DFlashDraftModel.from_pretrained and drafts as it does in our loop."""
    from methods.dflash import export
    from methods.dflash.model import BlockConfig, BlockDraftModel, zlab_taps
    from methods.dflash.training import export_model

    target, hf = tiny_target(tmp_path / "target", "qwen3", tokenizer, seed=8, tie=False)
    torch.manual_seed(9)
    config = BlockConfig.for_target(target.config, zlab_taps(6, 3), num_layers=3, block_size=4, mask_token_id=11)
    model = BlockDraftModel(config)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(5.0)
            layer.self_attn.k_proj.weight.mul_(5.0)
    export_model(model, tmp_path / "ours", {"method": "dflash", "target": {
        "name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}})
    export(target, str(tmp_path / "ours"), "dflash", tmp_path / "zlab")
    loaded = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "zlab", dtype=torch.float32).eval()
    assert loaded.target_layer_ids == dflash_model.build_target_layer_ids(6, 3)
    assert loaded.block_size == 4 and loaded.mask_token_id == 11
    for prompt in prompts(2, seed=10):
        expected, rounds = reference(loaded, hf, prompt, 21, [2])
        for folder in ("ours", "zlab"):
            tokens, committed, _ = ours(target, tmp_path / folder, prompt, 21, [2])
            assert tokens == expected and committed == rounds


@pytest.mark.slow
@pytest.mark.parametrize("which", ["shipped", "random"])
def test_the_default_target_with_our_drafter_in_the_reference(which, tmp_path, one_thread):
    """The real default target; our dflash drafter (the shipped one, once it follows the
    z-lab convention; else a random one of that convention) exported to z-lab's layout and
    run by the reference, against our loop with the same folder."""
    from bench.core.drafters import find_drafter
    from bench.core.target import chat_prompt, load_hf_model, load_target
    from methods.dflash import export
    from methods.dflash.formats import read_drafter
    from methods.dflash.model import BlockConfig, BlockDraftModel, default_mask_token_id, zlab_taps
    from methods.dflash.training import export_model

    target = load_target(None, "cpu", "float32")
    if which == "shipped":
        folder = find_drafter(target.name, "dflash")
        shipped = read_drafter(target, folder, ("dflash",))[0]
        if shipped.convention != "z-lab":
            pytest.skip(f"the dflash drafter {folder} predates the z-lab convention: retrain it (bench train)")
        if shipped.draft_vocab_size:
            pytest.skip(f"the dflash drafter {folder} has a reduced draft vocabulary, which z-lab's layout cannot say")
    else:
        torch.manual_seed(0)
        config = BlockConfig.for_target(target.config, zlab_taps(30, 3), num_layers=3, block_size=16,
                                        mask_token_id=default_mask_token_id(target.tokenizer, 49152))
        folder = tmp_path / "ours"
        export_model(BlockDraftModel(config), folder, {"method": "dflash", "target": {
            "name": target.name, "fingerprint": target.fingerprint, "vocab_size": target.config.vocab_size}})
    export(target, str(folder), "dflash", tmp_path / "zlab")
    loaded = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "zlab", dtype=torch.float32).eval()
    hf = load_hf_model(target.path, "cpu")
    stops = target.eos_token_ids
    for text in ("Write a Python function that returns the square of a number.", "What is 12 times 7?"):
        prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": text}])
        expected, rounds = reference(loaded, hf, prompt, 48, stops)
        tokens, committed, _ = ours(target, tmp_path / "zlab", prompt, 48, stops)
        assert tokens == expected and committed == rounds
