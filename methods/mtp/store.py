"""An MTP drafter folder: its name under drafters/<target>/, its format, and reading it back.

Our folder holds the trainable weights (bf16, bench.core.drafters.WEIGHTS) and drafter.json,
whose "variant" says which module the weights are and, for the sequential one, "fuse_order"
which half of the fused input comes first (methods/mtp/model.FUSE_ORDERS; a drafter.json
without it predates the DeepSeek-V3 default and is read as "hidden_first"). A folder without
drafter.json but with an HF config.json is a published layout (methods/mtp/layouts.py). Kept
apart from methods/mtp/__init__.py so that drafter.py and training.py can share these names
without importing the package's entry points (an import cycle).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from bench.core.drafters import MANIFEST, WEIGHTS, find_drafter, load_weights_into, open_drafter, read_weights
from bench.core.errors import BenchError
from methods.mtp.model import FUSE_ORDERS, LEGACY_FUSE_ORDER, VARIANTS, LayerShape, new_model

if TYPE_CHECKING:
    from bench.core.target import Target

METHOD = "mtp"
FORMAT = "spec-bench-mtp/1"


def drafter_key(variant: str) -> str:
    """Folder name under drafters/<target>/: each variant has its own drafter."""
    return METHOD if variant == "sequential" else f"{METHOD}-{variant}"


def find_folder(target: Target, variant: str | None, path: str | None) -> Path:
    """`path` if given, else the user's trained drafter of `variant` (default sequential)."""
    if path is not None:
        return find_drafter(target.name, METHOD, path)
    variant = variant or "sequential"
    try:
        return find_drafter(target.name, drafter_key(variant))
    except BenchError:
        extra = "" if variant == "sequential" else f" --option variant={variant}"
        raise BenchError(f"no mtp drafter (variant {variant}) for target '{target.name}': run "
                         f"`bench train --method mtp{extra}` or pass --drafter PATH") from None


def load_model(target: Target, folder: Path, variant: str | None = None) -> tuple[nn.Module, dict]:
    """The trained module in `folder` (fp32, frozen) and its manifest (with "layout" and, for
    the sequential module, "fuse_order" filled in); one-line BenchErrors for another method
    or variant, another target, a shape mismatch or unreadable weights. A folder without
    drafter.json is read as a published layout (methods/mtp/layouts.py)."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        from methods.mtp.layouts import read_published

        model, manifest = read_published(target, folder)
        if variant not in (None, "sequential"):
            raise BenchError(f"drafter {folder} is an mtp sequential drafter ({manifest['layout']} layout), "
                             f"not {variant}")
        return model, manifest
    manifest = open_drafter(target, folder, (METHOD,))
    saved = manifest.get("variant")
    if saved not in VARIANTS:
        raise BenchError(f"drafter {folder} has unknown mtp variant '{saved}'")
    if variant is not None and saved != variant:
        raise BenchError(f"drafter {folder} is an mtp {saved} drafter, not {variant}")
    shape = LayerShape.of(target.engine)
    architecture = manifest.get("architecture", {})
    expected = asdict(shape)
    mismatch = [k for k in expected if architecture.get(k) != expected[k]]
    if mismatch:
        raise BenchError(f"drafter {folder} has {mismatch[0]}={architecture.get(mismatch[0])}, "
                         f"the target's layers have {expected[mismatch[0]]}")
    try:
        heads = int(architecture.get("heads", 0)) if saved == "parallel" else 0
        if saved == "parallel" and heads < 1:
            raise ValueError("no heads")
    except (TypeError, ValueError):
        raise BenchError(f"drafter {folder} has a bad head count: {architecture.get('heads')}") from None
    fuse_order = None
    if saved == "sequential":
        fuse_order = manifest.get("fuse_order", LEGACY_FUSE_ORDER)
        if fuse_order not in FUSE_ORDERS:
            raise BenchError(f"drafter {folder} has unknown fuse_order '{fuse_order}' ({' | '.join(FUSE_ORDERS)})")
    model = new_model(saved, shape, heads, fuse_order or FUSE_ORDERS[0])
    state = read_weights(folder / manifest.get("weights", WEIGHTS))
    load_weights_into(model, state, folder, parameters_only=True)
    model.requires_grad_(False)
    stored = next(iter(state.values())).dtype  # bf16 for `bench train`'s drafters
    return model, dict(manifest, layout="spec-bench", fuse_order=fuse_order, weights_dtype=stored)
