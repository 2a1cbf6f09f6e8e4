"""τ and speedup against context length: each method on prompts of growing length.

The long prompts are built from a suite (Spec-Bench by default, its summarization and QA
documents first): each question of the sweep keeps its own last request and is preceded by
other questions' text, as a reference document, until the chat-formatted prompt reaches the
length asked for (in the target's tokens, within a few). One task file per length, named by
its content (tasks.task_name); its records go under the tag ctx<length> (bench run, the AR
baseline interleaved), which the report's context figure reads.

    python -m bench.context_sweep --method eagle3 --method pld --lengths 256,1024,4096
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from bench.core.errors import BenchError

LENGTHS = (256, 1024, 2048, 4096, 7168)  # SmolLM2's context is 8192: room for 256 new tokens and the template
PREFIX = "Read the following reference material, then answer the request after it.\n\n"


def long_prompts(questions: list, tokenizer, length: int, count: int) -> list[dict]:
    """`count` single-turn questions whose chat prompt is about `length` tokens: the request
    of question i after a reference block of the other questions' text."""
    from bench.core.target import chat_prompt

    pool = [t for q in questions for t in q.turns]
    out = []
    for index, question in enumerate(questions[:count]):
        request = question.turns[-1]
        others = pool[index + 1:] + pool[:index]
        material, used = [], 0
        base = len(chat_prompt(tokenizer, [{"role": "user", "content": PREFIX + "\n\n" + request}]))
        budget = length - base
        for text in others:
            if budget <= 0:
                break
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:budget]
            material.append(tokenizer.decode(ids))
            budget -= len(ids) + 2
            used += 1
        content = PREFIX + "\n\n".join(material) + "\n\n" + request
        out.append({"question_id": f"ctx{length}-{question.question_id}", "category": question.category,
                    "turns": [content], "context_tokens": length, "documents": used})
    return out


def write_task(rows: list[dict], folder: Path, length: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ctx{length}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@click.command()
@click.option("--method", "methods", multiple=True, required=True, help="methods to sweep (repeatable)")
@click.option("--lengths", default=",".join(map(str, LENGTHS)), show_default=True, help="prompt lengths (tokens)")
@click.option("--task", default="specbench", show_default=True, help="the suite the prompts are built from")
@click.option("--questions", type=click.IntRange(min=1), default=6, show_default=True, help="prompts per length")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--results-dir", default="results", show_default=True)
@click.option("--data-dir", default=None)
def main(methods, lengths, task, questions, max_new_tokens, results_dir, data_dir) -> None:
    """Run each method (and its AR baseline) at every prompt length; tags ctx<length>."""
    from bench.cli import main as bench
    from bench.core.target import cache_dir, load_target
    from tasks import load_task

    try:
        sizes = sorted({int(x) for x in lengths.split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"--lengths takes comma-separated integers, not '{lengths}'") from None
    target = load_target(None, "cpu")
    context = getattr(target.config, "max_position_embeddings", None)
    if not sizes or sizes[0] < 64 or (context and sizes[-1] + max_new_tokens > context):
        raise BenchError(f"--lengths must lie in 64..{context - max_new_tokens if context else 'the context'}")
    pool = sorted(load_task(task, data_dir), key=lambda q: q.category not in ("summarization", "qa", "rag"))
    folder = cache_dir() / "context-sweep"
    for length in sizes:
        path = write_task(long_prompts(pool, target.tokenizer, length, questions), folder, length)
        for method in methods:
            args = ["run", "--method", method, "--task", str(path), "--tag", f"ctx{length}", "--max-new-tokens",
                    str(max_new_tokens), "--results-dir", results_dir]
            code = bench.main(args, standalone_mode=False)
            if code not in (None, 0):
                sys.exit(code)


if __name__ == "__main__":
    main()
