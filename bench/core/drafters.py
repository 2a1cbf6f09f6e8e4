"""Where trained drafters live, and how they are checked against the target.

A drafter for (target, method) is looked up in this order:
  1. an explicit path (`bench run --drafter PATH`),
  2. one trained by the user: $BENCH_CACHE/drafters/<target>/<method>/ (`bench train`),
  3. one shipped with the project, under a registered root (the methods package
     registers its checkpoints/ folder when it is imported): <root>/<target>/<method>/.

A drafter folder holds `drafter.json` (what it is, which target it was trained for,
how it was trained) next to its weights. Weights the drafter shares with the target
(embedding, lm_head) are not stored; they are taken from the target when loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.core.errors import BenchError
from bench.core.target import cache_dir

MANIFEST = "drafter.json"
WEIGHTS = "model.safetensors"
SHIPPED_ROOTS: list[Path] = []  # folders of drafters shipped with a package (add_shipped_root)


def add_shipped_root(folder: Path) -> None:
    """Register a folder of shipped drafters, <folder>/<target>/<method>/ (searched last)."""
    folder = Path(folder).resolve()
    if folder not in SHIPPED_ROOTS:
        SHIPPED_ROOTS.append(folder)


def shipped_dirs(target_name: str, method: str) -> list[Path]:
    return [root / target_name / method for root in SHIPPED_ROOTS]


def user_dir(target_name: str, method: str) -> Path:
    return cache_dir() / "drafters" / target_name / method


def find_drafter(target_name: str, method: str, path: str | Path | None = None) -> Path:
    """The folder of the drafter to use, or a one-line BenchError saying how to get one."""
    if path is not None:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise BenchError(f"drafter path {folder} is not a folder")
        if not ((folder / MANIFEST).exists() or (folder / "config.json").exists()):
            raise BenchError(f"drafter path {folder} has neither {MANIFEST} nor an HF config.json")
        return folder
    for folder in (user_dir(target_name, method), *shipped_dirs(target_name, method)):
        if (folder / MANIFEST).exists():
            return folder
    raise BenchError(
        f"no {method} drafter for target '{target_name}': run `bench train --method {method}"
        f"{'' if target_name == 'smollm2-135m' else ' --target ...'}` or pass --drafter PATH")


def weights_sha1(folder: Path) -> str | None:
    """The first 12 hex digits of the SHA-1 of a drafter folder's weights file (what a run
    records of the drafter it ran), or None where the folder has no readable weights."""
    import hashlib

    folder = Path(folder)
    try:
        name = json.loads((folder / MANIFEST).read_text()).get("weights", WEIGHTS)
        return hashlib.sha1((folder / name).read_bytes()).hexdigest()[:12]
    except (OSError, ValueError, AttributeError):
        return None


def heldout_of(manifest: dict) -> dict:
    """A trained drafter's held-out numbers (`top1_by_position`, `predicted_tau`, ...): at the
    manifest's top level, or in its training section (where MTP's trainer writes them)."""
    for place in (manifest, manifest.get("training")):
        heldout = place.get("heldout") if isinstance(place, dict) else None
        if isinstance(heldout, dict) and heldout:
            return heldout
    return {}


def read_manifest(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"unreadable drafter manifest in {folder}: {exc}") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A weights file: safetensors, or a torch pickle (.bin, .pt) read with weights_only."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise BenchError(f"corrupt or missing drafter weights {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise BenchError(f"drafter weights {path} are not a state dict")
    return aligned_copies(state)


def aligned_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor in memory of its own. A tensor read from a file sits wherever the file
    put it, and MKL's fp32 GEMV rounds differently by the weight's address alignment on an
    AVX512 CPU: the same weights loaded from two files gave different logits bits."""
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in state.items()}


def open_drafter(target, folder: Path, methods: tuple[str, ...]) -> dict:
    """The manifest of our drafter in `folder`, checked to be made for one of `methods`
    and for `target`'s weights; a one-line BenchError otherwise."""
    manifest = read_manifest(folder)
    made_for = manifest.get("method")
    if made_for not in methods:
        raise BenchError(f"drafter {folder} is a '{made_for}' drafter, not {' or '.join(methods)}")
    check_target(manifest, target, folder)
    return manifest


def load_weights_into(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path,
                      parameters_only: bool = False) -> None:
    """Every weight of `model` (or every parameter) from `state`, cast to the model's dtype;
    a missing or misshapen weight is a one-line BenchError naming it."""
    expected = dict(model.named_parameters()) if parameters_only else model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise BenchError(f"drafter {folder} lacks weight '{missing[0]}'")
    extra = sorted(set(state) - set(expected))
    if extra and not parameters_only:
        raise BenchError(f"drafter {folder} has a weight its architecture does not: '{extra[0]}'")
    with torch.no_grad():
        for name, current in expected.items():
            if tuple(state[name].shape) != tuple(current.shape):
                raise BenchError(f"drafter weight {name} in {folder} has shape {tuple(state[name].shape)}, "
                                 f"its architecture says {tuple(current.shape)}")
            current.copy_(state[name].to(current.dtype))


