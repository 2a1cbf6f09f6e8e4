"""Published MTP layouts: recognise a folder's layout, read its module into our SequentialMTP,
and write the speculators layout (`bench export --method mtp --format speculators`).

Every layout holds the same DeepSeek-V3 module, one decoder layer plus
proj([RMSNorm(Emb(x_{t+1})); RMSNorm(h_t)]) before it and an RMSNorm after it, the target's
embedding and lm_head shared. They differ in key names and in the order of the fused halves:

layout        module keys            emb. norm / hidden norm / projection / final norm          halves
speculators   mtp_layers.0.          token_layernorm / hidden_layernorm / input_proj /
                                     final_layernorm                                            embedding first
deepseek-v3   model.layers.{L}.      enorm / hnorm / eh_proj / shared_head.norm                 embedding first
qwen3-next    mtp. (layer            pre_fc_norm_embedding / pre_fc_norm_hidden / fc / norm     embedding first
              mtp.layers.0.)
mimo          model.mtp_layers.0.    token_layernorm / hidden_layernorm / input_proj /
                                     final_layernorm                                            hidden first

Sources: speculators 0.9.0 `models/mtp/model_definitions.py` (MTPLayerMixin) and
`convert/mtp/converter.py` (the mtp.* -> mtp_layers.0.* names); vLLM `deepseek_mtp.py`,
`qwen3_next_mtp.py`, `mimo_mtp.py`; SGLang `deepseek_nextn.py`. {L} is the target's layer
count (the module is "layer L" of the checkpoint). The decoder layer's own keys are HF's
(input_layernorm, self_attn.{q,k,v,o}_proj, q_norm / k_norm, post_attention_layernorm,
mlp.{gate,up,down}_proj), so a layout fits a target whose layers are Llama / Qwen2 / Qwen3
shaped; DeepSeek's MLA or MoE layers and Qwen3-Next's gated attention and zero-centred norms
do not fit, and are refused by name.

Shared weights: speculators never stores the embedding or lm_head (its MTPDraftModel loads
them from the verifier), so the export writes neither; a folder that does hold a copy (a
whole checkpoint, DeepSeek's per-module embed_tokens / shared_head.head) must hold the
target's, else it is refused.

Serving: vLLM maps a speculators `mtp` folder to its native MTP model by the verifier's
architecture (MiMo -> mimo_mtp, whose halves are hidden first; Qwen3-Next -> qwen3_next_mtp)
and speculators' own MTPDraftModel takes Qwen3-family layer configs only, so for a Llama
target (the default SmolLM2) the export is the layout as speculators defines it, not yet
something either loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bench.core.drafters import load_weights_into
from bench.core.errors import BenchError
from bench.core.formats import (
    check_matches_target,
    read_config,
    read_folder_weights,
    speculators_header,
    speculators_type,
    write_published,
)
from methods.mtp.model import LayerShape, SequentialMTP

if TYPE_CHECKING:
    from bench.core.target import Target


@dataclass(frozen=True)
class Layout:
    """Key names of one published MTP layout; '{L}' stands for the target's layer count."""

    name: str
    module: str  # prefix of the fusion and final-norm weights
    layer: str  # prefix of the decoder layer's weights
    embed_norm: str
    hidden_norm: str
    proj: str
    final_norm: str
    fuse_order: str  # methods.mtp.model.FUSE_ORDERS
    shared: tuple[tuple[str, str], ...]  # (key, "embed" | "lm_head"): copies of the target's weights
    source: str


WHOLE_MODEL = (("model.embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head"))
SPECULATORS = Layout("speculators", "mtp_layers.0.", "mtp_layers.0.", "token_layernorm.weight",
                     "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight", "embedding_first",
                     (("embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head")),
                     "speculators 0.9.0 models/mtp (MTPLayerMixin)")
