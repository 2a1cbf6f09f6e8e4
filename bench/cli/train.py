"""`bench train`, `features`, `distill`, `ablate`, `ship`, `rounds`: drafters, their data and their replays."""

from __future__ import annotations

import json
import os
import sys

import click

from bench.core.errors import BenchError
from bench.core.options import option_pairs

STOPPED_EXIT = 3  # bench train stopped by --stop-after before its last step (resumable, not shipped by make)


def _under_jemalloc() -> None:
    """Re-run `bench train` under jemalloc when it is installed (Debian libjemalloc2).
    Training allocates and frees the same large tensors every step; glibc's malloc returns
    them to the system and faults them back in (see results/README.md for the measured cost)."""
    import ctypes.util
    from pathlib import Path

    if sys.argv[1:2] != ["train"] or "jemalloc" in os.environ.get("LD_PRELOAD", "") \
            or os.environ.get("BENCH_JEMALLOC") == "0":
        return
    found = [p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")
             if Path(p).exists()] or [ctypes.util.find_library("jemalloc")]
    if not found[0]:
        return
    env = dict(os.environ, LD_PRELOAD=":".join(filter(None, [os.environ.get("LD_PRELOAD"), found[0]])),
               MALLOC_CONF=os.environ.get("MALLOC_CONF", "dirty_decay_ms:-1,muzzy_decay_ms:-1"))
    os.execve(sys.executable, [sys.executable, "-m", "bench.cli", *sys.argv[1:]], env)

@click.command()
@click.option("--method", default=None, help="a method with a trained drafter (e.g. sps)")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id")
@click.option("--out", "out_dir", default=None,
              help="output folder (default: $BENCH_CACHE/drafters/<target>/<method>); resumes if it has a checkpoint")
@click.option("--status", is_flag=True,
              help="say where each training run stands (the folder --out, else every one under $BENCH_CACHE/drafters*) "
                   "and train nothing")
@click.option("--max-steps", type=click.IntRange(min=1), default=600, show_default=True,
              help="optimizer steps of --batch-size conversations each")
@click.option("--epochs", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="passes over the training data instead of --max-steps (each trainer counts its data)")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True, help="conversations per step")
@click.option("--max-len", type=click.IntRange(min=16), default=384, show_default=True,
              help="tokens per conversation (sps; feature drafters use their feature cache's length)")
@click.option("--lr", type=click.FloatRange(min=0.0, min_open=True), default=1e-3, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(min=0), default=10, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available)")
@click.option("--checkpoint-minutes", type=click.FloatRange(min=0.0), default=5.0, show_default=True)
@click.option("--export-minutes", type=click.FloatRange(min=0.0), default=None,
              help="export the drafter with its held-out evaluation at most this often (default: every 6 "
                   "checkpoints; the end and each --keep-at always export)")
@click.option("--stop-after", "stop_after", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="minutes: this invocation exports, checkpoints and stops this long after it began, with exit "
                   "status 3 if the run is unfinished (the same command resumes it), e.g. to fit a lent machine's call")
@click.option("--data-limit", type=click.IntRange(min=1), default=None, help="use only N conversations")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for torch (1 is much faster when other jobs share the cores)")
@click.option("--precision", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="auto: bf16 autocast where bf16 matmul is native (AMX, AVX512-BF16, CUDA), else fp32")
@click.option("--keep-at", default=None,
              help="trained-token counts (e.g. 2e5,1e6) at which a copy of the drafter is kept in OUT/kept/ "
                   "(for the scaling figure)")
@click.option("--compile", "compile_", is_flag=True,
              help="run the trainer's hot functions through torch.compile (eagle3, dflash, dspark; needs a C++ "
                   "compiler on a CPU; the first steps wait minutes for it, later runs reuse $BENCH_CACHE/inductor)")
