"""Loading published EAGLE drafters (SafeAILab/EAGLE folder layout) into EagleHead.

A published folder holds `config.json` (a Llama config of the one-layer head) and
`model.safetensors` or `pytorch_model.bin`:
- EAGLE-1/2: fc.weight [d, 2d], fc.bias, layers.0.self_attn.{q,k,v,o}_proj.weight,
  layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight;
  the first layer has no input norm; fc reads [Emb(x); f]; embed_tokens.weight optional.
- EAGLE-3: fc.weight [d, 3d] (no bias), midlayer.input_layernorm.weight (on the token
  embedding), midlayer.hidden_norm.weight (on the fused feature), midlayer.self_attn.*
  (q/k/v read 2d), midlayer.post_attention_layernorm.weight, midlayer.mlp.*, norm.weight,
  lm_head.weight [draft vocab, d], d2t (target id = draft id + d2t[draft id]), t2d.
Taps: EAGLE-1 reads the target's final normed state; EAGLE-3 the states entering layers
2, L/2 and L-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.core.drafters import MANIFEST, read_weights
from bench.core.errors import BenchError
from methods.eagle.model import EagleConfig, EagleHead

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_published(folder: Path) -> bool:
    folder = Path(folder)
    return not (folder / MANIFEST).exists() and (folder / "config.json").exists()


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        if (folder / name).exists():
            return read_weights(folder / name)
    raise BenchError(f"EAGLE folder {folder} has no {' or '.join(WEIGHT_FILES)}")


def load_published(target, folder: Path, kind: str) -> tuple[EagleHead, dict]:
    """An EagleHead from a published EAGLE-1/2 or EAGLE-3 folder, checked against the target."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"unreadable EAGLE config {folder / 'config.json'}: {exc}") from None
    weights = _read_weights(folder)
    found = "eagle3" if "midlayer.self_attn.q_proj.weight" in weights else "eagle1"
    if found != kind:
        raise BenchError(f"{folder} holds an {found} head; use --method {'eagle3' if found == 'eagle3' else 'eagle'}")
    if config.get("vocab_size") != target.config.vocab_size or config.get("hidden_size") != target.config.hidden_size:
        raise BenchError(f"EAGLE head {folder} is for vocab {config.get('vocab_size')} / hidden "
                         f"{config.get('hidden_size')}, target has {target.config.vocab_size} / "
                         f"{target.config.hidden_size}")
    layers = target.config.num_hidden_layers
    taps = [2, layers // 2, layers - 3] if kind == "eagle3" else [layers]
    draft_vocab = config.get("draft_vocab_size") if kind == "eagle3" else None
    heads = config["num_attention_heads"]
    head_config = EagleConfig(
        kind=kind, hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab_size=config["vocab_size"],
        taps=taps, rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        draft_vocab_size=draft_vocab if draft_vocab and draft_vocab < config["vocab_size"] else None,
        norm_hidden=kind == "eagle3")
    head = EagleHead(head_config)
    prefix = "midlayer." if kind == "eagle3" else "layers.0."
    names = {"fc.weight": "fc.weight",
             **{f"{prefix}self_attn.{p}_proj.weight": f"{p}_proj.weight" for p in "qkvo"},
             **{f"{prefix}mlp.{p}_proj.weight": f"{p}_proj.weight" for p in ("gate", "up", "down")},
             f"{prefix}post_attention_layernorm.weight": "post_norm"}
    if kind == "eagle3":
        names.update({"midlayer.input_layernorm.weight": "embed_norm", "midlayer.hidden_norm.weight": "hidden_norm",
                      "norm.weight": "final_norm", "lm_head.weight": "lm_head.weight"})
    else:
        names["fc.bias"] = "fc.bias"
    state = {}
    for theirs, ours in names.items():
        if theirs not in weights:
            raise BenchError(f"EAGLE weights in {folder} lack '{theirs}'")
        state[ours] = weights[theirs].float()
    if kind == "eagle3" and head_config.draft_vocab_size:
        if "d2t" not in weights:
            raise BenchError(f"EAGLE-3 weights in {folder} lack 'd2t' (draft -> target vocabulary offsets)")
        offsets = weights["d2t"].long()
        state["draft_to_target"] = torch.arange(offsets.numel()) + offsets
    else:
        state.update({k: v for k, v in head.state_dict().items() if k not in state})
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise BenchError(f"EAGLE head {folder} does not fit: {str(exc).splitlines()[-1].strip()}") from None
    manifest = {"method": kind, "published": str(folder), "architecture": head_config.to_dict()}
    return head, manifest