DEEPSEEK = Layout("deepseek-v3", "model.layers.{L}.", "model.layers.{L}.", "enorm.weight", "hnorm.weight",
                  "eh_proj.weight", "shared_head.norm.weight", "embedding_first",
                  (("model.layers.{L}.embed_tokens.weight", "embed"), ("model.layers.{L}.shared_head.head.weight",
                                                                       "lm_head")) + WHOLE_MODEL,
                  "DeepSeek-V3 checkpoints; vLLM deepseek_mtp.py, SGLang deepseek_nextn.py")
QWEN3_NEXT = Layout("qwen3-next", "mtp.", "mtp.layers.0.", "pre_fc_norm_embedding.weight",
                    "pre_fc_norm_hidden.weight", "fc.weight", "norm.weight", "embedding_first", WHOLE_MODEL,
                    "Qwen3-Next checkpoints; vLLM qwen3_next_mtp.py")
MIMO = Layout("mimo", "model.mtp_layers.0.", "model.mtp_layers.0.", "token_layernorm.weight",
              "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight", "hidden_first", WHOLE_MODEL,
              "Xiaomi MiMo checkpoints; vLLM mimo_mtp.py")
NATIVE = (DEEPSEEK, QWEN3_NEXT, MIMO)
LAYOUTS = {layout.name: layout for layout in (SPECULATORS, *NATIVE)}
# Layer types our decoder layer cannot represent (gated attention, zero-centred norms, MoE).
UNFIT_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v3",
                     "deepseek_v2")


def layer_keys(shape: LayerShape) -> dict[str, list[str]]:
    """Our DecoderLayer parameter -> the HF keys it concatenates (along rows)."""
    keys = {"in_norm": ["input_layernorm.weight"], "qkv": [f"self_attn.{n}_proj.weight" for n in "qkv"],
            "o": ["self_attn.o_proj.weight"], "post_norm": ["post_attention_layernorm.weight"],
            "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "down": ["mlp.down_proj.weight"]}
    if shape.qkv_bias:
        keys["qkv_bias"] = [f"self_attn.{n}_proj.bias" for n in "qkv"]
    if shape.qk_norm:
        keys["q_norm"], keys["k_norm"] = ["self_attn.q_norm.weight"], ["self_attn.k_norm.weight"]
    return keys


def module_keys(layout: Layout, shape: LayerShape, num_layers: int) -> dict[str, list[str]]:
    """SequentialMTP parameter name -> the layout's keys (several: concatenated along rows)."""
    module, layer = layout.module.format(L=num_layers), layout.layer.format(L=num_layers)
    keys = {"norm_e": [module + layout.embed_norm], "norm_h": [module + layout.hidden_norm],
            "proj": [module + layout.proj], "final_norm": [module + layout.final_norm]}
    keys.update({f"layer.{name}": [layer + key for key in theirs] for name, theirs in layer_keys(shape).items()})
    return keys


def _split_sizes(shape: LayerShape) -> dict[str, list[int]]:
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"layer.qkv": [q, kv, kv], "layer.qkv_bias": [q, kv, kv],
            "layer.gate_up": [shape.intermediate_size, shape.intermediate_size]}


def swap_halves(proj: Tensor) -> Tensor:
    """The projection of the other fuse order: columns [a | b] -> [b | a] (same function)."""
    d = proj.shape[1] // 2
    return torch.cat([proj[:, d:], proj[:, :d]], dim=1)


def to_layout(model: SequentialMTP, layout: Layout, num_layers: int) -> dict[str, Tensor]:
    """The module's weights under `layout`'s keys; the projection's halves are swapped when
    the module's fuse order is not the layout's (an equivalent module, not a bitwise one)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    sizes = _split_sizes(model.shape)
    out: dict[str, Tensor] = {}
    for ours, theirs in module_keys(layout, model.shape, num_layers).items():
        tensor = params[ours]
        if ours == "proj" and model.fuse_order != layout.fuse_order:
            tensor = swap_halves(tensor)
        parts = tensor.split(sizes[ours]) if len(theirs) > 1 else [tensor]
        out.update(zip(theirs, parts))
    return out


def tensors_digest(state: dict[str, Tensor]) -> str:
    """sha1 (12 hex) of named tensors: a published drafter's identity in run records."""
    digest = hashlib.sha1()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:12]


