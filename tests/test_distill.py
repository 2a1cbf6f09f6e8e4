"""Self-distilled training data (bench.training.distill): the overlap filter, the
target's own greedy replies turn by turn, reply spans, shards and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.training import distill as distill_module
from bench.training.distill import DistillSettings, OverlapFilter, distill, usable_conversations

GSM8K_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                  "How many clips did Natalia sell altogether in April and May?")
EVAL = {"gsm8k": [GSM8K_QUESTION], "mtbench": ["Compose an engaging travel blog post about Hawaii."]}


def _sharegpt(path: Path, conversations: list[list[str]]) -> Path:
    """A ShareGPT-format file: user turns with placeholder assistant turns (regenerated anyway)."""
    entries = [{"id": str(i), "conversations": [m for text in turns for m in
                                                ({"from": "human", "value": text}, {"from": "gpt", "value": "x"})]}
               for i, turns in enumerate(conversations)]
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


def test_overlap_filter_flags_shared_13_grams_and_whole_short_questions(tmp_path):
    overlap = OverlapFilter(EVAL)
    assert overlap.suite_of("Please solve: " + GSM8K_QUESTION.lower().replace(",", "")) == "gsm8k"
    # 13 consecutive words of the question are enough; 12 are not.
    words = GSM8K_QUESTION.split()
    assert overlap.suite_of("x " + " ".join(words[3:16]) + " y") == "gsm8k"
    assert overlap.suite_of("x " + " ".join(words[3:15]) + " y") is None
    assert overlap.suite_of("Can you compose an engaging travel blog post about Hawaii, please?") == "mtbench"
    assert overlap.suite_of("Compose an engaging travel blog post about Peru.") is None
    path = _sharegpt(tmp_path / "sg.json", [["Hi there"], [GSM8K_QUESTION], ["Tell me a joke", "Another"]])
    kept, report = usable_conversations(0, overlap, path)
    assert report["dropped_for_overlap"] == {"gsm8k": 1, "mtbench": 0}
    assert report["usable"] == len(kept) == 2 and sorted(len(c["users"]) for c in kept) == [1, 2]


@pytest.fixture
def tiny_distill(tmp_path, monkeypatch, default_target):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    path = _sharegpt(tmp_path / "sg.json", [["Say hi.", "Now say bye."], ["What is 2+2?"], ["Name a color."],
                                            [GSM8K_QUESTION]])
    settings = DistillSettings(max_reply=24, max_context=400, shard_conversations=2, dtype="float32",
                               data_path=str(path))
    return settings


@pytest.mark.slow  # the slow tier (make test-slow)
def test_replies_are_the_targets_greedy_tokens_turn_by_turn(tiny_distill, default_target, hf_model):
    torch.manual_seed(0)
    data = distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False)
    assert data.index["prompts"]["dropped_for_overlap"]["gsm8k"] == 1
    assert [s["shard"] for s in data.shards()] == [0, 1]  # 3 usable conversations, 2 per shard
    rows = list(data.rows())
    assert len(rows) == 3 and data.reply_tokens == sum(t["reply_tokens"] for r in rows for t in r["turns"])
    two_turns = [r for r in rows if len(r["turns"]) == 2]
    assert two_turns, "the first reply ended with EOS, so the second user turn is asked"
    eos = set(default_target.eos_token_ids)
    for row in rows:
        assert len(row["reply_spans"]) == len(row["turns"])  # every reply found again in the sequence
        for (start, end), turn in zip(row["reply_spans"], row["turns"]):
            assert end - start == turn["reply_tokens"]
            context = torch.tensor([row["tokens"][:start]])
            expected = hf_model.generate(input_ids=context, attention_mask=torch.ones_like(context),
                                         max_new_tokens=end - start, do_sample=False,
                                         pad_token_id=default_target.eos_token_ids[0])[0, start:].tolist()
            assert row["tokens"][start:end] == expected
            assert turn["finished"] == (row["tokens"][end - 1] in eos)


def test_an_interrupted_run_redoes_only_the_missing_shard(tiny_distill, default_target, monkeypatch):
    data = distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False)
    first = (data.folder / "shard_00000.jsonl.gz").read_bytes()
    (data.folder / "shard_00001.jsonl.gz").unlink()  # killed while writing shard 1 (it is written by rename)
    calls = []
    original = distill_module.generate_shards

    def counting(batch, tokenizer, shards, settings, eos, *rest):
        shards = list(shards)
        calls.extend([item["index"] for item in items] for _, items in shards)
        return original(batch, tokenizer, shards, settings, eos, *rest)

    monkeypatch.setattr(distill_module, "generate_shards", counting)
    again = distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False)
    assert calls == [[2]]  # only shard 1's one conversation
    assert (again.folder / "shard_00000.jsonl.gz").read_bytes() == first
    assert [s["shard"] for s in again.shards()] == [0, 1]
    log = [json.loads(line) for line in (again.folder / "log.jsonl").read_text().splitlines()]
    shards = [entry["shard"] for entry in log]  # shards run overlapped: the first run may finish 1 before 0
    assert sorted(shards[:2]) == [0, 1] and shards[2] == 1 and all(e["reply_tok_per_s"] > 0 for e in log)
    calls.clear()
    distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False)
    assert calls == []  # all done: nothing generated


def test_distill_stops_once_enough_reply_tokens_exist(tiny_distill, default_target):
    data = distill(default_target, tiny_distill, EVAL, min_reply_tokens=1, batch_size=4, progress=False)
    assert len(data.shards()) == 1  # the first shard to complete (shards run overlapped)
    status = distill_module.distill_status()
    assert f"{data.folder}: 1/2 shards, {data.reply_tokens} reply tokens" in status and "reply tok/s" in status


@pytest.mark.slow  # the slow tier (make test-slow)
def test_sps_draft_lm_trains_on_the_distilled_replies(tiny_distill, default_target, tmp_path, one_thread):
    """`bench train --method sps --option self_distill=true`: the draft LM's examples are the
    distilled conversations, with exactly the target's own reply tokens as targets."""
    from bench.training import TrainSettings
    from bench.training.distill import DistilledExamples, reply_example
    from bench.training.draft_lm import train_draft_lm

    data = distill(default_target, tiny_distill, EVAL, progress=False)
    examples = DistilledExamples(data.folder, max_len=512)
    rows = list(data.rows())
    assert len(examples) == len(rows)
    example, row = examples.get(0), rows[0]
    assert example.tokens.tolist() == row["tokens"]
    assert {i + 1 for i in example.loss_mask.nonzero().flatten().tolist()} == \
        {i for start, end in row["reply_spans"] for i in range(start, end)}
    assert reply_example(dict(row, reply_spans=[]), 512) is None
    settings = TrainSettings(out_dir=tmp_path / "sps", max_steps=1, batch_size=1, progress=False,
                             options={"num_layers": 1, "self_distill": True})
    summary = train_draft_lm(default_target, settings)
    manifest = json.loads((tmp_path / "sps" / "drafter.json").read_text())
    assert summary["steps"] == 1 and "generated by the target" in manifest["training"]["data"]
    assert manifest["training"]["tokens_seen"] == summary["tokens_seen"] > 0


