"""Medusa-1 heads (the trainable part) and their drafter folders: ours (drafter.json +
model.safetensors), FasterDecoding's (config.json + medusa_lm_head.*) and vLLM's
(config.json with model_type medusa + model.safetensors).

FasterDecoding (MD `medusa/model/medusa_model.py`, `medusa_model_legacy.py`,
`medusa/train/train_legacy.py`): config medusa_num_heads, medusa_num_layers,
base_model_name_or_path; weights "{h}.{l}.linear.weight|bias" (ResBlock l of head h) and, in
the non-legacy layout, "{h}.{L}.weight" [V, d], head h's own lm_head (MD initialises it from
the target's; the legacy heads have none and use the target's). A "medusa_head." prefix is
taken off.

vLLM (`vllm/model_executor/models/medusa.py`, `transformers_utils/configs/medusa.py`):
config model_type medusa, hidden_size, vocab_size, num_heads, num_hidden_layers,
truncated_vocab_size, medusa_fc_bias (default false: the blocks' biases are then not read,
as vLLM), original_lm_head (one lm_head shared by every head, read from lm_heads.0.weight);
weights "blocks.{h}.layers.{l}.weight|bias", "lm_heads.{h}.weight" and, for a truncated
vocabulary, "token_map" (draft row -> target id; lm_head rows beyond it are indexed by it).
A "medusa_heads." prefix is taken off.

Per-head lm_heads equal to the target's own (what an export of our heads writes) are
dropped on load: the heads then share the target's, as ours do.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.cpu_kernels import PackedLinear
from bench.core.cpu_kernels import linear as packed_linear
from bench.core.drafters import MANIFEST, WEIGHTS, open_drafter, read_weights, write_drafter
from bench.core.errors import BenchError
from bench.core.formats import check_matches_target, read_config, read_folder_weights, write_published

METHOD = "medusa"
FORMAT = "spec-bench-medusa/1"
THEIR_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
LAYOUTS = ("medusa", "medusa-vllm")  # FasterDecoding's, vLLM's


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = PackedLinear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as x + SiLU(b): close to the target's own prediction

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """The trainable part: per head a stack of ResBlocks. Logits need an lm_head: the
    target's (shared), or per-head matrices from a published non-legacy checkpoint."""

    def __init__(self, hidden: int, num_heads: int = 5, num_layers: int = 1) -> None:
        super().__init__()
        self.hidden, self.num_heads, self.num_layers = hidden, num_heads, num_layers
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self.own_lm_heads: list[Tensor] | None = None  # [V, d] per head (Medusa's non-legacy layout)
        self.token_map: Tensor | None = None  # own lm_head row -> target id (vLLM's truncated vocabulary)
        self.vocab_size: int | None = None  # the target's, when token_map is set

    def states(self, hidden: Tensor, heads: int | None = None) -> Tensor:
        """[..., d] -> [heads, ..., d]: each head's state before the lm_head."""
        return torch.stack([block(hidden) for block in self.blocks[: heads or self.num_heads]])

    def logits(self, hidden: Tensor, lm_head: Tensor, heads: int | None = None) -> Tensor:
        """[n, d] -> [heads, n, V]; one pass over the shared lm_head for all heads."""
        states = self.states(hidden, heads)
        if self.own_lm_heads is not None:
            logits = torch.stack([packed_linear(s, w) for s, w in zip(states, self.own_lm_heads)])
            if self.token_map is None:
                return logits
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            full[..., self.token_map] = logits  # tokens outside the truncated vocabulary are never drafted
            return full
        return packed_linear(states, lm_head)

    def to_engine(self, device, dtype) -> MedusaHeads:
        """Heads, own lm_heads and token map on the target's device, in its dtype."""
        self.to(device=device, dtype=dtype)
        if self.own_lm_heads is not None:
            self.own_lm_heads = [w.to(device=device, dtype=dtype) for w in self.own_lm_heads]
        if self.token_map is not None:
            self.token_map = self.token_map.to(device)
        return self

    def export_state(self) -> dict[str, Tensor]:
        """Medusa's key names: "{head}.{layer}.linear.weight|bias"."""
        return {name.removeprefix("blocks."): p.detach() for name, p in self.named_parameters()}

    def load_export_state(self, state: dict[str, Tensor], folder: Path) -> None:
        own = {f"blocks.{k}": v for k, v in state.items()}
        expected = self.state_dict()
        missing = [k for k in expected if k not in own]
        if missing:
            raise BenchError(f"medusa drafter {folder} lacks weights {missing[0].removeprefix('blocks.')}")
        for name, value in expected.items():
            if tuple(own[name].shape) != tuple(value.shape):
                raise BenchError(f"medusa drafter {folder}: {name.removeprefix('blocks.')} has shape "
                                 f"{tuple(own[name].shape)}, expected {tuple(value.shape)}")
        self.load_state_dict({k: own[k].float() for k in expected})


