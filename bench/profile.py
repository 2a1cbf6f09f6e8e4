"""`bench profile`: t_v(k) of the target (bench.core.costs) and every drafter's cost per
round on this device, through the shared loop."""

from __future__ import annotations

PROFILE_PROMPT = "Write a python function that returns the n-th Fibonacci number, with a docstring."


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