@pytest.mark.slow  # the slow tier (make test-slow)
def test_a_killed_run_keeps_its_finished_conversations(tiny_distill, default_target, monkeypatch, tmp_path):
    """Conversations that finished before a kill are journaled and not generated again;
    the shard comes out as an uninterrupted run's."""
    from bench.core.slots import SlotBatch

    whole = {row["index"]: row["tokens"] for row in distill(default_target, tiny_distill, EVAL, batch_size=4,
                                                           progress=False).rows()}
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "other-cache"))
    step, calls = SlotBatch.step, []

    def dying(self, live=None):
        calls.append(live)
        if len(calls) == 30:  # every one-turn reply (<= 24 tokens) has ended by now
            raise KeyboardInterrupt
        return step(self, live)

    monkeypatch.setattr(SlotBatch, "step", dying)
    with pytest.raises(KeyboardInterrupt):
        distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False)
    monkeypatch.setattr(SlotBatch, "step", step)
    folder = distill_module.distill_dir(default_target.name, tiny_distill, "float32")
    journaled = {json.loads(line)["index"] for path in folder.glob(".shard_*.partial.jsonl")
                 for line in path.read_text().splitlines()}
    assert journaled and not (folder / "shard_00000.jsonl.gz").exists()  # shard 0 was cut mid-way
    started = []
    original = distill_module.generate_shards

    def watching(batch, tokenizer, shards, settings, eos, bar=None, finished=None, journal=None):
        shards = list(shards)
        started.extend(item["index"] for _, items in shards for item in items
                       if item["index"] not in (finished or {}).get(_, {}))
        return original(batch, tokenizer, shards, settings, eos, bar, finished, journal)

    monkeypatch.setattr(distill_module, "generate_shards", watching)
    again = distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False)
    assert not journaled & set(started)
    assert {row["index"]: row["tokens"] for row in again.rows()} == whole
    assert not list(folder.glob(".shard_*.partial.jsonl"))


def test_data_under_another_root_is_found_by_the_trainers_and_older_plain_shards_still_read(
        tiny_distill, default_target, tmp_path, monkeypatch):
    """`bench distill --root DIR` (the project ships methods/distilled/): the trainers find a
    registered root's data; a shard written plain (.jsonl, older runs) reads as a gzipped one;
    with dtype auto, a dataset begun in another dtype is continued, not restarted."""
    import gzip
    from dataclasses import replace

    from bench.training.features import FeatureData, with_distilled_folder

    root = tmp_path / "shipped"
    data = distill(default_target, tiny_distill, EVAL, batch_size=4, progress=False, root=root)
    assert data.folder.parent.parent == root and not (tmp_path / "cache" / "distill").exists()
    rows = list(data.rows())
    plain = data.folder / "shard_00000.jsonl"
    plain.write_bytes(gzip.decompress((data.folder / "shard_00000.jsonl.gz").read_bytes()))
    (data.folder / "shard_00000.jsonl.gz").unlink()
    index = json.loads((data.folder / "index.json").read_text())
    index["shards"] = [dict(s, file=plain.name) if s["shard"] == 0 else s for s in index["shards"]]
    (data.folder / "index.json").write_text(json.dumps(index))
    assert list(distill_module.DistilledData(data.folder).rows()) == rows

    monkeypatch.setattr(distill_module, "SHIPPED_ROOTS", [root])
    found = with_distilled_folder(default_target, FeatureData(self_distill=True))
    assert found.distilled == str(data.folder.resolve())
    assert str(data.folder) in distill_module.distill_status()

    monkeypatch.setattr(distill_module, "resolve_dtype", lambda name, device: "bfloat16" if name == "auto" else name)
    again = distill(default_target, replace(tiny_distill, dtype="auto"), EVAL, batch_size=4, progress=False,
                    root=root)
    assert again.folder == data.folder  # the float32 dataset, continued (here: already complete)
