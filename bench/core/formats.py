"""Published drafter layouts: reading and writing Hugging Face style folders.

Drafters people publish and serve (z-lab DFlash, vLLM `speculators`, SafeAILab EAGLE,
FasterDecoding and vLLM Medusa) are folders of `config.json` plus `model.safetensors`
(or `pytorch_model.bin`, or shards with an index). Each method's module knows its own
layouts (detect, map keys, export); this file holds what they share: reading a folder,
refusing one made for another target, and writing one atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from bench.core.drafters import read_weights
from bench.core.errors import BenchError

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_config(folder: Path) -> dict:
    """The folder's config.json as a dict; a one-line BenchError when missing or not JSON."""
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"unreadable drafter config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise BenchError(f"drafter config {path} is not a JSON object")
    return config


def read_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a published folder: one weights file or shards listed by an index."""
    folder = Path(folder)
    for name in WEIGHT_FILES:
        if (folder / name).exists():
            return read_weights(folder / name)
    for name in SHARD_INDEXES:
        if (folder / name).exists():
            try:
                files = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise BenchError(f"unreadable shard index {folder / name}: {exc}") from None
            state: dict[str, torch.Tensor] = {}
            for file in files:
                state.update(read_weights(folder / file))
            return state
    raise BenchError(f"drafter folder {folder} has no {' or '.join(WEIGHT_FILES)} (nor a shard index)")


def check_matches_target(target, folder: Path, what: str, *, hidden_size: int | None = None,
                         vocab_size: int | None = None, num_layers: int | None = None,
                         tap_layers: list[int] | None = None) -> None:
    """Refuse, in one line naming the mismatch, a published drafter made for another target:
    hidden size, vocabulary, target layer count, tapped layers out of range, or a tokenizer
    shipped in the folder that differs from the target's."""
    config = target.config
    checks = [("hidden size", hidden_size, config.hidden_size), ("vocabulary", vocab_size, config.vocab_size),
              ("target layer count", num_layers, config.num_hidden_layers)]
    for name, theirs, ours in checks:
        if theirs is not None and int(theirs) != int(ours):
            raise BenchError(f"{what} {folder} is for a target with {name} {theirs}; "
                             f"target '{target.name}' has {ours}")
    if tap_layers is not None:
        bad = [layer for layer in tap_layers if not 0 <= int(layer) <= config.num_hidden_layers]
        if bad:
            raise BenchError(f"{what} {folder} taps target layer {bad[0]}; target '{target.name}' has "
                             f"{config.num_hidden_layers} layers")
    tokenizer_file = Path(folder) / "tokenizer.json"
    if tokenizer_file.exists() and getattr(target, "tokenizer", None) is not None:
        try:
            vocab = json.loads(tokenizer_file.read_text())["model"]["vocab"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # a tokenizer we cannot read is not evidence of a mismatch
        ours = target.tokenizer.get_vocab()
        if isinstance(vocab, dict) and any(ours.get(token) != index for token, index in vocab.items()):
            raise BenchError(f"{what} {folder} ships a tokenizer that differs from target '{target.name}''s "
                             f"({len(vocab)} vs {len(ours)} tokens)")


def write_published(out: Path, config: dict, weights: dict[str, torch.Tensor],
                    extra_json: dict[str, dict] | None = None, weights_file: str = WEIGHT_FILES[0]) -> Path:
    """Write config.json + model.safetensors (+ extra JSON files) into `out`, all or nothing:
    built in a sibling temp folder and renamed into place. `out` must not exist or be empty.
    `weights_file` names the safetensors file where a layout wants another name (Medusa's)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise BenchError(f"export folder {out} exists and is not empty")
    tmp = out.with_name(out.name + ".export.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        save_file(tensors, str(tmp / weights_file), metadata={"format": "pt"})
        os.chmod(tmp / weights_file, 0o644)  # safetensors writes 0600; a published folder is for others to read
        for name, content in {CONFIG: config, **(extra_json or {})}.items():
            (tmp / name).write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BenchError(f"cannot write export folder {out}: {exc.strerror or exc}") from None
    return out


# vLLM's `speculators` layout: every drafter's config.json carries this header.
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout we read and write


def speculators_header(algorithm: str, target, speculative_tokens: int) -> dict:
    """The `speculators_model_type` / `speculators_config` fields of a speculators config:
    the algorithm, one greedy proposal of `speculative_tokens`, and the verifier (target)."""
    from bench.core.target import hub_id

    source = hub_id(target)
    architectures = list(getattr(target.config, "architectures", None) or [])
    return {
        "speculators_model_type": algorithm,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(source), "architectures": architectures},
        },
    }


def speculators_type(config: dict) -> str | None:
    """The speculators algorithm of a config.json ('eagle3', 'dflash', ...), None if not one."""
    kind = config.get("speculators_model_type")
    return kind if isinstance(kind, str) else None