def _layer_config(config: dict, folder: Path) -> tuple[dict, int | None, str | None]:
    """(layer config, MTP module count, speculators proposal length) of a published folder."""
    kind = speculators_type(config)
    if kind is not None and kind != "mtp":
        raise BenchError(f"drafter {folder} is a speculators '{kind}' drafter, not mtp")
    if kind == "mtp":
        layer_config = config.get("transformer_layer_config")
        if not isinstance(layer_config, dict):
            raise BenchError(f"speculators mtp drafter {folder} has no transformer_layer_config")
        count = config.get("num_nextn_predict_layers", 1)
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
        return layer_config, count, tokens
    layer_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return layer_config, layer_config.get("num_nextn_predict_layers", config.get("num_nextn_predict_layers")), None


def _check_layer(target: Target, folder: Path, layer_config: dict, shape: LayerShape) -> None:
    model_type = layer_config.get("model_type")
    if model_type in UNFIT_MODEL_TYPES:
        raise BenchError(f"mtp drafter {folder} has {model_type} layers (MLA / MoE / gated attention), which "
                         f"the mtp drafter's Llama-family layer cannot run")
    heads = layer_config.get("num_attention_heads")
    kv_heads = layer_config.get("num_key_value_heads", heads)
    head_dim = layer_config.get("head_dim") or (
        layer_config["hidden_size"] // heads if heads and layer_config.get("hidden_size") else None)
    for name, theirs, ours in (("attention heads", heads, shape.num_heads),
                               ("key/value heads", kv_heads, shape.num_kv_heads),
                               ("head dim", head_dim, shape.head_dim),
                               ("intermediate size", layer_config.get("intermediate_size"),
                                shape.intermediate_size)):
        if theirs is not None and int(theirs) != ours:
            raise BenchError(f"mtp drafter {folder} has a layer with {name} {theirs}; "
                             f"target '{target.name}''s layers have {ours}")


def _native_layout(weights: dict[str, Tensor], num_layers: int, folder: Path) -> Layout:
    for layout in NATIVE:
        if layout.module.format(L=num_layers) + layout.proj in weights:
            return layout
    names = ", ".join(f"{lay.module.format(L=num_layers)}{lay.proj} ({lay.name})" for lay in NATIVE)
    raise BenchError(f"drafter {folder} holds no MTP module: no speculators 'mtp' config.json, no {names}")


def _check_shared(target: Target, folder: Path, layout: Layout, weights: dict[str, Tensor],
                  num_layers: int) -> None:
    engine = target.engine
    for key, which in layout.shared:
        key = key.format(L=num_layers)
        if key not in weights:
            continue
        ours = engine.embed if which == "embed" else engine.lm_head
        theirs = weights[key]
        same = tuple(theirs.shape) == tuple(ours.shape) and torch.allclose(
            theirs.float(), ours.detach().float().cpu(), rtol=1e-2, atol=1e-3)
        if not same:
            raise BenchError(f"mtp drafter {folder} holds {key}, which is not target '{target.name}''s "
                             f"{'embedding' if which == 'embed' else 'lm_head'} (the module shares the target's)")


def read_published(target: Target, folder: Path) -> tuple[SequentialMTP, dict]:
    """The module of a published folder (speculators `mtp`, or a checkpoint with DeepSeek-V3,
    Qwen3-Next or MiMo MTP keys) as a frozen fp32 SequentialMTP, and a manifest for the
    decoder and its records; one-line BenchErrors for another target or an unfit layout."""
    folder = Path(folder)
    config = read_config(folder)
    layer_config, count, proposal = _layer_config(config, folder)
    check_matches_target(target, folder, "mtp drafter", hidden_size=layer_config.get("hidden_size"),
                         vocab_size=layer_config.get("vocab_size"),
                         num_layers=layer_config.get("num_hidden_layers"))
    engine = target.engine
    num_layers = engine.num_layers
    shape = LayerShape.of(engine)
    _check_layer(target, folder, layer_config, shape)
    if count is not None and int(count) != 1:
        raise BenchError(f"mtp drafter {folder} has {count} MTP modules; the mtp drafter chains one "
                         f"(num_nextn_predict_layers must be 1)")
    weights = read_folder_weights(folder)
    layout = SPECULATORS if speculators_type(config) == "mtp" else _native_layout(weights, num_layers, folder)
    if layer_config.get("rms_norm_eps") is not None:
        shape = replace(shape, rms_norm_eps=float(layer_config["rms_norm_eps"]))
    mapped, used = {}, set()
    for ours, theirs in module_keys(layout, shape, num_layers).items():
        missing = [key for key in theirs if key not in weights]
        if missing:
            raise BenchError(f"mtp drafter {folder} ({layout.name} layout) lacks weight '{missing[0]}'")
        mapped[ours] = torch.cat([weights[key] for key in theirs]) if len(theirs) > 1 else weights[theirs[0]]
        used.update(theirs)
    shared = {key.format(L=num_layers) for key, _ in layout.shared}
    prefixes = ("",) if layout is SPECULATORS else (layout.module.format(L=num_layers),
                                                    layout.layer.format(L=num_layers))
    extra = sorted(key for key in weights if key not in used and key not in shared
                   and key.startswith(prefixes) and not key.endswith("rotary_emb.inv_freq"))
    if extra:
        raise BenchError(f"mtp drafter {folder} ({layout.name} layout) has a weight the target's layer shape "
                         f"does not: '{extra[0]}'")
    _check_shared(target, folder, layout, weights, num_layers)
    model = SequentialMTP(shape, layout.fuse_order)
    load_weights_into(model, mapped, folder, parameters_only=True)
    model.requires_grad_(False)
    manifest = {"format": f"published:{layout.name}", "method": "mtp", "variant": "sequential",
                "layout": layout.name, "fuse_order": layout.fuse_order, "tap": num_layers,
                "teacher_tap": num_layers, "weights_sha1": tensors_digest(mapped),
                "weights_dtype": mapped["proj"].dtype,
                "depth": int(proposal) if isinstance(proposal, int) and proposal >= 1 else None}
    return model, manifest


def layer_config_of(target: Target) -> dict:
    """The target's config as speculators' transformer_layer_config (the fields a layer needs
    always present, whatever to_diff_dict drops as defaults)."""
    config = target.config
    out = config.to_diff_dict() if hasattr(config, "to_diff_dict") else dict(vars(config))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings"):
        value = getattr(config, key, None)
        if value is not None:
            out.setdefault(key, value)
    return out


def write_speculators(target: Target, model: SequentialMTP, out: Path, depth: int, dtype: torch.dtype,
                      provenance: dict) -> Path:
    """`out` as a speculators `mtp` folder: config.json (speculators header, the target's layer
    config, one MTP module) and model.safetensors with mtp_layers.0.* in `dtype`, no embedding
    or lm_head (speculators takes them from the verifier)."""
    weights = {k: v.to(dtype) for k, v in to_layout(model, SPECULATORS, target.engine.num_layers).items()}
    config = {"architectures": ["MTPDraftModel"], **speculators_header("mtp", target, depth),
              "transformer_layer_config": layer_config_of(target), "num_nextn_predict_layers": 1,
              "torch_dtype": str(dtype).removeprefix("torch."), "spec_bench": provenance}
    return write_published(out, config, weights)
