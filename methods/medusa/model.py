"""Medusa-1 heads (the trainable part) and their drafter folders: ours (drafter.json +
model.safetensors) and Medusa's own (config.json + medusa_lm_head.*)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.drafters import MANIFEST, WEIGHTS, open_drafter, read_weights, write_drafter
from bench.core.errors import BenchError

METHOD = "medusa"
FORMAT = "spec-bench-medusa/1"
THEIR_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
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

    def states(self, hidden: Tensor, heads: int | None = None) -> Tensor:
        """[..., d] -> [heads, ..., d]: each head's state before the lm_head."""
        return torch.stack([block(hidden) for block in self.blocks[: heads or self.num_heads]])

    def logits(self, hidden: Tensor, lm_head: Tensor, heads: int | None = None) -> Tensor:
        """[n, d] -> [heads, n, V]; one pass over the shared lm_head for all heads."""
        states = self.states(hidden, heads)
        if self.own_lm_heads is not None:
            return torch.stack([F.linear(s, w) for s, w in zip(states, self.own_lm_heads)])
        return F.linear(states, lm_head)

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
    from our format (drafter.json) or Medusa's (config.json + medusa_lm_head.*)."""
    folder = Path(folder)
    d, vocab = target.config.hidden_size, target.config.vocab_size
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
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (OSError, ValueError, KeyError, TypeError):
        raise BenchError(f"{folder} is not a medusa drafter: needs {MANIFEST}, or a config.json with "
                         "medusa_num_heads") from None
    weights = next((folder / name for name in THEIR_WEIGHTS if (folder / name).exists()), None)
    if weights is None:
        raise BenchError(f"medusa drafter {folder} has neither {' nor '.join(THEIR_WEIGHTS)}")
    state = _read_weights(weights)
    heads = MedusaHeads(d, num_heads, num_layers)
    heads.load_export_state({k: v for k, v in state.items() if ".linear." in k}, folder)
    own = [state.get(f"{i}.{num_layers}.weight") for i in range(num_heads)]
    if any(w is not None for w in own):  # non-legacy: each head has its own d -> V projection
        if any(w is None or tuple(w.shape) != (vocab, d) for w in own):
            raise BenchError(f"medusa drafter {folder}: per-head lm_head weights must all be [{vocab}, {d}]")
        heads.own_lm_heads = [w.float() for w in own]
    info = {"drafter": str(folder), "format": "medusa", "num_heads": num_heads,
            "base_model": config.get("base_model_name_or_path"), "own_lm_heads": heads.own_lm_heads is not None}
    return heads, None, None, info


def export_heads(heads: MedusaHeads, folder: Path, manifest: dict) -> None:
    """Our drafter folder: the heads' weights in bf16 and the manifest."""
    write_drafter(folder, {k: v.to(torch.bfloat16) for k, v in heads.export_state().items()}, manifest)
