"""Drafters trained at scale on a lent GPU: `make train-at-scale` runs there, and
what it made comes back in parts.

A call carries at most 64 MiB and brings back at most 8 files of 16 MiB (64 MiB in all), so
the checkout travels slim, the target's GGUF travels in two parts (scripts.gpu_distill
--prepare: ignored files stay on the warm machine between calls), and the drafters come back
as numbered parts of one archive, up to 4 per call: each method's shipped drafter and its
training folder without the resume files (the copies `--keep-at` kept, for the scaling runs).

    python -m scripts.device_tree slim && python -m scripts.gpu_distill --prepare .gpu_distill   # here
    # call 1 carries .gpu_distill/part0 and runs `true`; call 2 carries part1 and pylib and runs
    python3 -m scripts.gpu_scale --run .gpu_distill --methods "eagle3 dspark" --out $OUT
    # then, while the machine is warm, calls that run `python3 -m scripts.gpu_scale --send 4 --out $OUT`
    # (parts 4..7), `--send 8`, ... until it prints that nothing is left; then here:
    python -m scripts.gpu_scale --merge FILES_AT_1 FILES_AT_2 ...   # every call's files folder
    python -m scripts.device_tree restore

`--run` trains with `make train-at-scale SETUP= BENCH="python3 -m bench.cli"`, so the methods'
settings are the Makefile's; `--args` adds to TRAIN_ARGS (e.g. a larger `--batch-size`, which
the manifests record). `--minutes M` fits the run into one call: the features are extracted
once, then every method trains at once, each its own process on the one GPU, with
`--stop-after` so that each exports, checkpoints and ships by M minutes after the start (a
method stopped early, which make does not ship, is shipped here with the drafter it had: its
manifest says how far it got), and only the shipped drafters travel back (no training
folders), in parts 0..3 of that call. `--merge` checks the archive's digest, puts the shipped
drafters in methods/checkpoints and the training folders where `bench train` would have left
them, and checks the 100 MB budget.

A run `--minutes` stops before its end comes back too: after the drafters' parts, its training
folder with the checkpoint (`--send 4`, ... while the lease lasts), which `--merge` puts in
SCALE_OUT, so the same command resumes it, here or on the next lease: `--stage METHODS` packs
those folders for it into resume.json and resume0/, resume1/, ... (a call carries one), and
`--run` puts them back before it trains.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from scripts.gpu_distill import install_target

PART_BYTES = 15 * 2**20  # under the 16 MiB a returned file may have
PARTS_PER_CALL = 4  # 60 MiB: under the 64 MiB a call brings back
STAGE_BYTES = 52 * 2**20  # what a call carries beside the slim checkout (about 9 MiB), under 64 MiB
PACKED = Path(".gpu_scale")  # on the device machine, in the checkout: the parts wait here between calls
INDEX = "gpu_scale.json"


def _pack(methods: list[str], out_dir: Path, checkpoints: Path | None = None, shipped_only: bool = False) -> dict:
    """One archive of the shipped drafters and training folders, split into numbered parts."""
    import methods as shipped_root
    from bench.core.drafters import user_dir
    from bench.core.target import DEFAULT_TARGET

    root = (checkpoints or Path(shipped_root.__file__).parent / "checkpoints") / DEFAULT_TARGET
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / "drafters.tar"
    with tarfile.open(archive, "w") as tar:
        for method in methods:
            tar.add(root / method, arcname=f"shipped/{method}")
            if shipped_only:
                continue
            folder = user_dir(DEFAULT_TARGET, method)
            for path in sorted(folder.rglob("*")):
                relative = path.relative_to(folder)
                if path.is_file() and relative.parts[0] != "checkpoint" and not path.name.startswith("."):
                    tar.add(path, arcname=f"training/{method}/{relative}")
    blob = archive.read_bytes()
    archive.unlink()
    index = {"methods": methods, "target": DEFAULT_TARGET, **_split(blob, out_dir, "drafters"),
             "shipped_only": shipped_only}
    (out_dir / INDEX).write_text(json.dumps(index))
    return index


def _split(blob: bytes, out_dir: Path, stem: str) -> dict:
    """`blob` as numbered files stem.part00, stem.part01, ... in out_dir; their names and digest."""
    names = []
    for i in range(0, len(blob), PART_BYTES):
        names.append(f"{stem}.part{i // PART_BYTES:02d}")
        (out_dir / names[-1]).write_bytes(blob[i:i + PART_BYTES])
    return {"parts": names, "sha256": hashlib.sha256(blob).hexdigest()}


def _joined(found: dict[str, Path], entry: dict) -> bytes | None:
    """The archive an index entry names; None while a part is missing."""
    if any(name not in found for name in entry["parts"]):
        return None
    blob = b"".join(found[name].read_bytes() for name in entry["parts"])
    if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        sys.exit(f"the parts {entry['parts'][0]}... do not make the archive that was written")
    return blob


def _tar_folders(folders: dict[str, Path]) -> bytes:
    """Training folders (checkpoint, log, kept copies; not the lock) as one tar, each under its name."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, folder in folders.items():
            for path in sorted(folder.rglob("*")):
                if path.is_file() and path.name != ".train.lock":
                    tar.add(path, arcname=f"{name}/{path.relative_to(folder)}")
    return buffer.getvalue()