def check_target(manifest: dict, target, folder: Path) -> None:
    """Refuse a drafter trained for other target weights or another vocabulary."""
    trained_for = manifest.get("target", {})
    if trained_for.get("vocab_size") != target.config.vocab_size:
        raise BenchError(f"drafter {folder} has vocab {trained_for.get('vocab_size')}, "
                         f"target '{target.name}' has {target.config.vocab_size}")
    if trained_for.get("fingerprint") != target.fingerprint:
        raise BenchError(f"drafter {folder} was trained for target {trained_for.get('name')} "
                         f"(fingerprint {trained_for.get('fingerprint')}), not '{target.name}' ({target.fingerprint})")


def check_tokenizer(target, tokenizer, what: str) -> None:
    """A draft model must speak the target's vocabulary token for token."""
    if tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise BenchError(f"{what} uses a different tokenizer than target '{target.name}' "
                         f"({len(tokenizer)} vs {len(target.tokenizer)} tokens)")


def list_drafters() -> list[tuple[str, str, str, Path]]:
    """(target, method, 'shipped' | 'user', folder) for every drafter with a manifest."""
    found = []
    roots = [("shipped", root) for root in SHIPPED_ROOTS] + [("user", cache_dir() / "drafters")]
    for kind, root in roots:
        for manifest in sorted(root.glob(f"*/*/{MANIFEST}")) if root.exists() else []:
            folder = manifest.parent
            found.append((folder.parent.name, folder.name, kind, folder))
    return found


def drafter_info(folder: Path, manifest: dict) -> dict:
    """What identifies a trained drafter in run records: its folder, steps, export time and a
    hash of its manifest (a retrained drafter changes the records' settings)."""
    import hashlib

    training = manifest.get("training", {})
    digest = hashlib.sha1(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:12]
    info = {"drafter": str(folder), "trained_steps": training.get("steps"),
            "exported_at": training.get("exported_at"), "manifest_sha": digest}
    if training.get("tokens_seen") is not None:  # trained positions so far (the scaling figure's x)
        info["trained_tokens"] = int(training["tokens_seen"])
    heldout = heldout_of(manifest)
    # What training predicts for serving (the reports set it beside the τ measured): the τ of
    # decode rounds replayed on held-out replies cut to the grid's 128 tokens, else the product
    # of per-position agreements. A note, not identity (bench.records.DRAFTER_NOTES).
    predicted = {k: heldout[k] for k in ("predicted_tau", "rounds_tau") if isinstance(heldout.get(k), int | float)}
    first = heldout.get("first_128")
    if isinstance(first, dict) and isinstance(first.get("rounds_tau"), int | float):
        predicted["rounds_tau_first_128"] = first["rounds_tau"]
    if predicted:
        info["heldout"] = predicted
    return info


