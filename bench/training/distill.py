"""Self-distilled training data: the target's own greedy replies to ShareGPT prompts.

Every usable ShareGPT conversation keeps its user turns; each assistant turn is replaced by
what the target itself answers (greedy, its chat template), the conversation continued
with the target's own earlier answers, as `bench run` asks an MT-bench second turn. A
drafter trained on these replies learns what it will be asked to predict at decode time.

  $BENCH_CACHE/distill/<target>/<settings key>/
      index.json           settings, the prompt filter's report, finished shards
      shard_00000.jsonl    one conversation a line: tokens, reply spans, per-turn lengths
      log.jsonl            one line per finished shard: tokens, seconds, reply tokens/s

Shard k holds conversations [k*S, (k+1)*S) of a fixed, seeded order, so a shard is a pure
function of its number: an interrupted run redoes only the shard it was in, and shards can
be generated on several machines (`--shards a:b`) and copied together. Turns are batched
across the shard's conversations (longest prompts together, a conversation's next turn
queued as soon as its previous reply exists), so batches stay full.

Prompts that share a 13-word sequence with an evaluation question (MT-bench, HumanEval,
GSM8K, Spec-Bench), or contain a short evaluation question whole, are dropped before the
order is fixed; the counts per suite are kept in index.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.errors import BenchError

FORMAT = "spec-bench-distill/1"
NGRAM = 13  # word n-gram of the overlap test (the GPT-3 contamination analysis uses 13)
EVAL_SUITES = ("mtbench", "humaneval", "gsm8k", "specbench")


@dataclass(frozen=True)
class DistillSettings:
    max_reply: int = 512  # new tokens per reply
    max_context: int = 2048  # prompt + reply; a turn whose prompt leaves less than max_reply ends the conversation
    shard_conversations: int = 128
    seed: int = 0  # order of the conversations
    dtype: str = "auto"  # bf16 where the CPU has native bf16 matmul (or on CUDA), else fp32

    def key(self, dtype: str) -> str:
        text = json.dumps({**asdict(self), "dtype": dtype}, sort_keys=True)
        return f"{dtype}-reply{self.max_reply}-ctx{self.max_context}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


# ------------------------------------------------------------------ prompts and overlap
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def eval_texts(data_dir=None) -> dict[str, list[str]]:
    """Every question text of the evaluation suites (all turns), by suite."""
    from tasks import load_task

    return {suite: [turn for q in load_task(suite, data_dir) for turn in q.turns] for suite in EVAL_SUITES}


class OverlapFilter:
    """Flags text that shares a 13-word sequence with an evaluation question, or contains
    a whole evaluation question shorter than that."""

    def __init__(self, suites: dict[str, list[str]]) -> None:
        self.grams: dict[tuple[str, ...], str] = {}
        self.short: list[tuple[str, str]] = []  # (joined words, suite)
        for suite, texts in suites.items():
            for text in texts:
                tokens = words(text)
                if len(tokens) < NGRAM:
                    if len(tokens) >= 4:  # shorter questions ("hello") are no evidence of leakage
                        self.short.append((" ".join(tokens), suite))
                    continue
                for gram in ngrams(tokens):
                    self.grams.setdefault(gram, suite)

    def suite_of(self, text: str) -> str | None:
        tokens = words(text)
        for i in range(len(tokens) - NGRAM + 1):
            suite = self.grams.get(tuple(tokens[i:i + NGRAM]))
            if suite:
                return suite
        if self.short:
            joined = " " + " ".join(tokens) + " "
            for short, suite in self.short:
                if f" {short} " in joined:
                    return suite
        return None


def usable_conversations(seed: int, overlap: OverlapFilter | None, path: Path | None = None
                         ) -> tuple[list[dict], dict]:
    """ShareGPT conversations as {'id', 'users': [user texts]} in a seeded order, without
    those overlapping an evaluation set; and the filter's report."""
    from bench.training.data import read_sharegpt

    conversations = read_sharegpt(path)
    kept, dropped = [], {suite: 0 for suite in EVAL_SUITES}
    for number, messages in enumerate(conversations):
        users = [m["content"] for m in messages if m["role"] == "user" and m["content"].strip()]
        if not users:
            continue
        suite = next((s for s in map(overlap.suite_of, users) if s), None) if overlap else None
        if suite:
            dropped[suite] += 1
            continue
        kept.append({"id": number, "users": users})
    random.Random(seed).shuffle(kept)
    report = {"conversations": len(conversations), "usable": len(kept), "dropped_for_overlap": dropped,
              "ngram": NGRAM}
    return kept, report