@click.option("--option", "options", multiple=True, help="method training option key=value (repeatable)")
def train(method, target, out_dir, status, max_steps, epochs, batch_size, max_len, lr, warmup_steps, seed, device,
          checkpoint_minutes, export_minutes, stop_after, data_limit, threads, precision, keep_at, compile_,
          options) -> None:
    """Train a drafter for a target on ShareGPT (resumable; checkpoints every few minutes)."""
    import importlib
    import time

    invoked = time.time()  # --stop-after counts from here: loading and data setup included

    if status:
        _training_status(out_dir)
        return
    if method is None:
        raise BenchError("give --method (a method with a trained drafter: see `bench list`), or --status")
    if epochs is not None and click.get_current_context().get_parameter_source("max_steps") \
            is not click.core.ParameterSource.DEFAULT:
        raise BenchError("give --epochs or --max-steps, not both (--epochs sets the step count)")
    _under_jemalloc()
    import math
    from pathlib import Path

    from bench.core.drafters import user_dir
    from bench.core.target import cache_dir, default_device, load_target, resolve_dtype
    from bench.registry import METHODS, get_method
    from bench.run import check_device
    from bench.training import TrainSettings
    from bench.training.loop import exclusive_folder
    from bench.training.status import COMMAND

    info = get_method(method)
    if not info.trained:
        raise BenchError(f"method '{method}' has nothing to train")
    from bench.registry import check_training_options

    check_training_options(method, option_pairs(options))
    if compile_ and not info.compiles:
        with_it = ", ".join(m.name for m in METHODS.values() if m.compiles)
        raise BenchError(f"--compile: the {method} trainer has no compiled path (methods with one: {with_it})")
    try:
        keep = tuple(sorted({int(float(x)) for x in keep_at.split(",") if x.strip()})) if keep_at else ()
    except ValueError:
        raise BenchError(f"--keep-at takes token counts like 2e5,1e6, got '{keep_at}'") from None
    if any(k <= 0 for k in keep):
        raise BenchError(f"--keep-at token counts must be positive, got '{keep_at}'")
    if not math.isfinite(lr):
        raise BenchError(f"--lr must be a finite positive number, not {lr}")
    if epochs is not None and not math.isfinite(epochs):
        raise BenchError(f"--epochs must be a finite positive number, not {epochs}")
    if out_dir and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise BenchError(f"--out {out_dir} is a file, not a training folder")
    if threads:
        import torch

        torch.set_num_threads(threads)
    check_device(device)
    # The target in the training precision: bf16 where native, so its features are the ones
    # `--dtype auto` decodes with (and extracted about 2.4x faster than in fp32 on such CPUs).
    loaded = load_target(target, device, resolve_dtype(precision, device or default_device()))
    settings = TrainSettings(
        out_dir=Path(out_dir) if out_dir else user_dir(loaded.name, method), max_steps=max_steps,
        batch_size=batch_size, max_len=max_len, lr=lr, warmup_steps=warmup_steps, seed=seed,
        device=device or default_device(), checkpoint_every_s=60 * checkpoint_minutes,
        export_every_s=None if export_minutes is None else 60 * export_minutes, data_limit=data_limit,
        options=option_pairs(options), precision=precision, keep_at=keep, epochs=epochs,
        stop_at=None if stop_after is None else invoked + 60 * stop_after, compile=compile_)
    if compile_:  # inductor's compiled kernels where the drafters are cached, so the next run starts in seconds
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    click.echo(f"training {method} drafter for {loaded.name} (output folder on the last line)")
    with exclusive_folder(settings.out_dir):
        (settings.out_dir / COMMAND).write_text(_command_line() + "\n")  # what `bench train --status` says resumes it
        summary = importlib.import_module(info.module).train(loaded, settings)
    last = summary.get("last")
    metrics = " ".join(f"{k}={last[k]:.4g}" for k in ("loss", "kl", "acc", "accept") if k in last) if last else \
        "(already complete)"
    click.echo(f"{'stopped' if summary.get('stopped') else 'done'}: {summary['steps']} steps, last step {metrics}; "
               f"drafter in {summary['drafter']}; log {summary['log']}")
    manifest = Path(summary["drafter"]) / "drafter.json"
    if manifest.exists() and summary.get("last"):  # this invocation trained: say how, and where
        from bench.core.drafters import record_training_run

        record_training_run(manifest.parent, _command_line(), settings.device, summary.get("stretches"))
    from bench.core.drafters import heldout_of

    heldout = heldout_of(json.loads(manifest.read_text())) if manifest.exists() else {}
    if "predicted_tau" in heldout:
        agreement = ", ".join(f"{a:.2f}" for a in heldout["top1_by_position"])
        rounds = (f" (decode rounds simulated on the held-out replies: tau {heldout['rounds_tau']:.2f}, "
                  f"first draft accepted {heldout['rounds_a1']:.2f})" if "rounds_tau" in heldout else "")
        for key, cut in heldout.items():
            if key.startswith("first_") and isinstance(cut, dict) and "rounds_tau" in cut:
                rounds += f"; their first {key[len('first_'):]} tokens: tau {cut['rounds_tau']:.2f}"
        click.echo(f"held out: top-1 agreement by draft position {agreement}; "
                   f"predicted tau {heldout['predicted_tau']:.2f}{rounds}")
    if summary.get("stopped"):  # exit 3: unfinished, so `bench train ... && bench ship` does not ship it
        click.echo(f"unfinished: stopped by --stop-after {stop_after:g} at step {summary['steps']} of "
                   f"{summary['max_steps']}; the same command resumes it", err=True)
        sys.exit(STOPPED_EXIT)