def _untar_folders(blob: bytes, names: list[str], root: Path) -> None:
    """Each named folder of the tar into root/<name>; a folder already there is kept as <name>.before-<time>."""
    staging = root / f".gpu_scale_untar-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(staging, filter="data")
    for name in names:
        if (root / name).exists():
            (root / name).rename(root / f"{name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(staging / name), root / name)
        print(f"{name}: training folder {root / name} ({_progress(root / name)})", flush=True)
    shutil.rmtree(staging)


def _progress(folder: Path) -> str:
    state = json.loads((folder / "checkpoint" / "state.json").read_text()) \
        if (folder / "checkpoint" / "state.json").exists() else {}
    return f"checkpoint at step {state['step']}" if state else "no checkpoint"


def unfinished(folder: Path) -> bool:
    """A training folder whose run stopped before its last step: its checkpoint resumes it."""
    manifest = folder / "drafter.json"
    if not (folder / "checkpoint" / "state.json").exists() or not manifest.exists():
        return False
    training = json.loads(manifest.read_text()).get("training", {})
    return isinstance(training.get("max_steps"), int) and training.get("steps", 0) < training["max_steps"]


def _add_resume(index: dict, methods: list[str], out_dir: Path, training_root: Path | None = None) -> dict:
    """After the drafters, each unfinished run's folder, checkpoint included, for the calls left in the lease."""
    root = training_root or SCALE_OUT
    index["resume"] = {m: _split(_tar_folders({m: root / m}), out_dir, f"resume-{m}")
                       for m in methods if unfinished(root / m)}
    (out_dir / INDEX).write_text(json.dumps(index))
    return index


def _all_parts(index: dict) -> list[str]:
    """The drafters' parts first, then each unfinished run's checkpoint."""
    return index["parts"] + [name for entry in index.get("resume", {}).values() for name in entry["parts"]]


def stage(methods: list[str], dest: Path, training_root: Path | None = None) -> None:
    """Here, for the next lease: the methods' training folders (checkpoints) in dest/resume<k>/,
    one folder a call carries (STAGE_BYTES each), and dest/resume.json, which call 1 carries."""
    root = training_root or SCALE_OUT
    missing = [m for m in methods if not (root / m / "checkpoint" / "state.json").exists()]
    if missing:
        sys.exit(f"no checkpoint to resume in {root / missing[0]}")
    for old in dest.glob("resume*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    blob = _tar_folders({m: root / m for m in methods})
    folders = []
    for k, i in enumerate(range(0, len(blob), STAGE_BYTES)):
        folders.append(f"resume{k}")
        (dest / folders[-1]).mkdir(parents=True)
        (dest / folders[-1] / "part").write_bytes(blob[i:i + STAGE_BYTES])
    (dest / "resume.json").write_text(json.dumps({"methods": methods, "folders": folders,
                                                  "sha256": hashlib.sha256(blob).hexdigest()}))
    for m in methods:
        print(f"{m}: {_progress(root / m)}")
    print(f"carry {dest / 'resume.json'} in call 1, then one of {', '.join(folders)} in each following call")


def unstage(dest: Path, training_root: Path | None = None) -> None:
    """On the device: the staged training folders back into place, so the runs resume."""
    if not (dest / "resume.json").exists():
        return
    staged = json.loads((dest / "resume.json").read_text())
    parts = [dest / folder / "part" for folder in staged["folders"]]
    if not all(p.exists() for p in parts):
        sys.exit(f"carry every one of {', '.join(staged['folders'])} (or drop {dest / 'resume.json'})")
    blob = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(blob).hexdigest() != staged["sha256"]:
        sys.exit("the staged parts do not make the archive staged here")
    (training_root or SCALE_OUT).mkdir(parents=True, exist_ok=True)
    _untar_folders(blob, staged["methods"], training_root or SCALE_OUT)
    # Once: a later call on the same warm machine must not put these back over newer checkpoints.
    (dest / "resume.json").rename(dest / "resume.unstaged.json")


def send(first: int, out: Path, packed: Path = PACKED) -> None:
    """Copy parts first..first+3 (and the index) into the call's $OUT."""
    index = json.loads((packed / INDEX).read_text())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(packed / INDEX, out / INDEX)
    chosen = _all_parts(index)[first:first + PARTS_PER_CALL]
    for name in chosen:
        shutil.copy2(packed / name, out / name)
    left = _all_parts(index)[first + PARTS_PER_CALL:]
    print(f"sent parts {', '.join(chosen) or 'none'}; " +
          (f"next: --send {first + PARTS_PER_CALL} ({len(left)} left)" if left else "nothing is left"))


CACHE_BYTES = 40 * 2**30  # the 5M-token features of five taps (23.5 GiB) and room to spare
SCALE_OUT = Path.home() / ".cache" / "spec-bench" / "drafters-scale"  # each method's training folder


def _make(args: str, tokens: str | None, methods: str) -> list[str]:
    command = ["make", "train-at-scale", "SETUP=", f"BENCH={sys.executable} -m bench.cli",
               f"SCALE_TRAIN={methods}", f"TRAIN_ARGS={args}", f"SCALE_OUT={SCALE_OUT}",
               "SCALE_COMPILE="]  # eager on the GPU: the path run there before (compiled only tested on CPUs)
    return command + ([f"SCALE_TOKENS={tokens}"] if tokens else [])


def _cache_root(memory: Path = Path("/dev/shm"), needed: int = CACHE_BYTES) -> Path:
    """The features in memory where it holds them (the lease's extraction is then not bound
    by its disk's writes), else on the disk."""
    try:
        if shutil.disk_usage(memory).free >= needed:
            return memory / "bench-cache"
    except OSError:
        pass
    return Path("/tmp/bench-cache")


def _environment(dest: Path) -> tuple[Path, dict]:
    """The carried target installed; pylib and the environment the make runs get."""
    pylib = install_target(dest)
    os.environ.setdefault("BENCH_CACHE", str(_cache_root()))
    # The lease's machine goes with the lease: no interrupted extraction will ever resume there,
    # so its features need not wait for the disk (the first lease extracted at 15k tok/s).
    os.environ.setdefault("BENCH_FEATURES_SYNC", "0")
    print(f"BENCH_CACHE={os.environ['BENCH_CACHE']}", flush=True)
    return pylib, dict(os.environ, PYTHONPATH=os.pathsep.join([str(pylib), str(Path.cwd())]), PYTHONUNBUFFERED="1")


def run(dest: Path, methods: list[str], out: Path, args: str, tokens: str | None) -> None:
    pylib, env = _environment(dest)
    command = _make(args, tokens, " ".join(methods))
    print(" ".join(command), flush=True)
    done = subprocess.run(command, env=env)
    if done.returncode:
        sys.exit(f"make train-at-scale failed ({done.returncode})")
    sys.path.insert(0, str(pylib))
    index = _pack([m for m in methods if m != "mtp-parallel"], PACKED)
    print(f"{len(index['parts'])} parts of the drafters' archive in {PACKED}")
    send(0, out)


def run_parallel(dest: Path, methods: list[str], out: Path, args: str, tokens: str | None, minutes: float) -> None:
    """Features once, then every method at once, each stopping in time to ship; what shipped travels back."""
    started = time.time()
    pylib, env = _environment(dest)
    unstage(dest)  # checkpoints a last lease brought back, carried again: those runs resume
    subprocess.run(_make(args, tokens, ""), env=env, check=False)  # SCALE_TRAIN empty: the features alone
    print(f"features: {time.time() - started:.0f} s after the start", flush=True)
    # Each run stops (export, checkpoint, ship) by the deadline less a margin for its last export and ship.
    stop_after = (started + 60 * minutes - 45 - time.time()) / 60
    if stop_after <= 0.5:
        sys.exit(f"the features took the whole {minutes} min: nothing left to train in")
    logs = Path("/tmp/gpu_scale_logs")
    logs.mkdir(exist_ok=True)
    running = {}
    for method in methods:
        handle = open(logs / f"{method}.log", "w")
        running[method] = (subprocess.Popen(_make(f"{args} --stop-after {stop_after:.2f}", tokens, method), env=env,
                                            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True), handle)
    for method, (process, handle) in running.items():
        try:
            process.wait(timeout=max(1.0, started + 60 * minutes - time.time()))
        except subprocess.TimeoutExpired:  # make and the bench train under it: nothing may write while we pack
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        handle.close()
        lines = (logs / f"{method}.log").read_text(errors="replace").splitlines()
        print(f"--- {method}: exit {process.returncode}\n" + "\n".join(
            line[-300:] for line in lines if not line.startswith(("train:", "\r")))[-2500:], flush=True)
    from bench.core.target import DEFAULT_TARGET

    shipped = Path("methods") / "checkpoints" / DEFAULT_TARGET

    def fresh(folder: Path) -> bool:
        return (folder / "drafter.json").exists() and (folder / "drafter.json").stat().st_mtime > started

    for method in methods:  # stopped by --stop-after (bench train's exit 3: make shipped nothing): ship what it has
        if method != "mtp-parallel" and not fresh(shipped / method) and fresh(SCALE_OUT / method):
            subprocess.run([sys.executable, "-m", "bench.cli", "ship", "--method", method, "--drafter",
                            str(SCALE_OUT / method)], env=env, check=False)
    done = [m for m in methods if m != "mtp-parallel" and fresh(shipped / m)]
    print(f"shipped in this call: {', '.join(done) or 'none'}", flush=True)
    if not done:
        sys.exit("no method shipped")
    sys.path.insert(0, str(pylib))
    index = _pack(done, PACKED, shipped_only=True)
    index = _add_resume(index, methods, PACKED)
    print(f"{len(index['parts'])} parts of the drafters' archive in {PACKED}; "
          f"{len(_all_parts(index)) - len(index['parts'])} of unfinished runs' checkpoints "
          f"({', '.join(index['resume']) or 'none'})", flush=True)
    send(0, out)


def merge(folders: list[Path], checkpoints: Path | None = None, training_root: Path | None = None) -> None:
    import methods as shipped_root
    from bench.core.drafters import SHIPPED_BUDGET_BYTES, shipped_bytes, user_dir

    index = json.loads(next(f / INDEX for f in folders if (f / INDEX).exists()).read_text())
    found = {p.name: p for f in folders for p in f.glob("*.part*")}
    missing = [name for name in index["parts"] if name not in found]
    if missing:
        sys.exit(f"parts missing: {', '.join(missing)} (fetch them with more --send calls)")
    blob = _joined(found, index)
    checkpoints = checkpoints or Path(shipped_root.__file__).parent / "checkpoints"
    staging = user_dir(index["target"], ".gpu_scale_merge")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    archive = staging / "drafters.tar"
    archive.write_bytes(blob)
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")
    for method in index["methods"]:
        for src, dst in ((staging / "shipped" / method, checkpoints / index["target"] / method),
                         (staging / "training" / method, user_dir(index["target"], method))):
            if not src.exists():  # a --shipped-only archive
                continue
            shutil.rmtree(dst, ignore_errors=True)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), dst)
        training = f"; training folder {user_dir(index['target'], method)}" \
            if (user_dir(index["target"], method)).exists() and not index.get("shipped_only") else ""
        print(f"{method}: shipped {checkpoints / index['target'] / method}{training}")
    shutil.rmtree(staging)
    total = shipped_bytes(checkpoints)
    print(f"every shipped drafter: {total / 1e6:.1f} MB (budget {SHIPPED_BUDGET_BYTES / 1e6:.0f} MB)")
    if total > SHIPPED_BUDGET_BYTES:
        sys.exit("over the shipped-drafter budget")
    for method, entry in index.get("resume", {}).items():  # unfinished runs: the same command resumes them
        run_blob = _joined(found, entry)
        if run_blob is None:
            print(f"{method}: not every part of its checkpoint came back (more --send calls); not restored")
            continue
        (training_root or SCALE_OUT).mkdir(parents=True, exist_ok=True)
        _untar_folders(run_blob, [method], training_root or SCALE_OUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="the folder gpu_distill --prepare made (carried)")
    parser.add_argument("--send", type=int, help="copy the parts from this one on into --out")
    parser.add_argument("--merge", type=Path, nargs="+", help="the folders the calls' files came back in")
    parser.add_argument("--methods", default="eagle3", help="SCALE_TRAIN: methods to train, in order")
    parser.add_argument("--args", default="--device cuda", help="TRAIN_ARGS")
    parser.add_argument("--tokens", default=None, help="SCALE_TOKENS (smaller only to try the script out)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="with --run: every method at once, shipped within this many minutes of the start")
    parser.add_argument("--stage", metavar="METHODS",
                        help="here: these runs' checkpoints (SCALE_OUT) into --run's folder, for the next lease")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.stage and not args.run:
        parser.error("--stage needs --run (the folder the calls carry)")
    if args.run and args.minutes:
        run_parallel(args.run, args.methods.split(), args.out, args.args, args.tokens, args.minutes)
    elif args.run and not args.stage:
        run(args.run, args.methods.split(), args.out, args.args, args.tokens)
    elif args.send is not None:
        send(args.send, args.out)
    elif args.merge:
        merge(args.merge)
    elif args.stage and args.run:
        stage(args.stage.split(), args.run)
    else:
        parser.error("one of --run, --send, --merge")


if __name__ == "__main__":
    main()