# ------------------------------------------------------------------ generation
def native_bf16(device: str) -> bool:
    """bf16 matmul runs natively: CUDA, or a CPU with AMX or AVX512-BF16."""
    if device.startswith("cuda"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: str) -> str:
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    return name


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@dataclass
class _Conversation:
    index: int
    source_id: int
    users: list[str]
    messages: list[dict]
    turns: list[dict]
    replies: list[list[int]]
    context: list[int] | None = None  # prompt of the pending (or last) turn


class Generator:
    """Batched greedy replies from the target's transformers model."""

    def __init__(self, folder: Path, device: str, dtype: str, eos: list[int], pad: int,
                 batch_size: int) -> None:
        from bench.target import load_hf_model

        self.model = load_hf_model(folder, device, dtype)
        self.eos, self.pad, self.batch_size = eos, pad, batch_size

    def replies(self, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], bool]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=self.pad, eos_token_id=self.eos)
        result = []
        for row in out[:, width:].tolist():
            reply, finished = [], False
            for token in row:
                reply.append(token)
                if token in self.eos:
                    finished = True
                    break
            result.append((reply, finished))
        return result


def generate_shard(generator: Generator, tokenizer, items: list[dict], settings: DistillSettings,
                   bar: tqdm | None = None) -> list[dict]:
    """Every conversation of one shard, answered turn by turn by the target."""
    conversations = [_Conversation(i["index"], i["id"], i["users"], [], [], []) for i in items]
    limit = settings.max_context - settings.max_reply

    def queue_next(conv: _Conversation) -> bool:
        turn = len(conv.turns)
        if turn >= len(conv.users):
            return False
        messages = conv.messages + [{"role": "user", "content": conv.users[turn]}]
        context = _template(tokenizer, messages, True)
        if len(context) > limit:
            return False
        conv.messages, conv.context = messages, context
        return True

    pending = [c for c in conversations if queue_next(c)]
    while pending:
        pending.sort(key=lambda c: len(c.context), reverse=True)
        batch, pending = pending[:generator.batch_size], pending[generator.batch_size:]
        for conv, (reply, finished) in zip(batch, generator.replies([c.context for c in batch], settings.max_reply)):
            conv.turns.append({"prompt_tokens": len(conv.context), "reply_tokens": len(reply), "finished": finished})
            if bar is not None:
                bar.update(len(reply))
            conv.messages = conv.messages + [{"role": "assistant",
                                              "content": tokenizer.decode(reply, skip_special_tokens=True)}]
            conv.replies.append(reply)
            if finished and queue_next(conv):  # an unfinished (cut) reply ends the conversation
                pending.append(conv)
    return [_row(tokenizer, conv) for conv in conversations if conv.turns]


def _row(tokenizer, conv: _Conversation) -> dict:
    """The conversation as one token sequence (the last turn's prompt, then its generated
    reply) and the spans of it that are the target's own greedy output. Earlier replies
    are inside the last prompt re-tokenized from their text, as `bench run` builds a
    second turn; a span is listed only where re-tokenizing gave back the generated ids."""
    tokens = conv.context + conv.replies[-1]
    spans = []
    for k, reply in enumerate(conv.replies[:-1]):  # located by templating the prefix up to its generation prompt
        start = len(_template(tokenizer, conv.messages[: 2 * k + 1], True))
        if tokens[start:start + len(reply)] == reply:
            spans.append([start, start + len(reply)])
    spans.append([len(conv.context), len(tokens)])
    return {"index": conv.index, "source_id": conv.source_id, "tokens": tokens, "reply_spans": spans,
            "turns": conv.turns}


# ------------------------------------------------------------------ the store
def distill_dir(target_name: str, settings: DistillSettings, dtype: str) -> Path:
    from bench.target import cache_dir

    return cache_dir() / "distill" / target_name / settings.key(dtype)


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