def _read_weights(path: Path) -> dict[str, Tensor]:
    """Weights with Medusa's `medusa_head.` prefix (their checkpoints) taken off."""
    return {k.removeprefix("medusa_head."): v for k, v in read_weights(path).items()}


def load_drafter(target, folder: Path) -> tuple[MedusaHeads, list[list[float]] | None, list | None, dict]:
    """Heads (fp32, CPU), measured top-k accuracies, the stored tree and a description,
    from our format (drafter.json), FasterDecoding's or vLLM's (config.json)."""
    folder = Path(folder)
    d = target.config.hidden_size
    if (folder / MANIFEST).exists():
        manifest = open_drafter(target, folder, (METHOD,))
        arch = manifest.get("architecture", {})
        try:
            heads = MedusaHeads(int(arch["hidden"]), int(arch["num_heads"]), int(arch["num_layers"]))
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"medusa drafter {folder}: manifest architecture lacks "
                             "hidden/num_heads/num_layers") from None
        if heads.hidden != d:
            raise BenchError(f"medusa drafter {folder} has hidden size {heads.hidden}, target has {d}")
        weights = folder / manifest.get("weights", WEIGHTS)
        if not weights.exists():
            raise BenchError(f"medusa drafter {folder} has no weights file {weights.name}")
        heads.load_export_state(_read_weights(weights), folder)
        accuracy = manifest.get("accuracy", {}).get("topk")
        tree = manifest.get("tree", {}).get("paths")
        info = {"drafter": str(folder), "format": "spec-bench", "num_heads": heads.num_heads,
                "trained_steps": manifest.get("training", {}).get("steps")}
        return heads, accuracy, tree, info
    config = read_config(folder)
    if config.get("model_type") == "medusa":
        heads, info = _load_vllm(target, folder, config)
    elif "medusa_num_heads" in config:
        heads, info = _load_faster_decoding(target, folder, config)
    else:
        raise BenchError(f"{folder} is not a medusa drafter: needs {MANIFEST}, a config.json with "
                         "medusa_num_heads (FasterDecoding) or model_type medusa (vLLM)")
    return heads, None, None, dict(info, own_lm_heads=heads.own_lm_heads is not None)