def _command_line() -> str:
    import shlex

    return shlex.join(["bench", *sys.argv[1:]])

def _training_status(out_dir: str | None) -> None:
    from pathlib import Path

    from bench.core.target import cache_dir
    from bench.training.status import describe, read_status, training_folders

    if out_dir is not None and not Path(out_dir).is_dir():
        raise BenchError(f"no training folder {out_dir}")
    roots = [Path(out_dir)] if out_dir else sorted(cache_dir().glob("drafters*"))
    folders = training_folders(roots)
    if not folders:
        click.echo(f"no training run (a folder with a checkpoint) in {out_dir or str(cache_dir()) + '/drafters*'}")
    for folder in folders:
        click.echo(describe(read_status(folder)))

@click.command()
@click.option("--drop-tap", "drop", type=int, multiple=True,
              help="delete this layer's states from the cache (repeatable; re-extracted when a method asks)")
@click.option("--cache", "folder", default=None, help="with --drop-tap: the cache folder (needed when several exist)")
@click.option("--extract", "extract", default=None,
              help="tap numbers, e.g. 2,15,27,28,30: extract (or grow) the cache with these layers in one target "
                   "pass, so that several methods' runs then read it without another pass")
@click.option("--tokens", type=float, default=None, help="with --extract: tokens to extract (as feature_tokens)")
@click.option("--self-distill", is_flag=True, help="with --extract: the target's own replies (bench distill)")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="with --extract: CPU threads for torch")
def features(drop, folder, extract, tokens, self_distill, threads) -> None:
    """The cached target features (bench train extracts them): tokens, taps, size; --drop-tap
    frees the disk of layers the next training run does not read; --extract fills a cache
    for several methods in one pass (in the training precision, as `bench train`)."""
    from pathlib import Path

    from bench.training.features import FeatureStore, describe_cache, drop_taps, feature_caches

    if extract:
        import methods  # noqa: F401  (registers the project's shipped data, methods/distilled/)
        from bench.core.target import default_device, load_target, resolve_dtype
        from bench.training.features import FeatureData, ensure_features

        try:
            taps = tuple(sorted({int(t) for t in extract.split(",") if t.strip()}))
        except ValueError:
            raise BenchError(f"--extract takes tap numbers like 2,15,30, got '{extract}'") from None
        if threads:
            import torch

            torch.set_num_threads(threads)
        device = default_device()
        loaded = load_target(None, device, resolve_dtype("auto", device))
        if not taps or max(taps) > loaded.config.num_hidden_layers or min(taps) < 0:
            raise BenchError(f"--extract taps must lie in 0..{loaded.config.num_hidden_layers}, got '{extract}'")
        data = FeatureData(self_distill=self_distill, **({"max_tokens": int(tokens)} if tokens else {}))
        click.echo(describe_cache(ensure_features(loaded, taps, data)))
        return
    caches = [FeatureStore(Path(folder))] if folder else feature_caches()
    if drop:
        if len(caches) != 1:
            raise BenchError(f"{len(caches)} feature caches: name one with --cache FOLDER (bench features lists them)")
        caches = [drop_taps(caches[0], tuple(drop))]
    for store in caches:
        click.echo(describe_cache(store))
    if not caches:
        click.echo("no feature cache: `bench train` extracts one")

@click.command()
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="auto", show_default=True,
              help="auto: bfloat16 where the CPU has native bf16 matmul (AMX, AVX512-BF16) or on CUDA, else float32")
