"""Published Medusa layouts: vLLM's folders (built by hand from its documented names) load
and give the logits its Medusa model computes; FasterDecoding's and vLLM's exports reload
bit-identically and decode losslessly; a folder for another target is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sps_helpers import load_tiny_target, make_tiny_target_folder

import methods.medusa as medusa
from bench.core.decode import DecodeConfig, Drafter, decode
from bench.core.errors import BenchError
from methods.medusa import MedusaHeads, build

PROMPT = [1, 504, 3213, 28, 1790, 30, 2, 77, 9]
D = 64


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_tiny_target(make_tiny_target_folder(tmp_path_factory.mktemp("tiny-target")))


def vllm_folder(folder: Path, target, *, num_heads: int = 3, num_layers: int = 2, bias: bool = True,
                original_lm_head: bool = False, truncated: int | None = None, full_rows: bool = True,
                prefix: str = "", seed: int = 0) -> tuple[Path, dict]:
    """A vLLM Medusa folder from its documented config fields and key names."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    w = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            w[f"blocks.{h}.layers.{layer}.weight"] = torch.randn(D, D, generator=gen) * 0.2
            if bias:
                w[f"blocks.{h}.layers.{layer}.bias"] = torch.randn(D, generator=gen) * 0.2
    rows = vocab if truncated is None or full_rows else truncated
    for h in range(1 if original_lm_head else num_heads):
        w[f"lm_heads.{h}.weight"] = torch.randn(rows, D, generator=gen) * 0.3
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": D, "vocab_size": vocab,
              "num_heads": num_heads, "num_hidden_layers": num_layers, "medusa_fc_bias": bias,
              "original_lm_head": original_lm_head}
    if truncated is not None:
        config["truncated_vocab_size"] = truncated
        w["token_map"] = torch.randperm(vocab, generator=gen)[:truncated].sort().values
    folder.mkdir(parents=True)
    save_file({f"{prefix}{k}": v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder, w


def vllm_reference(w: dict, config: dict, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa on one hidden state: per head x + SiLU(W x + b) per layer, then its
    lm_head (rows picked by token_map when they are full-size), logits scattered into the
    full vocabulary (-inf elsewhere) when truncated."""
    out = []
    token_map = w.get("token_map")
    for h in range(config["num_heads"]):
        x = hidden
        for layer in range(config["num_hidden_layers"]):
            bias = w.get(f"blocks.{h}.layers.{layer}.bias") if config["medusa_fc_bias"] else None
            x = x + F.silu(F.linear(x, w[f"blocks.{h}.layers.{layer}.weight"], bias))
        lm_head = w["lm_heads.0.weight"] if config["original_lm_head"] else w[f"lm_heads.{h}.weight"]
        if token_map is not None and lm_head.shape[0] > token_map.numel():
            lm_head = lm_head[token_map]
        logits = F.linear(x, lm_head)
        if token_map is not None:
            full = torch.full((config["vocab_size"],), float("-inf"))
            full[token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


VLLM_CASES = {
    "per-head lm_heads, biases": {},
    "original_lm_head, no biases": {"original_lm_head": True, "bias": False},
    "truncated, full-size lm_heads": {"truncated": 300},
    "truncated rows, prefixed keys": {"truncated": 300, "full_rows": False, "prefix": "medusa_heads."},
}


@pytest.mark.parametrize("case", list(VLLM_CASES))
def test_vllm_layout_loads_and_matches_vllms_computation(tiny_target, tmp_path, case, one_thread):
    flags = VLLM_CASES[case]
    folder, weights = vllm_folder(tmp_path / "vllm", tiny_target, **flags)
    config = json.loads((folder / "config.json").read_text())
    decoder = build(tiny_target, {"drafter": str(folder), "tree_size": 8})
    assert decoder.info["format"] == "medusa-vllm" and decoder.info["own_lm_heads"]
    assert decoder.info["truncated_vocab"] == flags.get("truncated")
    hidden = torch.randn(D, generator=torch.Generator().manual_seed(3))
    got = decoder.drafter.head_logits(hidden, 3)
    torch.testing.assert_close(got, vllm_reference(weights, config, hidden), atol=1e-5, rtol=1e-5)
    cfg = DecodeConfig(max_new_tokens=12)
    assert decoder.run_turn(PROMPT, cfg).tokens == decode(tiny_target.engine, Drafter(), PROMPT, cfg).tokens
    if "truncated" in flags:  # drafts never leave the truncated vocabulary
        draft = decoder.drafter.tree.draft(got.topk(decoder.drafter.ranks_needed, -1).indices, 3)
        assert set(draft.tokens) <= set(weights["token_map"].tolist())


def _ours(tmp_path: Path, target, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    heads = MedusaHeads(D, 3, 2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    folder = tmp_path / "ours"
    folder.mkdir()
    medusa.export_heads(heads, folder, {"method": "medusa", "format": medusa.FORMAT, "weights": "model.safetensors",
                                        "target": {"name": target.name, "fingerprint": target.fingerprint,
                                                   "vocab_size": target.config.vocab_size},
                                        "architecture": {"num_heads": 3, "num_layers": 2, "hidden": D}})
    return folder


@pytest.mark.parametrize("fmt", ["medusa", "medusa-vllm"])
def test_export_then_load_is_bit_identical_and_lossless(tiny_target, tmp_path, fmt, one_thread):
    assert fmt in medusa.EXPORT_FORMATS and medusa.CONVENTION
    ours = _ours(tmp_path, tiny_target)
    out = medusa.export(tiny_target, str(ours), fmt, tmp_path / "out")
    names = sorted(p.name for p in out.iterdir())
    config = json.loads((out / "config.json").read_text())
    if fmt == "medusa":  # FasterDecoding: ResBlocks plus each head's lm_head (the target's)
        assert names == ["config.json", "medusa_lm_head.safetensors"]
        assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
        weights = load_file(str(out / "medusa_lm_head.safetensors"))
        assert set(weights) == {f"{h}.{layer}.linear.{p}" for h in range(3) for layer in range(2)
                                for p in ("weight", "bias")} | {f"{h}.2.weight" for h in range(3)}
        assert torch.equal(weights["1.2.weight"].float(), tiny_target.engine.lm_head)
    else:  # vLLM: blocks with biases, the target's lm_head once
        assert names == ["config.json", "model.safetensors"]
        assert config["model_type"] == "medusa" and config["medusa_fc_bias"] and config["original_lm_head"]
        assert (config["num_heads"], config["num_hidden_layers"], config["truncated_vocab_size"]) == (
            3, 2, tiny_target.config.vocab_size)
        weights = load_file(str(out / "model.safetensors"))
        assert {k for k in weights if k.startswith("lm_heads")} == {"lm_heads.0.weight"}
    original = build(tiny_target, {"drafter": str(ours), "tree_size": 10})
    loaded = build(tiny_target, {"drafter": str(out), "tree_size": 10})
    assert not loaded.info["own_lm_heads"]  # copies of the target's lm_head are shared again
    hidden = torch.randn(D, generator=torch.Generator().manual_seed(5))
    assert torch.equal(original.drafter.head_logits(hidden, 3), loaded.drafter.head_logits(hidden, 3))
    cfg = DecodeConfig(max_new_tokens=12)
    assert loaded.run_turn(PROMPT, cfg).tokens == decode(tiny_target.engine, Drafter(), PROMPT, cfg).tokens
    if fmt == "medusa-vllm":  # and vLLM's own computation on the exported folder agrees
        raw = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
        torch.testing.assert_close(loaded.drafter.head_logits(hidden, 3), vllm_reference(raw, config, hidden),
                                   atol=1e-5, rtol=1e-5)


def test_truncated_vllm_heads_export_to_vllm_only(tiny_target, tmp_path):
    folder, _ = vllm_folder(tmp_path / "vllm", tiny_target, truncated=300)
    out = medusa.export(tiny_target, str(folder), "medusa-vllm", tmp_path / "out")
    hidden = torch.randn(D)
    a = build(tiny_target, {"drafter": str(folder), "tree_size": 4}).drafter.head_logits(hidden, 3)
    b = build(tiny_target, {"drafter": str(out), "tree_size": 4}).drafter.head_logits(hidden, 3)
    assert torch.equal(a, b)
    with pytest.raises(BenchError, match="no truncated vocabulary"):
        medusa.export(tiny_target, str(folder), "medusa", tmp_path / "fd")


def test_bench_export_command(tiny_target, tmp_path):
    from click.testing import CliRunner

    from bench.cli import main

    ours = _ours(tmp_path, tiny_target)
    out = tmp_path / "vllm"
    result = CliRunner().invoke(main, ["export", "--method", "medusa", "--format", "medusa-vllm", "--out", str(out),
                                       "--drafter", str(ours), "--target", str(tiny_target.path)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["model_type"] == "medusa"


def test_a_folder_for_another_target_is_refused_in_one_line(tiny_target, tmp_path):
    def fails(folder, match):
        with pytest.raises(BenchError, match=match) as info:
            build(tiny_target, {"drafter": str(folder)})
        assert "\n" not in str(info.value)

    vocab = tiny_target.config.vocab_size
    for name, change, message in [("hidden", {"hidden_size": 32}, "hidden size 32"),
                                  ("vocab", {"vocab_size": vocab + 1}, f"vocabulary {vocab + 1}"),
                                  ("heads", {"num_heads": 0}, "num_heads is 0")]:
        folder, _ = vllm_folder(tmp_path / name, tiny_target)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(config, **change)))
        fails(folder, message)
    folder, weights = vllm_folder(tmp_path / "no-map", tiny_target, truncated=300)
    save_file({k: v.contiguous() for k, v in weights.items() if k != "token_map"}, str(folder / "model.safetensors"))
    fails(folder, "has no token_map")
    folder, _ = vllm_folder(tmp_path / "tok", tiny_target)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"<unk>": 5, "hello": 0}}}))
    fails(folder, "ships a tokenizer that differs")
    folder, weights = vllm_folder(tmp_path / "missing", tiny_target)
    save_file({k: v.contiguous() for k, v in weights.items() if k != "blocks.2.layers.1.bias"},
              str(folder / "model.safetensors"))
    fails(folder, "lacks weights blocks.2.layers.1.bias")
