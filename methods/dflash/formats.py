"""DFlash-family drafter folders: ours, z-lab's and vLLM speculators', read and written.

- ours: `drafter.json` (architecture = BlockConfig, the target's fingerprint) + weights
  under today's names (legacy names are upgraded, see model.upgrade_legacy_names).
- z-lab DFlash (`dflash.model.DFlashDraftModel`): a Qwen3 `config.json` with
  `architectures: [DFlashDraftModel]`, `num_target_layers`, `block_size` and `mask_token_id`,
  `target_layer_ids` either top level (older folders) or in `dflash_config` (newer ones; z-lab
  reads `dflash_config` first). Weights fc, hidden_norm, norm, layers.i.self_attn.{q,k,v,o}_proj,
  {q,k}_norm, layers.i.mlp.{gate,up,down}_proj, layers.i.{input,post_attention}_layernorm:
  our names. Always the z-lab convention (B-1 drafts), full vocabulary.
- speculators `dflash` / `dspark` (speculators 0.9.0, models/dflash and models/dspark): the
  draft layers' config nested in `transformer_layer_config`, `aux_hidden_state_layer_ids` (HF
  hidden_states numbering, z-lab's id + 1: our taps), `mask_token_id`, `block_size`,
  `sample_from_anchor` (default False for dflash, True for dspark), `draft_vocab_size` with
  `d2t` (target id = draft id + d2t[draft id]) and `t2d` (bool mask) and the reduced lm_head
  (the target's rows, frozen: we take them from the target); dspark adds `markov_rank`,
  `markov_head_type` (only `vanilla` here), `enable_confidence_head`,
  `confidence_head_with_markov` and the weights markov_head.markov_w{1,2}, confidence_head.proj.

A published folder made for another target (hidden size, vocabulary, target layer count,
tokenizer) is refused in one line (bench.core.formats.check_matches_target).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from bench.core.drafters import MANIFEST, WEIGHTS, drafter_info, load_weights_into, open_drafter, read_weights
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
from methods.dflash.model import DEVIATIONS, ZLAB, BlockConfig, upgrade_legacy_names, zlab_layer_ids

ZLAB_ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_KINDS = ("dflash", "dspark")
# Weights a speculators folder may hold that the target provides (or training only uses).
_SPECULATORS_SHARED = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def detect_layout(folder: Path) -> str:
    """'ours' (drafter.json), 'z-lab' or 'speculators' (config.json); a one-line BenchError else."""
    folder = Path(folder)
    if (folder / MANIFEST).exists():
        return "ours"
    if not (folder / CONFIG).exists():
        raise BenchError(f"drafter folder {folder} has neither {MANIFEST} nor {CONFIG}")
    config = read_config(folder)
    kind = speculators_type(config)
    if kind in SPECULATORS_KINDS:
        return "speculators"
    if kind is not None:
        raise BenchError(f"drafter {folder} is a speculators '{kind}' drafter, not dflash or dspark")
    architectures = config.get("architectures") or []
    if ZLAB_ARCHITECTURE in architectures:
        return "z-lab"
    if "DFlash2DraftModel" in architectures:
        raise BenchError(f"drafter {folder} is a DFlash2 drafter (convolutions, candidate selector): not supported")
    raise BenchError(f"drafter {folder} is not a DFlash-family folder (config.json architectures "
                     f"{architectures or 'missing'}, no speculators_model_type)")


# ----------------------------------------------------------------------------- reading
def read_drafter(target, folder: Path, methods: tuple[str, ...]) -> tuple[BlockConfig, dict[str, Tensor], dict]:
    """(config, state dict under our names, info for run records) of a block drafter in any layout."""
    folder = Path(folder)
    layout = detect_layout(folder)
    if layout == "ours":
        manifest = open_drafter(target, folder, methods)
        try:
            config = BlockConfig.from_architecture(manifest["architecture"])
        except (KeyError, TypeError) as exc:
            raise BenchError(f"drafter {folder} is not a block drafter ({exc})") from None
        state = upgrade_legacy_names(read_weights(folder / manifest.get("weights", WEIGHTS)))
        info = dict(drafter_info(folder, manifest), layout="ours")
    else:
        raw = read_config(folder)
        reader = _read_zlab if layout == "z-lab" else _read_speculators
        try:
            config, state = reader(target, folder, raw, read_folder_weights(folder))
        except (KeyError, TypeError, ValueError) as exc:
            raise BenchError(f"unreadable {layout} drafter config {folder / CONFIG}: {exc!r}") from None
        info = {"drafter": str(folder), "layout": layout, "config_sha": _folder_digest(folder)}
    _check_config(target, folder, config)
    return config, state, dict(info, **config.describe())


def _folder_digest(folder: Path) -> str:
    """What identifies a published folder in run records: its config and its weight files' sizes."""
    parts = [(folder / CONFIG).read_text()]
    parts += [f"{p.name}:{p.stat().st_size}" for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".bin")]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def _hf_config(values: dict):
    """A transformers config of the draft layers, so absent keys take the defaults the
    references get (Qwen3Config: head_dim 128, rms_norm_eps 1e-6, ...)."""
    from transformers import AutoConfig, Qwen3Config

    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type and model_type != "qwen3":
        return AutoConfig.for_model(model_type, **values)
    return Qwen3Config(**values)