def _count(config: dict, names: tuple[str, ...], default: int | None, folder: Path) -> int:
    for name in names:
        if config.get(name) is not None:
            value = config[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BenchError(f"medusa config {folder / 'config.json'}: {name} is {value!r}")
            return value
    if default is None:
        raise BenchError(f"medusa config {folder / 'config.json'} lacks {names[0]}")
    return default


def _share_target_lm_head(heads: MedusaHeads, own: list[Tensor], target) -> None:
    """Own lm_heads, unless every one is the target's own lm_head (then the heads share it)."""
    lm_head = target.engine.lm_head
    if heads.token_map is None and all(tuple(w.shape) == tuple(lm_head.shape)
                                       and torch.equal(w.to(device=lm_head.device, dtype=lm_head.dtype), lm_head)
                                       for w in own):
        heads.own_lm_heads = None
    else:
        heads.own_lm_heads = [w.float() for w in own]


def _load_faster_decoding(target, folder: Path, config: dict) -> tuple[MedusaHeads, dict]:
    num_heads = _count(config, ("medusa_num_heads",), None, folder)
    num_layers = _count(config, ("medusa_num_layers",), 1, folder)
    weights = next((folder / name for name in THEIR_WEIGHTS if (folder / name).exists()), None)
    if weights is None:
        raise BenchError(f"medusa drafter {folder} has neither {' nor '.join(THEIR_WEIGHTS)}")
    state = _read_weights(weights)
    block = state.get("0.0.linear.weight")
    own = [state.get(f"{i}.{num_layers}.weight") for i in range(num_heads)]
    check_matches_target(target, folder, "medusa drafter",
                         hidden_size=block.shape[1] if block is not None and block.dim() == 2 else None,
                         vocab_size=own[0].shape[0] if own[0] is not None and own[0].dim() == 2 else None)
    heads = MedusaHeads(target.config.hidden_size, num_heads, num_layers)
    heads.load_export_state({k: v for k, v in state.items() if ".linear." in k}, folder)
    if any(w is not None for w in own):  # non-legacy: each head has its own d -> V projection
        d, vocab = target.config.hidden_size, target.config.vocab_size
        if any(w is None or tuple(w.shape) != (vocab, d) for w in own):
            raise BenchError(f"medusa drafter {folder}: per-head lm_head weights must all be [{vocab}, {d}]")
        _share_target_lm_head(heads, own, target)
    return heads, {"drafter": str(folder), "format": "medusa", "num_heads": num_heads,
                   "base_model": config.get("base_model_name_or_path")}


def _load_vllm(target, folder: Path, config: dict) -> tuple[MedusaHeads, dict]:
    num_heads = _count(config, ("num_heads", "medusa_num_heads"), None, folder)
    num_layers = _count(config, ("num_hidden_layers", "medusa_num_layers"), 1, folder)
    check_matches_target(target, folder, "medusa drafter", hidden_size=config.get("hidden_size"),
                         vocab_size=config.get("vocab_size"))
    d, vocab = target.config.hidden_size, target.config.vocab_size
    truncated = _count(config, ("truncated_vocab_size",), vocab, folder)
    weights = {k.removeprefix("medusa_heads."): v for k, v in read_folder_weights(folder).items()}
    bias = bool(config.get("medusa_fc_bias", False))
    state = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            key = f"blocks.{h}.layers.{layer}"
            if f"{key}.weight" not in weights or (bias and f"{key}.bias" not in weights):
                raise BenchError(f"medusa drafter {folder} lacks weights {key}.{'bias' if bias else 'weight'}")
            state[f"{h}.{layer}.linear.weight"] = weights[f"{key}.weight"]
            # vLLM reads the blocks' biases only with medusa_fc_bias (a linear without bias otherwise)
            state[f"{h}.{layer}.linear.bias"] = weights[f"{key}.bias"] if bias else torch.zeros(d)
    heads = MedusaHeads(d, num_heads, num_layers)
    heads.load_export_state(state, folder)
    if truncated < vocab:
        if "token_map" not in weights:
            raise BenchError(f"medusa drafter {folder} truncates the vocabulary to {truncated} but has no token_map")
        token_map = weights["token_map"].long().flatten()
        if token_map.numel() != truncated or token_map.min() < 0 or token_map.max() >= vocab:
            raise BenchError(f"medusa drafter {folder}: token_map must hold {truncated} target ids")
        heads.token_map, heads.vocab_size = token_map, vocab
    if config.get("original_lm_head"):
        shared = weights.get("lm_head.weight", weights.get("lm_heads.0.weight"))
        own = [shared] * num_heads
    else:
        own = [weights.get(f"lm_heads.{h}.weight") for h in range(num_heads)]
    if any(w is None for w in own):
        raise BenchError(f"medusa drafter {folder} lacks its lm_heads (lm_heads.{{h}}.weight)")
    if heads.token_map is not None:
        own = [w[heads.token_map] if w.shape[0] > truncated else w for w in own]
    rows = truncated if heads.token_map is not None else vocab
    if any(tuple(w.shape) != (rows, d) for w in own):
        raise BenchError(f"medusa drafter {folder}: lm_heads must be [{rows}, {d}]")
    _share_target_lm_head(heads, own, target)
    return heads, {"drafter": str(folder), "format": "medusa-vllm", "num_heads": num_heads,
                   "truncated_vocab": truncated if truncated < vocab else None}


def export_heads(heads: MedusaHeads, folder: Path, manifest: dict) -> None:
    """Our drafter folder: the heads' weights in bf16 and the manifest."""
    write_drafter(folder, {k: v.to(torch.bfloat16) for k, v in heads.export_state().items()}, manifest)


def _compact(tensor: Tensor) -> Tensor:
    """bf16 when that holds the value exactly (our heads are stored in bf16), else fp32."""
    tensor = tensor.detach().float().cpu()
    half = tensor.to(torch.bfloat16)
    return half if torch.equal(half.float(), tensor) else tensor


def export_published(heads: MedusaHeads, target, fmt: str, out: Path) -> Path:
    """Write `heads` (for `target`) in FasterDecoding's layout ("medusa": ResBlocks plus each
    head's lm_head, a copy of the target's for heads that share it, which MD's non-legacy
    loader needs and its legacy one skips) or vLLM's ("medusa-vllm": blocks with biases,
    the target's lm_head once with original_lm_head, or per-head lm_heads)."""
    if fmt not in LAYOUTS:
        raise BenchError(f"medusa exports to {', '.join(LAYOUTS)}, not '{fmt}'")
    d, vocab = target.config.hidden_size, target.config.vocab_size
    shared = heads.own_lm_heads is None
    lm_heads = [target.engine.lm_head] * heads.num_heads if shared else heads.own_lm_heads
    blocks = {k: _compact(v) for k, v in heads.export_state().items()}
    source = getattr(target, "source", None) or getattr(target.config, "_name_or_path", None) or target.name
    if fmt == "medusa":
        if heads.token_map is not None:
            raise BenchError("FasterDecoding's Medusa layout has no truncated vocabulary; export with --format "
                             "medusa-vllm")
        lm = _compact(lm_heads[0]) if shared else None
        weights = dict(blocks)
        for h, w in enumerate(lm_heads):
            weights[f"{h}.{heads.num_layers}.weight"] = lm.clone() if shared else _compact(w)  # no shared storage
        config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
                  "base_model_name_or_path": str(source), "version": "2", "hidden_size": d, "vocab_size": vocab}
        return write_published(out, config, weights, weights_file=THEIR_WEIGHTS[0])
    weights = {f"blocks.{k.split('.')[0]}.layers.{k.split('.')[1]}.{k.split('.')[-1]}": v for k, v in blocks.items()}
    if shared:
        weights["lm_heads.0.weight"] = _compact(lm_heads[0])
    else:
        weights.update({f"lm_heads.{h}.weight": _compact(w) for h, w in enumerate(lm_heads)})
    truncated = vocab
    if heads.token_map is not None:
        weights["token_map"] = heads.token_map.detach().cpu().long()
        truncated = int(heads.token_map.numel())
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": d, "vocab_size": vocab,
              "num_heads": heads.num_heads, "num_hidden_layers": heads.num_layers, "truncated_vocab_size": truncated,
              "medusa_fc_bias": True, "original_lm_head": shared, "max_paths": 64, "topk": 10,
              "base_model_name_or_path": str(source)}
    return write_published(out, config, weights)