@click.option("--batch-size", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--max-reply", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--max-context", type=click.IntRange(min=2), default=2048, show_default=True)
@click.option("--shards", default=None, help="a:b, the shard numbers to generate (default: all)")
@click.option("--tokens", type=float, default=None, help="stop once this many reply tokens exist")
@click.option("--data-dir", default=None, help="where the evaluation suites are (for the overlap filter)")
@click.option("--root", default=None,
              help="folder of distilled data to write (default: the user cache; the project's own: methods/distilled)")
@click.option("--status", is_flag=True,
              help="list the distilled data, cached and shipped (shards, tokens, tok/s), and exit")
def distill(target, device, dtype, batch_size, max_reply, max_context, shards, tokens, data_dir, root, status) -> None:
    """Self-distilled training data: the target's own greedy replies to every turn of
    ShareGPT conversations (minus those overlapping an evaluation suite), sharded, resumable."""
    from bench.core.target import load_target, resolve_dtype
    from bench.training.distill import DistillSettings, distill, distill_status
    from tasks import evaluation_turns

    if status:
        import methods  # noqa: F401  (registers the project's shipped data, methods/distilled/)

        click.echo(distill_status())
        return
    import math
    from pathlib import Path

    from bench.run import check_device

    span = None
    if shards:
        try:
            first, last = shards.split(":")
            span = range(int(first or 0), int(last))
        except ValueError:
            raise BenchError(f"--shards takes a:b (shard numbers), not '{shards}'") from None
        if not span or span.start < 0:
            raise BenchError(f"--shards {shards} names no shard (a:b with 0 <= a < b)")
    if tokens is not None and (not math.isfinite(tokens) or tokens <= 0):
        raise BenchError(f"--tokens must be a positive number of reply tokens, not {tokens:g}")
    if root is not None and Path(root).exists() and not Path(root).is_dir():
        raise BenchError(f"--root {root} is a file, not a folder")
    check_device(device)
    if max_reply >= max_context:
        raise BenchError(f"--max-reply ({max_reply}) must be below --max-context ({max_context})")
    resolve_dtype(dtype, device)
    questions = evaluation_turns(data_dir)
    loaded = load_target(target, device="cpu")
    settings = DistillSettings(max_reply=max_reply, max_context=max_context, dtype=dtype)
    data = distill(loaded, settings, questions, span, int(tokens) if tokens else None, batch_size, device,
                   root=root)
    click.echo(f"{data.folder}: {len(data.shards())} shards, {data.reply_tokens} reply tokens")

@click.command()
@click.option("--study", default="dflash", show_default=True, help="which study's arms (bench/ablate.py: STUDIES)")
@click.option("--arm", "arms", multiple=True, help="only this arm (repeatable; default the study's default arms)")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True, help="steps per arm")
@click.option("--jobs", type=click.IntRange(min=1), default=2, show_default=True,
              help="arms trained side by side (one thread each)")
@click.option("--out", "out_dir", default=None,
              help="the arms' training folders (default: $BENCH_CACHE/ablation/STUDY)")
@click.option("--results-dir", default="results", show_default=True, help="where the study's record goes")
@click.option("--collect", "collect_only", is_flag=True, help="train nothing: record the finished arms' table")
def ablate(study, arms, steps, jobs, out_dir, results_dir, collect_only) -> None:
    """Train a study's recipe arms on the same data, batches and steps (resumable), then record
    per arm the held-out agreement by draft position, the τ it predicts and replays, and the
    first draft's context probe (results/<target>/ablation/<study>.json; `bench report` draws it)."""
    from pathlib import Path

    from bench.ablate import STUDIES, collect, record_path, run_arms, table, write_record
    from bench.core.target import DEFAULT_TARGET, cache_dir

    if study not in STUDIES:
        raise BenchError(f"unknown study '{study}' (known: {', '.join(STUDIES)})")
    names = list(arms) or STUDIES[study].default_arms()
    unknown = [a for a in names if a not in STUDIES[study].arms]
    if unknown:
        raise BenchError(f"unknown arm '{unknown[0]}' of study {study} (arms: {', '.join(STUDIES[study].arms)})")
    out = Path(out_dir) if out_dir else cache_dir() / "ablation" / study
    if not collect_only:
        codes = run_arms(study, names, steps, out, jobs)
        failed = [n for n, c in codes.items() if c != 0]
        if failed:
            click.echo(f"arms not finished: {', '.join(failed)} (their ablate.log says why; the same command "
                       "resumes them)", err=True)
    record = collect(study, names, steps, out, DEFAULT_TARGET)
    path = record_path(Path(results_dir), DEFAULT_TARGET, study)
    write_record(record, path)
    click.echo(table(record))
    click.echo(f"recorded in {path}")

