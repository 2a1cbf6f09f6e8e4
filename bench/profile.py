"""`bench profile`: t_v(k) of the target (bench.core.costs) and every drafter's cost per
round on this device, through the shared loop."""

from __future__ import annotations

from pathlib import Path

PROFILE_PROMPT = "Write a python function that returns the n-th Fibonacci number, with a docstring."


def kept_profile_path(results_dir: str | Path, target) -> Path:
    """This machine's `bench profile` record under results/ (device, dtype, CPU tier, torch threads)."""
    from bench.core.provenance import machine_file_name

    return Path(results_dir) / target.name / "profile" / machine_file_name(target)


def seed_profile_cache(results_dir: str | Path, target) -> Path | None:
    """Copy this machine's kept profile record into the cache methods read t_v(k) from
    (bench.core.costs.profile_path) when the cache has none, as on a fresh machine of a kind
    profiled before: a choice made from t_v(k) (Medusa's auto-sized tree) is then the same at
    every build of a run, a grid and a tuning, not a few seconds of timing each. The reader
    still checks weights, dtype, machine and threads. Returns the copy, or None."""
    from bench.core.costs import profile_path

    kept = kept_profile_path(results_dir, target)
    cached = profile_path(target.name, target.engine.device.type, str(target.engine.dtype).removeprefix("torch."))
    if cached.exists() or not kept.is_file():
        return None
    from bench.core.files import write_bytes

    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(cached, kept.read_bytes())
    except OSError:  # an unwritable cache: the methods time t_v(k) themselves, as before
        return None
    return cached


def drafter_costs(target, names: list[str], new_tokens: int = 48, progress: bool = False) -> list[dict]:
    """Per-round draft and verification time of each method's drafter on this device: a
    greedy decode of one fixed prompt (after a short warm-up), through the shared loop.
    Methods whose drafter is missing are listed with the reason instead."""
    from tqdm import tqdm

    import bench.registry as registry
    from bench.core.decode import DecodeConfig
    from bench.core.errors import BenchError
    from bench.core.sampling import SamplingConfig
    from bench.core.target import chat_prompt

    prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": PROFILE_PROMPT}])
    rows = []
    for name in tqdm(names, desc="drafter costs", disable=not progress):
        try:
            decoder = registry.build_decoder(name, target, {})
        except BenchError as exc:
            rows.append({"method": name, "skipped": str(exc)})
            continue
        decoder.run_turn(prompt, DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(0.0)))
        result = decoder.run_turn(prompt, DecodeConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(0.0)))
        rounds = max(1, len(result.accept_lengths))
        rows.append({"method": name, "rounds": len(result.accept_lengths),
                     "draft_ms_per_round": 1e3 * result.draft_time / rounds,
                     "verify_ms_per_round": 1e3 * result.verify_time / rounds,
                     "nodes_per_round": sum(result.tree_sizes) / rounds,
                     "tau": (sum(result.accept_lengths) + rounds) / rounds})
    return rows
