"""Published EAGLE drafter folders: read into EagleHead, and written from it.

A published folder holds `config.json` and `model.safetensors` / `pytorch_model.bin` (or
shards with an index; bench.core.formats reads them). Two layouts, told apart by the config:

- `eagle`: SafeAILab/EAGLE's (EA `eagle/model/cnets1.py`, `cnets.py`), which SpecForge and
  SGLang also read and write. config.json is the head's Llama config.
  EAGLE-1/2: fc.weight [d, 2d] and fc.bias over [Emb(x); f], layers.0.self_attn.{q,k,v,o}_proj,
  layers.0.mlp.{gate,up,down}_proj, layers.0.post_attention_layernorm; EA's first layer has
  no input norm (a head trained here has one and writes it as layers.0.input_layernorm,
  which EA's own loader, strict=False, would skip); the target's lm_head projects.
  EAGLE-3: fc.weight [d, 3d], midlayer.input_layernorm (on the token embedding),
  midlayer.hidden_norm (on the fused feature), midlayer.self_attn.* (q/k/v read 2d),
  midlayer.post_attention_layernorm, midlayer.mlp.*, norm, lm_head [draft vocab, d],
  d2t (target id = draft id + d2t[draft id]) and t2d (bool over the target vocabulary).
  Variants read from the config: fc_norm (fc_norm.{i}.weight, SpecForge's EAGLE-3.1),
  norm_before_residual, num_hidden_layers > 1 (layers.{i}.*, plain Llama layers, as vLLM
  maps midlayer to layers.0), attention_bias (q/k/v/o biases) or qkv_bias (q/k/v only, EA).
  SpecForge's `norm_output` (true: the usual norm before lm_head) is accepted when true.
- `speculators`: vLLM's speculators library (0.9.0, `speculators/models/eagle3/`):
  `speculators_model_type: eagle3`, the layer config nested in `transformer_layer_config`
  (llama or qwen3), `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`,
  `norm_before_residual`, `fc_norm`, `norm_before_fc` (input_norm.weight over the
  concatenated taps), `norm_output` (the output is normed, fed back and projected without a
  second norm), `target_hidden_size`; keys layers.{i}.* (layer 0 as midlayer above), fc,
  norm, lm_head, d2t, t2d; embed_tokens optional. speculators defines no EAGLE-1.

Taps: EAGLE-1 reads the target's final normed state (tap L); EAGLE-3 the states entering
layers 2, L/2 and L-3 (EA's choice; speculators' aux layer ids number the same states).
The draft layer is as wide as the target (its embedding is shared); a folder for another
target is refused in one line (bench.core.formats.check_matches_target).
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.core.drafters import MANIFEST, load_weights_into
from bench.core.errors import BenchError
from bench.core.formats import (
    CONFIG,
    check_matches_target,
    read_config,
    read_folder_weights,
    speculators_header,
    speculators_type,
    write_published,
)
from methods.eagle.model import EagleConfig, EagleHead

LAYOUTS = ("eagle", "speculators")
# Weights a published folder may carry that the head takes from the target, or does not use.
IGNORED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
LAYER_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def is_published(folder: Path) -> bool:
    folder = Path(folder)
    return not (folder / MANIFEST).exists() and (folder / CONFIG).exists()


# ------------------------------------------------------------------ key names
def key_map(config: EagleConfig, first: str) -> dict[str, str]:
    """Our parameter name -> the published key, for a head with `config`; `first` is the
    first layer's prefix ("midlayer." or "layers.0.")."""
    eagle3 = config.kind == "eagle3"
    names = {"fc.weight": "fc.weight"}
    if not eagle3:
        names["fc.bias"] = "fc.bias"

    def layer(ours: str, theirs: str) -> None:
        for p in "qkvo":
            names[f"{ours}{p}_proj.weight"] = f"{theirs}self_attn.{p}_proj.weight"
        if config.qkv_bias:
            names.update({f"{ours}{p}_proj.bias": f"{theirs}self_attn.{p}_proj.bias" for p in "qkv"})
        if config.o_bias:
            names[f"{ours}o_proj.bias"] = f"{theirs}self_attn.o_proj.bias"
        if config.qk_norm:
            names.update({f"{ours}{p}_norm": f"{theirs}self_attn.{p}_norm.weight" for p in "qk"})
        names.update({f"{ours}{p}_proj.weight": f"{theirs}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
        names[f"{ours}post_norm"] = f"{theirs}post_attention_layernorm.weight"

    layer("", first)
    if eagle3:
        names.update({"embed_norm": f"{first}input_layernorm.weight", "hidden_norm": f"{first}hidden_norm.weight",
                      "final_norm": "norm.weight", "lm_head.weight": "lm_head.weight"})
        if config.fc_norm:
            names.update({f"fc_norm.{i}": f"fc_norm.{i}.weight" for i in range(len(config.taps))})
        if config.norm_before_fc:
            names["fc_input_norm"] = "input_norm.weight"
    elif config.norm_hidden:
        names["hidden_norm"] = f"{first}input_layernorm.weight"
    for i in range(1, config.num_layers):
        layer(f"extra_layers.{i - 1}.", f"layers.{i}.")
        names[f"extra_layers.{i - 1}.input_norm"] = f"layers.{i}.input_layernorm.weight"
    return names


# -------------------------------------------------------------------- reading
def detect(config: dict, weights: dict[str, torch.Tensor], folder: Path) -> tuple[str, str, str]:
    """(layout, kind, first-layer prefix) of a published folder."""
    algorithm = speculators_type(config)
    if algorithm is not None and algorithm != "eagle3":
        raise BenchError(f"{folder} is a speculators '{algorithm}' drafter, not an EAGLE head")
    layout = "speculators" if algorithm else "eagle"
    first = "midlayer." if "midlayer.self_attn.q_proj.weight" in weights else "layers.0."
    q_proj = weights.get(f"{first}self_attn.q_proj.weight")
    fc = weights.get("fc.weight")
    if q_proj is None or fc is None or q_proj.dim() != 2 or fc.dim() != 2:
        raise BenchError(f"{folder} is not an EAGLE drafter: its weights lack fc.weight or "
                         f"{first}self_attn.q_proj.weight")
    # EAGLE-3's first layer reads [Emb; g] (2d wide) and its fc fuses three or more taps.
    kind = "eagle3" if algorithm or first == "midlayer." or q_proj.shape[1] == 2 * fc.shape[0] else "eagle1"
    return layout, kind, first


def _flag(config: dict, name: str, folder: Path) -> bool:
    value = config.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BenchError(f"EAGLE config {folder / CONFIG}: '{name}' is {value!r}, expected true or false")
    return value


def head_config(config: dict, layout: str, kind: str, target, folder: Path) -> EagleConfig:
    """The EagleConfig a published config describes, checked against the target."""
    layer = config.get("transformer_layer_config") if layout == "speculators" else config
    if not isinstance(layer, dict):
        raise BenchError(f"speculators config {folder / CONFIG} lacks transformer_layer_config")
    where = f"EAGLE config {folder / CONFIG}"
    model_type = layer.get("model_type", "llama")
    if model_type not in LAYER_TYPES:
        raise BenchError(f"{where}: draft layer type '{model_type}' is not supported ({', '.join(LAYER_TYPES)})")
    if layer.get("hidden_act", "silu") != "silu":
        raise BenchError(f"{where}: hidden_act '{layer.get('hidden_act')}' is not supported (silu)")
    if _flag(layer, "mlp_bias", folder):
        raise BenchError(f"{where}: mlp_bias is not supported")
    rope = layer.get("rope_scaling") or {}
    parameters = layer.get("rope_parameters") or {}
    rope_type = (rope.get("rope_type") or rope.get("type") or parameters.get("rope_type") or "default")
    if rope_type != "default":
        raise BenchError(f"{where}: RoPE scaling '{rope_type}' is not supported (plain RoPE only)")
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise BenchError(f"{where}: sliding-window draft layers are not supported")
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        shape = {"hidden_size": hidden, "intermediate_size": int(layer["intermediate_size"]), "num_heads": heads,
                 "num_kv_heads": int(layer.get("num_key_value_heads") or heads),
                 "head_dim": int(layer.get("head_dim") or hidden // heads), "vocab_size": int(layer["vocab_size"]),
                 "num_layers": int(layer.get("num_hidden_layers") or 1),
                 "rope_theta": float(layer.get("rope_theta") or parameters.get("rope_theta") or 10000.0),
                 "rms_norm_eps": float(layer.get("rms_norm_eps") or 1e-6)}
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"{where} lacks or garbles a layer field ({exc})") from None
    target_hidden = config.get("target_hidden_size") or hidden
    check_matches_target(target, folder, "EAGLE drafter", hidden_size=target_hidden, vocab_size=shape["vocab_size"])
    if hidden != target.config.hidden_size:
        raise BenchError(f"EAGLE drafter {folder} has a {hidden}-wide layer; heads narrower or wider than the "
                         f"target ({target.config.hidden_size}) are not supported")
    attention_bias = _flag(layer, "attention_bias", folder)
    flags = {"qkv_bias": attention_bias or _flag(layer, "qkv_bias", folder) or model_type == "qwen2",
             "o_bias": attention_bias, "qk_norm": model_type == "qwen3"}
    num_layers = target.config.num_hidden_layers
    if kind == "eagle1":
        taps = [num_layers]
        for name in ("fc_norm", "norm_before_fc", "norm_before_residual"):
            if _flag(config, name, folder):
                raise BenchError(f"{where}: '{name}' is an EAGLE-3 option, and this is an EAGLE-1 head")
        draft_vocab = None
    else:
        eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
        taps = config.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if taps is None:
            taps = [2, num_layers // 2, num_layers - 3]
        elif not isinstance(taps, list) or not all(isinstance(t, int) for t in taps):
            raise BenchError(f"{where}: eagle_aux_hidden_state_layer_ids is not a list of layer ids")
        check_matches_target(target, folder, "EAGLE drafter", tap_layers=taps)
        if num_layers in taps:
            raise BenchError(f"EAGLE drafter {folder} taps the target's last layer output ({num_layers}), "
                             "which this engine exposes only after the final norm")
        norm_output = _flag(config, "norm_output", folder)
        if layout == "eagle" and "norm_output" in config and not norm_output:
            raise BenchError(f"{where}: norm_output false (no norm before lm_head) is not supported")
        flags.update(norm_before_residual=_flag(config, "norm_before_residual", folder),
                     fc_norm=_flag(config, "fc_norm", folder), norm_before_fc=_flag(config, "norm_before_fc", folder),
                     norm_output=norm_output and layout == "speculators")
        if flags["fc_norm"] and flags["norm_before_fc"]:
            raise BenchError(f"{where}: fc_norm and norm_before_fc exclude each other")
        draft_vocab = config.get("draft_vocab_size")
        if draft_vocab is not None and (not isinstance(draft_vocab, int) or draft_vocab < 1):
            raise BenchError(f"{where}: draft_vocab_size is {draft_vocab!r}")
        if draft_vocab == shape["vocab_size"]:
            draft_vocab = None
    return EagleConfig(kind=kind, taps=[int(t) for t in taps], draft_vocab_size=draft_vocab,
                       norm_hidden=kind == "eagle3", **shape, **flags)


def load_published(target, folder: Path, kind: str) -> tuple[EagleHead, dict]:
    """An EagleHead (fp32, CPU) from a published EAGLE-1/2 or EAGLE-3 folder, either
    layout, checked against the target."""
    folder = Path(folder)
    config = read_config(folder)
    weights = read_folder_weights(folder)
    layout, found, first = detect(config, weights, folder)
    if found != kind:
        raise BenchError(f"{folder} holds an {found} head; use --method {'eagle3' if found == 'eagle3' else 'eagle'}")
    head_cfg = head_config(config, layout, kind, target, folder)
    if kind == "eagle1":
        head_cfg.norm_hidden = f"{first}input_layernorm.weight" in weights
    if kind == "eagle3" and head_cfg.draft_vocab_size is None and "lm_head.weight" in weights:
        rows = weights["lm_head.weight"].shape[0]
        head_cfg.draft_vocab_size = rows if rows != head_cfg.vocab_size else None
    head = EagleHead(head_cfg)
    names = key_map(head_cfg, first)
    state: dict[str, torch.Tensor] = {}
    for ours, theirs in names.items():
        if theirs in weights:
            state[ours] = weights[theirs].float()
        elif ours == "fc.bias" and config.get("bias") is False:
            state[ours] = torch.zeros(head_cfg.hidden_size)  # EA's bias=False EAGLE-1 heads
        else:
            raise BenchError(f"EAGLE weights in {folder} lack '{theirs}'")
    unknown = sorted(set(weights) - set(names.values()) - set(IGNORED) - {"d2t"})
    if unknown:
        raise BenchError(f"EAGLE weights in {folder} hold '{unknown[0]}', which no supported variant has "
                         f"(layout {layout}, {kind}, {head_cfg.num_layers} layer(s))")
    if kind == "eagle3":
        state["draft_to_target"] = _draft_ids(weights, head_cfg, folder)
    elif not head_cfg.norm_hidden:
        state["hidden_norm"] = head.hidden_norm.detach()  # unused: EA's first layer has no input norm
    load_weights_into(head, state, folder)
    manifest = {"method": kind, "published": str(folder), "layout": layout, "architecture": head_cfg.to_dict()}
    return head, manifest


def _draft_ids(weights: dict[str, torch.Tensor], config: EagleConfig, folder: Path) -> torch.Tensor:
    """Draft id -> target id, from d2t offsets (checked against t2d when present)."""
    size = config.draft_vocab_size or config.vocab_size
    if "d2t" not in weights:
        if config.draft_vocab_size:
            raise BenchError(f"EAGLE-3 weights in {folder} lack 'd2t' (draft -> target vocabulary offsets)")
        return torch.arange(size)
    offsets = weights["d2t"].long().flatten()
    if offsets.numel() != size:
        raise BenchError(f"EAGLE-3 weights in {folder}: d2t has {offsets.numel()} entries, the draft vocabulary "
                         f"{size}")
    ids = torch.arange(size) + offsets
    if ids.min() < 0 or ids.max() >= config.vocab_size or ids.unique().numel() != size:
        raise BenchError(f"EAGLE-3 weights in {folder}: d2t maps draft ids outside the target vocabulary "
                         "or two onto one")
    if "t2d" in weights:
        t2d = weights["t2d"].bool().flatten()
        if t2d.numel() != config.vocab_size or int(t2d.sum()) != size or not bool(t2d[ids].all()):
            raise BenchError(f"EAGLE-3 weights in {folder}: t2d does not mark the tokens d2t maps to")
    return ids


# -------------------------------------------------------------------- writing
def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """bf16 when that holds the value exactly (heads trained here are stored in bf16), else fp32."""
    if not tensor.is_floating_point():
        return tensor
    tensor = tensor.detach().float().cpu()
    half = tensor.to(torch.bfloat16)
    return half if torch.equal(half.float(), tensor) else tensor


def _layer_fields(config: EagleConfig, target) -> dict:
    return {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "hidden_act": "silu",
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "max_position_embeddings": int(getattr(target.config, "max_position_embeddings", 2048) or 2048),
            "vocab_size": config.vocab_size, "tie_word_embeddings": False}


def export_published(head: EagleHead, target, fmt: str, out: Path, manifest: dict | None = None) -> Path:
    """Write `head` (for `target`) in a published layout: "eagle" (SafeAILab) or
    "speculators" (EAGLE-3 only). The target's embedding and, for EAGLE-1, its lm_head are
    not written (every reader takes them from the target); EAGLE-3's own lm_head rows over
    the draft vocabulary, d2t and t2d are."""
    config = head.config
    if fmt not in LAYOUTS:
        raise BenchError(f"EAGLE exports to {', '.join(LAYOUTS)}, not '{fmt}'")
    eagle3 = config.kind == "eagle3"
    if fmt == "speculators" and not eagle3:
        raise BenchError("speculators defines no EAGLE-1 layout; export EAGLE-1 heads with --format eagle")
    unsupported = {"eagle": ("qk_norm", "norm_output", "norm_before_fc"), "speculators": ()}[fmt]
    for name in unsupported:
        if getattr(config, name):
            raise BenchError(f"this EAGLE head uses {name}, which the {fmt} layout cannot express")
    if fmt == "speculators" and config.qkv_bias != config.o_bias:
        raise BenchError("speculators' attention_bias puts biases on q, k, v and o together; this head has "
                         "q/k/v biases only")
    if eagle3 and target.config.num_hidden_layers in config.taps:
        raise BenchError("this EAGLE-3 head taps the target's final normed state, which no published layout "
                         "numbers")
    params = dict(head.named_parameters())
    first = "midlayer." if fmt == "eagle" and eagle3 else "layers.0."
    weights = {theirs: _compact(params[ours]) for ours, theirs in key_map(config, first).items()}
    draft_ids = head.draft_to_target.detach().cpu().long() if eagle3 else None
    reduced = eagle3 and config.draft_vocab_size is not None
    if eagle3 and (reduced or fmt == "eagle"):  # EA's head always has d2t/t2d buffers
        weights["d2t"] = draft_ids - torch.arange(draft_ids.numel())
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        weights["t2d"] = t2d
    floats = {w.dtype for w in weights.values() if w.is_floating_point()}
    dtype = "bfloat16" if floats == {torch.bfloat16} else "float32"
    fields = _layer_fields(config, target)
    if fmt == "eagle":
        body = {"architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], "model_type": "llama",
                **fields, "bias": not eagle3, "torch_dtype": dtype}
        if config.o_bias:
            body["attention_bias"] = True
        elif config.qkv_bias:
            body["qkv_bias"] = True
        if eagle3:
            body["draft_vocab_size"] = int(draft_ids.numel())
            body["eagle_aux_hidden_state_layer_ids"] = list(config.taps)
            for name in ("fc_norm", "norm_before_residual"):
                if getattr(config, name):
                    body[name] = True
    else:
        layer = {"model_type": "qwen3" if config.qk_norm else "llama", **fields,
                 "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
                 "attention_bias": config.o_bias, "mlp_bias": False}
        settings = (manifest or {}).get("training", {}).get("settings", {})
        tokens = int(settings.get("ttt_steps") or 3)
        body = {"architectures": ["Eagle3Speculator"], **speculators_header("eagle3", target, tokens),
                "transformer_layer_config": layer, "draft_vocab_size": int(draft_ids.numel()),
                "norm_before_residual": config.norm_before_residual, "target_hidden_size": None,
                "eagle_aux_hidden_state_layer_ids": list(config.taps), "norm_before_fc": config.norm_before_fc,
                "fc_norm": config.fc_norm, "norm_output": config.norm_output, "embed_requires_grad": False,
                "torch_dtype": dtype}
    return write_published(out, body, weights)