@click.command()
@click.option("--method", required=True, help="a method whose drafter folder to ship (sps, medusa, mtp, eagle, "
              "eagle3, dflash, dspark)")
@click.option("--drafter", default=None, help="the drafter folder to ship (default: the user-trained one)")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id")
@click.option("--dtype", type=click.Choice(["bfloat16", "keep"]), default="bfloat16", show_default=True,
              help="stored dtype of the float weights: bfloat16 (as published checkpoints; exact for drafters "
                   "that compute in bf16) or keep (medusa computes in the target's dtype)")
def ship(method, drafter, target, dtype) -> None:
    """Make a trained drafter the project's shipped one (methods/checkpoints/<target>/<method>/,
    replacing the old files), then check every shipped drafter together against the 100 MB budget."""
    from pathlib import Path

    import torch

    import methods
    from bench.core.drafters import MANIFEST, SHIPPED_BUDGET_BYTES, ship_drafter, shipped_bytes, user_dir
    from bench.core.target import resolve_target
    from bench.registry import get_method

    spec = get_method(method)
    if not spec.trained:
        raise BenchError(f"method '{spec.name}' has no trained drafter to ship")
    name, _ = resolve_target(target)
    source = Path(drafter) if drafter else user_dir(name, spec.name)
    if not (source / MANIFEST).is_file():
        raise BenchError(f"no drafter in {source} (train one with `bench train --method {spec.name}` "
                         "or give --drafter)")
    root = Path(methods.__file__).parent / "checkpoints"
    size = ship_drafter(source, root / name / spec.name, torch.bfloat16 if dtype == "bfloat16" else None)
    total = shipped_bytes(root)
    click.echo(f"shipped {root / name / spec.name}: {size / 1e6:.1f} MB; every shipped drafter: {total / 1e6:.1f} MB "
               f"(budget {SHIPPED_BUDGET_BYTES / 1e6:.0f} MB)")
    shadow = user_dir(name, spec.name)
    if source.resolve() != shadow.resolve() and (shadow / MANIFEST).is_file():
        click.echo(f"note: runs load the user-trained drafter in {shadow} before the shipped one; move it away "
                   "to run what was just shipped", err=True)
    if total > SHIPPED_BUDGET_BYTES:
        raise BenchError(f"the shipped drafters total {total / 1e6:.1f} MB, over the "
                         f"{SHIPPED_BUDGET_BYTES / 1e6:.0f} MB budget")


@click.command()
@click.option("--method", required=True, help="the method whose shipped drafter is replayed (bench/rounds.py)")
@click.option("--tag", default="grid", show_default=True, help="the series whose records are replayed")
@click.option("--task", "tasks", multiple=True, help="replay this task's recorded turns too (repeatable)")
@click.option("--heldout", "conversations", type=click.IntRange(min=0), default=200, show_default=True,
              help="held-out conversations replayed (0: none; they need the drafter's feature cache)")
@click.option("--reply-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="also the held-out replies cut to their first N tokens, as the grid's turns are")
@click.option("--results-dir", default="results", show_default=True)
@click.option("--out", default=None, help="where the record goes (default <results-dir>/<target>/rounds)")
def rounds(method, tag, tasks, conversations, reply_tokens, results_dir, out) -> None:
    """Replay a shipped drafter's greedy decode rounds from teacher-forced passes, on the grid's
    recorded turns (beside the rounds the loop recorded) and on its held-out conversations."""
    from pathlib import Path

    import torch

    from bench.core.target import DEFAULT_TARGET
    from bench.rounds import replay_hook, replay_rounds, write_record

    hook = replay_hook(method)  # an unknown method or one without a replay: one line, before the target loads
    if tasks and not hasattr(hook, "turn"):
        raise BenchError(f"{method}'s replay covers its held-out conversations only (its grid drafts trees): "
                         "leave out --task")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = replay_rounds(method, tag, tasks, conversations, reply_tokens, Path(results_dir), echo=click.echo)
    folder = Path(out) if out else Path(results_dir) / DEFAULT_TARGET / "rounds"
    click.echo(f"-> {write_record(folder, f'{method}-{tag}' if tasks else f'{method}-heldout', result)}")