class DistilledData:
    """A distilled-data folder: its settings, finished shards and totals."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        try:
            self.index = json.loads((self.folder / "index.json").read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"unreadable distilled data {self.folder}: {exc}") from None

    def shards(self) -> list[dict]:
        """Finished shards, in shard order (a shard counts once its file is complete)."""
        return sorted((s for s in self.index["shards"] if (self.folder / s["file"]).exists()),
                      key=lambda s: s["shard"])

    @property
    def reply_tokens(self) -> int:
        return sum(s["reply_tokens"] for s in self.shards())

    def rows(self):
        """Every conversation row of the finished shards."""
        for shard in self.shards():
            with open(self.folder / shard["file"], encoding="utf-8") as handle:
                for line in handle:
                    yield json.loads(line)


def distill(target, settings: DistillSettings, shards: range | None = None, min_reply_tokens: int | None = None,
            batch_size: int = 48, device: str = "cpu", data_dir=None, progress: bool = True) -> DistilledData:
    """Generate (or resume) the distilled shards `shards` (default: all), stopping early
    once the folder holds `min_reply_tokens` reply tokens."""
    dtype = resolve_dtype(settings.dtype, device)
    folder = distill_dir(target.name, settings, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    if index is not None and index.get("target_fingerprint") != target.fingerprint:
        raise BenchError(f"distilled data {folder} came from other target weights: delete it or use another cache")
    t0 = time.perf_counter()
    items, report = usable_conversations(settings.seed, OverlapFilter(eval_texts(data_dir)))
    for number, item in enumerate(items):
        item["index"] = number
    if index is None:
        index = {"format": FORMAT, "target": target.name, "target_fingerprint": target.fingerprint,
                 "settings": asdict(settings), "dtype": dtype, "prompts": report,
                 "filter_seconds": round(time.perf_counter() - t0, 1), "shards": []}
        _write_json(index_path, index)
    size = settings.shard_conversations
    total = (len(items) + size - 1) // size
    wanted = [k for k in (shards or range(total)) if k < total]
    done = {s["shard"] for s in index["shards"] if (folder / s["file"]).exists()}
    todo = [k for k in wanted if k not in done]
    data = DistilledData(folder)
    have = data.reply_tokens
    if not todo or (min_reply_tokens and have >= min_reply_tokens):
        return data
    tokenizer = target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else target.eos_token_ids[0]
    torch.manual_seed(0)
    generator = Generator(target.path, device, dtype, target.eos_token_ids, pad, batch_size)
    bar = tqdm(total=min_reply_tokens, initial=have, desc="self-distilled reply tokens", unit="tok",
               disable=not progress, smoothing=0.05)
    for k in todo:
        if min_reply_tokens and have >= min_reply_tokens:
            break
        started = time.perf_counter()
        rows = generate_shard(generator, tokenizer, items[k * size:(k + 1) * size], settings, bar)
        seconds = time.perf_counter() - started
        name = f"shard_{k:05d}.jsonl"
        tmp = folder / ("." + name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, separators=(",", ":")) + "\n")
        os.replace(tmp, folder / name)
        replies = sum(t["reply_tokens"] for row in rows for t in row["turns"])
        entry = {"shard": k, "file": name, "conversations": len(rows),
                 "turns": sum(len(row["turns"]) for row in rows), "reply_tokens": replies,
                 "tokens": sum(len(row["tokens"]) for row in rows), "seconds": round(seconds, 1),
                 "reply_tok_per_s": round(replies / seconds, 1), "batch_size": batch_size, "device": device,
                 "threads": torch.get_num_threads(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        index = json.loads(index_path.read_text())  # another machine's shards may have been copied in
        index["shards"] = [s for s in index["shards"] if s["shard"] != k] + [entry]
        _write_json(index_path, index)
        with open(folder / "log.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps(entry) + "\n")
        have += replies
        bar.set_postfix(shard=k, tok_s=entry["reply_tok_per_s"])
    bar.close()
    return DistilledData(folder)


def _shard_range(text: str | None) -> range | None:
    if not text:
        return None
    try:
        a, b = text.split(":")
        return range(int(a or 0), int(b))
    except ValueError:
        raise BenchError(f"--shards takes a:b (shard numbers), not '{text}'") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--max-reply", type=int, default=512)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--shards", default=None, help="a:b, shard numbers to generate (default: all)")
    parser.add_argument("--tokens", type=float, default=None, help="stop once this many reply tokens exist")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    from bench.target import load_target

    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        target = load_target(args.target, device="cpu")
        settings = DistillSettings(max_reply=args.max_reply, max_context=args.max_context, dtype=args.dtype)
        data = distill(target, settings, _shard_range(args.shards), int(args.tokens) if args.tokens else None,
                       args.batch_size, args.device, args.data_dir)
    except BenchError as exc:
        print(f"error: {exc}")
        return 2
    print(f"{data.folder}: {len(data.shards())} shards, {data.reply_tokens} reply tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