def write_drafter(folder: Path, weights: dict[str, torch.Tensor], manifest: dict) -> None:
    """Write model.safetensors and drafter.json into `folder`, weights first and the
    manifest last, each by rename from a temp folder: a reader never sees half a drafter."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder / ".export.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    (tmp / WEIGHTS).replace(folder / WEIGHTS)
    (tmp / MANIFEST).replace(folder / MANIFEST)
    tmp.rmdir()


def record_training_run(folder: Path, command: str, device: str, stretches: list[dict] | None = None) -> None:
    """Add to a trained drafter's manifest the command that trained it and the machines it ran
    on: what the README's drafter table shows. stretches: the loop's record of which steps ran
    where ({from_step, to_step, machine}; machine None where a checkpoint from before these
    records does not say), else the machine this finishing invocation runs on."""
    from bench.core.files import write_json
    from bench.core.provenance import timestamp, training_machine

    folder = Path(folder)
    manifest = read_manifest(folder)
    training = manifest.setdefault("training", {})
    run = {"command": command, "machine": describe_stretches(stretches) if stretches else training_machine(device),
           "finished_at": timestamp()}
    if stretches:
        run["stretches"] = stretches
    training.setdefault("runs", []).append(run)
    write_json(folder / MANIFEST, manifest)


def describe_stretches(stretches: list[dict]) -> str:
    """One line for the machines a resumed run trained on, in step order, neighbours on the same
    machine merged: 'A, 1 thread (steps 0-3210); A, 2 threads (steps 3210-4632)'; one machine alone: 'A, 1 thread'.
    A run whose max_steps changed between stretches adds
    '; LR schedule 4 steps from step 0, then 6 steps from step 4'."""
    merged: list[list] = []
    for s in stretches:
        if s["to_step"] <= s["from_step"]:
            continue
        if merged and merged[-1][0] == s["machine"] and merged[-1][2] == s["from_step"]:
            merged[-1][2] = s["to_step"]
        else:
            merged.append([s["machine"], s["from_step"], s["to_step"]])
    if len(merged) == 1 and merged[0][0]:
        text = merged[0][0]
    else:
        text = "; ".join(f"{m or 'not recorded'} (steps {a}-{b})" for m, a, b in merged) or "not recorded"
    # A run lengthened on resume (more epochs) trained under two LR schedules: say so, from which step.
    schedules = [(s["from_step"], s["max_steps"]) for s in stretches
                 if s.get("max_steps") and s["to_step"] > s["from_step"]]
    changes = [(a, n) for i, (a, n) in enumerate(schedules) if i == 0 or n != schedules[i - 1][1]]
    if len(changes) > 1:
        text += "; LR schedule " + ", then ".join(f"{n} steps from step {a}" for a, n in changes)
    return text


SHIPPED_BUDGET_BYTES = 100_000_000  # every shipped drafter of the project together
# A shipped per-step log keeps about this many step lines (one more when the last is off the grid),
# evenly spaced, the first and the last among them (an at-scale run logs thousands: ~0.2 KB each,
# gzipped); the full log stays in the training folder, and the manifest says how it was thinned.
SHIPPED_LOG_LINES = 1000
# What a trainer keeps beside the drafter to resume with the same draft vocabulary (the map
# itself is a buffer in the weights) and on the same feature pool (pool.json, the name
# bench.training.features.POOL gives it; the manifest keeps the pool's size): a shipped
# drafter does without them.
RESUME_ONLY = ("draft_vocab.json", "draft_vocab.safetensors", "pool.json")


def ship_drafter(source: Path, dest: Path, dtype: torch.dtype | None = torch.bfloat16) -> int:
    """Make `dest` the drafter in `source`: its weights and manifest, its float weights stored
    in `dtype` (bf16 as published checkpoints are; None keeps them), so drafters that compute
    in bf16 draft exactly as before; its training logs (*.jsonl) gzipped, thinned past
    SHIPPED_LOG_LINES (thin_log); other side files
    (a tokenizer) as they are; files of the drafter shipped before that this one lacks, and
    the trainer's resume files (RESUME_ONLY), removed. Returns the bytes now in `dest`."""
    import gzip

    from safetensors.torch import load_file

    source, dest = Path(source), Path(dest)
    manifest = read_manifest(source)
    weights = load_file(str(source / WEIGHTS))
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        manifest["stored_dtype"] = str(dtype).removeprefix("torch.")
    dest.mkdir(parents=True, exist_ok=True)
    kept = {WEIGHTS, MANIFEST}
    same = source.resolve() == dest.resolve()
    for extra in sorted(source.iterdir()):
        if not extra.is_file() or extra.name in kept or extra.name.startswith(".") or extra.name in RESUME_ONLY:
            continue
        if extra.suffix == ".jsonl":  # a per-step log: provenance, 5-10x smaller compressed
            kept.add(extra.name + ".gz")
            text, every, lines = thin_log(extra.read_text())
            if every > 1:
                manifest.setdefault("shipped_logs", {})[extra.name] = {"every_kth_line": every,
                                                                      "lines_in_training_folder": lines}
            (dest / (extra.name + ".gz")).write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            kept.add(extra.name)
            if not same:
                (dest / extra.name).write_bytes(extra.read_bytes())
    if not same or dtype is not None or "shipped_logs" in manifest:
        write_drafter(dest, weights, manifest)
    for old in dest.iterdir():  # what the drafter shipped before had and this one has not
        if old.is_file() and old.name not in kept:
            old.unlink()
    return sum(f.stat().st_size for f in dest.iterdir() if f.is_file())


def thin_log(text: str, max_lines: int = SHIPPED_LOG_LINES) -> tuple[str, int, int]:
    """(every k-th line of `text`, the first and the last among them; k; how many lines it had):
    k = 1 and the text as it is when it has at most `max_lines` lines."""
    lines = text.splitlines(keepends=True)
    every = max(1, -(-len(lines) // max_lines))
    if every == 1:
        return text, 1, len(lines)
    picked = lines[::every]
    if (len(lines) - 1) % every:
        picked.append(lines[-1])
    return "".join(picked), every, len(lines)


def shipped_bytes(root: Path) -> int:
    """Bytes of every drafter folder under a shipped root (<root>/<target>/<method>/)."""
    return sum(f.stat().st_size for f in Path(root).glob("*/*/*") if f.is_file())
