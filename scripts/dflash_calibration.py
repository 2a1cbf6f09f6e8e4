"""How well DSpark's confidence head predicts survival, measured by decoding.

    python -m scripts.dflash_calibration --task humaneval --limit 10 --max-new-tokens 128

Decodes first turns greedily with the dspark drafter verifying its whole block
(schedule=none), so every slot's fate is observed. Per round and slot j it pairs the
predicted survival a_j = prod_{i<=j} c_i with the outcome (all of slots 1..j accepted),
and c_j with the conditional outcome (slot j accepted given slots < j were). Reports the
expected calibration error (10 equal-width bins) and the AUROC of both, per slot and
pooled, and writes them beside the run records with provenance:
results/<target>/<task>/dspark-calibration[-<tag>].json. The output tokens are checked
against plain AR decoding (lossless) on the way.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch
from tqdm import tqdm

from bench.core.errors import BenchError


def expected_calibration_error(predicted: list[float], observed: list[int], bins: int = 10) -> float:
    """Σ_b (n_b / n) |mean predicted_b - mean observed_b| over equal-width bins."""
    if not predicted:
        return float("nan")
    total, error = len(predicted), 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        members = [i for i, p in enumerate(predicted) if low <= p < high or (b == bins - 1 and p == 1.0)]
        if members:
            mean_p = sum(predicted[i] for i in members) / len(members)
            mean_o = sum(observed[i] for i in members) / len(members)
            error += len(members) / total * abs(mean_p - mean_o)
    return error


def auroc(predicted: list[float], observed: list[int]) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    positives = [p for p, o in zip(predicted, observed) if o]
    negatives = [p for p, o in zip(predicted, observed) if not o]
    if not positives or not negatives:
        return float("nan")
    order = sorted(predicted)
    # rank-sum (Mann-Whitney U) with average ranks for ties
    ranks: dict[float, float] = {}
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and order[j] == order[i]:
            j += 1
        ranks[order[i]] = (i + j + 1) / 2
        i = j
    rank_sum = sum(ranks[p] for p in positives)
    n_pos, n_neg = len(positives), len(negatives)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def calibration_pairs(rounds: list[tuple[list[float], int]]) -> dict[str, list]:
    """From (confidences c_1..c_b, accepted count n) per round: (slot, a_j, survived_j) and
    (slot, c_j, accepted_j | slots < j accepted)."""
    survival, conditional = [], []
    for confidences, accepted in rounds:
        running = 1.0
        for j, c in enumerate(confidences, start=1):
            running *= c
            survival.append((j, running, int(accepted >= j)))
            if accepted >= j - 1:
                conditional.append((j, c, int(accepted >= j)))
    return {"survival": survival, "conditional": conditional}


def summarize_pairs(pairs: list[tuple[int, float, int]]) -> dict:
    slots = sorted({slot for slot, _, _ in pairs})
    rows = {}
    for slot in slots:
        chosen = [(p, o) for s, p, o in pairs if s == slot]
        predicted, observed = [p for p, _ in chosen], [o for _, o in chosen]
        rows[slot] = {"n": len(chosen), "mean_predicted": sum(predicted) / len(chosen),
                      "observed_rate": sum(observed) / len(chosen),
                      "ece": expected_calibration_error(predicted, observed), "auroc": auroc(predicted, observed)}
    predicted, observed = [p for _, p, _ in pairs], [o for _, _, o in pairs]
    return {"pooled": {"n": len(pairs), "ece": expected_calibration_error(predicted, observed),
                       "auroc": auroc(predicted, observed)}, "per_slot": rows}


def measure(target, task: str, limit: int, max_new_tokens: int, options: dict, progress: bool = True) -> dict:
    import bench.registry as registry
    from bench.core.decode import DecodeConfig, Drafter, decode
    from bench.core.sampling import SamplingConfig
    from bench.core.target import chat_prompt
    from tasks import load_task

    decoder = registry.build_decoder("dspark", target, dict(options, schedule="none"))
    drafter = decoder.drafter
    rounds: list[tuple[list[float], int]] = []
    original_learn = drafter.learn

    def record_round(state, draft, verdict, out, rows):  # confidences of the block just verified
        rounds.append((list(drafter.last_confidences[: len(draft)]), len(verdict.accepted)))
        original_learn(state, draft, verdict, out, rows)

    drafter.learn = record_round
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(0.0),
                          eos_token_ids=tuple(target.eos_token_ids))
    exact = 0
    questions = load_task(task, limit=limit)
    for question in tqdm(questions, desc="calibration", disable=not progress):
        prompt = chat_prompt(target.tokenizer, [{"role": "user", "content": question.turns[0]}])
        result = decoder.run_turn(prompt, config)
        exact += result.tokens == decode(target.engine, Drafter(), prompt, config).tokens
    pairs = calibration_pairs(rounds)
    return {"task": task, "questions": len(questions), "max_new_tokens": max_new_tokens, "rounds": len(rounds),
            "exact_match": f"{exact}/{len(questions)}", "options": options,
            "survival": summarize_pairs(pairs["survival"]), "conditional": summarize_pairs(pairs["conditional"])}


@click.command()
@click.option("--task", default="humaneval", show_default=True)
@click.option("--limit", type=int, default=10, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--drafter", default=None, help="dspark drafter folder (default: user-trained, then shipped)")
@click.option("--tag", default=None)
@click.option("--results-dir", default="results", show_default=True)
def main(task: str, limit: int, max_new_tokens: int, drafter: str | None, tag: str | None, results_dir: str) -> None:
    from bench.core.target import load_target
    from bench.records import provenance

    try:
        target = load_target(device="cpu")
        options = {"drafter": drafter} if drafter else {}
        result = measure(target, task, limit, max_new_tokens, options)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    result.update(target=target.name, fingerprint=target.fingerprint, provenance=provenance("cpu"),
                  torch_threads=torch.get_num_threads())
    path = Path(results_dir) / target.name / task / f"dspark-calibration{'-' + tag if tag else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    pooled, conditional = result["survival"]["pooled"], result["conditional"]["pooled"]
    click.echo(f"{result['rounds']} rounds, exact match {result['exact_match']}; predicted survival a_j: "
               f"ECE {pooled['ece']:.3f}, AUROC {pooled['auroc']:.3f}; per-slot c_j: ECE {conditional['ece']:.3f}, "
               f"AUROC {conditional['auroc']:.3f}")
    for slot, row in result["survival"]["per_slot"].items():
        click.echo(f"  slot {slot:>2}: n={row['n']:>4} predicted {row['mean_predicted']:.3f} "
                   f"observed {row['observed_rate']:.3f} ECE {row['ece']:.3f} AUROC {row['auroc']:.3f}")
    click.echo(f"written: {path}")


if __name__ == "__main__":
    main()