def _rope(hf) -> tuple[float, dict | None]:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (params if kind != "default" else None)


def _check_layers(hf, folder: Path) -> None:
    """What our backbone does not implement is refused, not approximated."""
    if getattr(hf, "attention_bias", False):
        raise BenchError(f"drafter {folder} has attention biases: not supported")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise BenchError(f"drafter {folder} uses activation {hf.hidden_act}: only silu is supported")
    if any(kind != "full_attention" for kind in (getattr(hf, "layer_types", None) or [])):
        raise BenchError(f"drafter {folder} has sliding-window draft layers: not supported")


def _shape(hf, taps: list[int], **kwargs) -> BlockConfig:
    heads = hf.num_attention_heads
    theta, scaling = _rope(hf)
    return BlockConfig(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size, num_heads=heads,
                       num_kv_heads=hf.num_key_value_heads or heads,
                       head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab_size=hf.vocab_size,
                       taps=list(taps), num_layers=hf.num_hidden_layers, rope_theta=theta, rope_scaling=scaling,
                       rms_norm_eps=hf.rms_norm_eps, **kwargs)


def _read_zlab(target, folder: Path, raw: dict, state: dict[str, Tensor]) -> tuple[BlockConfig, dict]:
    nested = raw.get("dflash_config") or {}

    def value(name, default=None):  # z-lab's _draft_value: dflash_config first, then top level
        return nested.get(name, raw.get(name, default))

    hf = _hf_config({k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")})
    _check_layers(hf, folder)
    if value("is_causal"):
        raise BenchError(f"drafter {folder} has causal draft layers: not supported")
    num_target = raw.get("num_target_layers")
    ids = value("target_layer_ids")
    if ids is None:
        if num_target is None:
            raise BenchError(f"drafter {folder} names neither target_layer_ids nor num_target_layers")
        ids = zlab_layer_ids(int(num_target), hf.num_hidden_layers)
    mask = value("mask_token_id")
    if mask is None:
        raise BenchError(f"drafter {folder} has no mask_token_id (config.json or its dflash_config)")
    check_matches_target(target, folder, "DFlash drafter", hidden_size=hf.hidden_size, vocab_size=hf.vocab_size,
                         num_layers=num_target, tap_layers=[int(i) + 1 for i in ids])
    softcap = value("final_logit_softcapping")
    config = _shape(hf, [int(i) + 1 for i in ids], block_size=int(value("block_size", 16)), sample_from_anchor=False,
                    qk_norm=True, mask_token_id=int(mask),
                    input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                    output_multiplier=float(value("output_multiplier", 1.0)),
                    final_logit_softcapping=float(softcap) if softcap else None)
    state = dict(state, draft_to_target=torch.arange(config.vocab_size))
    return config, state


def _read_speculators(target, folder: Path, raw: dict, state: dict[str, Tensor]) -> tuple[BlockConfig, dict]:
    kind = speculators_type(raw)
    hf = _hf_config(raw["transformer_layer_config"])
    _check_layers(hf, folder)
    taps = raw.get("aux_hidden_state_layer_ids")
    if not taps:
        raise BenchError(f"drafter {folder} has no aux_hidden_state_layer_ids")
    if raw.get("mask_token_id") is None:
        raise BenchError(f"drafter {folder} has no mask_token_id")
    if raw.get("target_hidden_size") not in (None, hf.hidden_size):
        raise BenchError(f"drafter {folder} projects a target hidden size {raw['target_hidden_size']}: not supported")
    check_matches_target(target, folder, f"speculators {kind} drafter", hidden_size=hf.hidden_size,
                         vocab_size=hf.vocab_size, tap_layers=[int(t) for t in taps])
    draft_vocab = int(raw.get("draft_vocab_size", 32000))
    reduced = draft_vocab != hf.vocab_size
    extra = {}
    if kind == "dspark":
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise BenchError(f"drafter {folder} has a '{raw['markov_head_type']}' Markov head: "
                             "only vanilla is supported")
        extra = {"markov_rank": int(raw.get("markov_rank", 256)),
                 "enable_confidence_head": bool(raw.get("enable_confidence_head", True)),
                 "confidence_head_with_markov": bool(raw.get("confidence_head_with_markov", True))}
    config = _shape(hf, [int(t) for t in taps], block_size=int(raw.get("block_size", 8)),
                    sample_from_anchor=bool(raw.get("sample_from_anchor", kind == "dspark")), qk_norm=True,
                    mask_token_id=int(raw["mask_token_id"]), draft_vocab_size=draft_vocab if reduced else None, **extra)
    d2t = state.get("d2t")
    state = {k: v for k, v in state.items() if k not in _SPECULATORS_SHARED + ("d2t", "t2d")}
    if reduced:
        if d2t is None:
            raise BenchError(f"drafter {folder} has a draft vocabulary of {draft_vocab} but no d2t")
        d2t = d2t.long()
        if d2t.shape != (draft_vocab,):
            raise BenchError(f"drafter {folder}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {draft_vocab}")
        mapping = torch.arange(draft_vocab) + d2t
        if int(mapping.min()) < 0 or int(mapping.max()) >= hf.vocab_size:
            raise BenchError(f"drafter {folder}: d2t maps outside the target's vocabulary")
        state["draft_to_target"] = mapping
    else:
        state["draft_to_target"] = torch.arange(hf.vocab_size)
    return config, state


def _check_config(target, folder: Path, config: BlockConfig) -> None:
    vocab = target.config.vocab_size
    if config.mask_token_id is not None and not 0 <= config.mask_token_id < vocab:
        raise BenchError(f"drafter {folder} has mask_token_id {config.mask_token_id} outside the target's "
                         f"vocabulary ({vocab})")
    if config.block_size < 2 and not config.sample_from_anchor:
        raise BenchError(f"drafter {folder} has block_size {config.block_size}: no slot drafts")
    if config.hidden_size != target.config.hidden_size:
        raise BenchError(f"drafter {folder} has hidden size {config.hidden_size}; target '{target.name}' has "
                         f"{target.config.hidden_size}")


# ----------------------------------------------------------------------------- writing
def _qwen3_dict(config: BlockConfig, target) -> dict:
    from transformers import Qwen3Config

    rope = {"rope_theta": config.rope_theta, "rope_type": "default", **(config.rope_scaling or {})}
    hf = Qwen3Config(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                     head_dim=config.head_dim, num_hidden_layers=config.num_layers, vocab_size=config.vocab_size,
                     rms_norm_eps=config.rms_norm_eps, rope_parameters=rope, hidden_act="silu", attention_bias=False,
                     max_position_embeddings=getattr(target.config, "max_position_embeddings", 32768),
                     tie_word_embeddings=False)
    values = hf.to_dict()
    for key in ("transformers_version", "_name_or_path", "id2label", "label2id", "dtype"):
        values.pop(key, None)
    return values


def export_drafter(target, folder: Path, fmt: str, out: Path, methods: tuple[str, ...]) -> Path:
    """Write the drafter in `folder` (any layout) as a published `fmt` folder at `out`."""
    from methods.dflash.model import BlockDraftModel

    config, state, _ = read_drafter(target, folder, methods)
    if config.convention not in (ZLAB, "sample_from_anchor"):
        raise BenchError(f"drafter {folder} follows our legacy convention (a learned MASK vector, no q/k-norm), "
                         "which no published layout expresses: retrain it (`bench train`)")
    deviations = [k for k in DEVIATIONS if getattr(config, k)]
    if deviations:
        raise BenchError(f"drafter {folder} was trained with {' and '.join(deviations)}, which no published layout "
                         "expresses: it runs here only")
    dtype = state["fc.weight"].dtype
    model = BlockDraftModel(config)
    load_weights_into(model, state, folder)
    weights = {k: v.detach().to(dtype) for k, v in model.named_parameters()}
    if fmt == "dflash":
        return _write_zlab(config, weights, target, folder, out)
    if fmt == "speculators":
        return _write_speculators(config, model, weights, target, out, dtype)
    raise BenchError(f"unknown export format '{fmt}'")


def _write_zlab(config: BlockConfig, weights: dict, target, folder: Path, out: Path) -> Path:
    if config.markov_rank or config.enable_confidence_head:
        raise BenchError(f"drafter {folder} has DSpark heads: export it with --method dspark --format speculators")
    if config.convention != ZLAB:
        raise BenchError(f"drafter {folder} drafts from the anchor slot (sample_from_anchor), which z-lab's layout "
                         "cannot say: export it with --format speculators")
    if config.draft_vocab_size:
        raise BenchError(f"drafter {folder} has a reduced draft vocabulary ({config.draft_vocab_size}), which z-lab's "
                         "layout cannot say: export it with --format speculators")
    values = _qwen3_dict(config, target)
    dflash_config = {"target_layer_ids": [t - 1 for t in config.taps], "mask_token_id": config.mask_token_id,
                     "block_size": config.block_size}
    for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        if getattr(config, key) != default:
            dflash_config[key] = getattr(config, key)
    values.update(architectures=[ZLAB_ARCHITECTURE], num_target_layers=target.config.num_hidden_layers,
                  block_size=config.block_size, dflash_config=dflash_config)
    return write_published(out, values, weights)


def _write_speculators(config: BlockConfig, model, weights: dict, target, out: Path, dtype: torch.dtype) -> Path:
    if config.input_embedding_scale != 1.0 or config.output_multiplier != 1.0 or config.final_logit_softcapping:
        raise BenchError("speculators' layout has no embedding scale, logit multiplier or softcap: "
                         "export this drafter with --format dflash")
    kind = "dspark" if (config.markov_rank or config.enable_confidence_head) else "dflash"
    values = {**speculators_header(kind, target, config.drafts_per_block),
              "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
              "transformer_layer_config": {**_qwen3_dict(config, target), "model_type": "qwen3"},
              "draft_vocab_size": config.draft_vocab_size or config.vocab_size, "block_size": config.block_size,
              "target_hidden_size": None, "aux_hidden_state_layer_ids": list(config.taps),
              "mask_token_id": config.mask_token_id, "sliding_window_non_causal": False,
              "sample_from_anchor": config.sample_from_anchor}
    if kind == "dspark":
        values.update(markov_rank=config.markov_rank, markov_head_type="vanilla",
                      enable_confidence_head=config.enable_confidence_head,
                      confidence_head_with_markov=config.confidence_head_with_markov)
    if config.draft_vocab_size:
        mapping = model.draft_to_target
        order = mapping.argsort()  # speculators' t2d mask implies draft ids in target-id order
        mapping = mapping[order]
        if "markov_head.markov_w2.weight" in weights:
            weights["markov_head.markov_w2.weight"] = weights["markov_head.markov_w2.weight"][order]
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[mapping] = True
        weights.update(d2t=mapping - torch.arange(len(mapping)), t2d=t2d,
                       **{"lm_head.weight": target.engine.lm_head[mapping.to(target.engine.lm_head.device)].to(dtype)})
    return write_published(out, values, weights)
