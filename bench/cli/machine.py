"""`bench profile` and `bench tune`: what this machine's costs are, and the draft budgets they favour."""

from __future__ import annotations

import json

import click

from bench.core.errors import BenchError
from bench.tune import CANDIDATES


@click.command()
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

@click.command()
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
    from bench.grid import grid_methods
    from bench.registry import get_method
    from bench.run import check_device
    from bench.training.distill import tuning_prompts
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
