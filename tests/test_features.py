"""The shared feature cache: extraction, resume after interruption, adding taps, refusal
of another target's cache, and self-distilled data."""

import json

import pytest
import torch

from bench.core.errors import BenchError
from bench.core.training import features as features_module
from bench.core.training.features import FeatureData, FeatureStore, ensure_features, features_dir


@pytest.fixture
def cache(default_target, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(features_module, "SHARD_SEQUENCES", 2)
    return tmp_path


def test_features_equal_a_fresh_forward_and_resume(default_target, cache, one_thread, monkeypatch):
    data = FeatureData(max_tokens=1200, max_len=256)
    store = ensure_features(default_target, (2, 30), data, progress=False)
    assert store.index["done"] and len(store.index["shards"]) >= 2
    loaded = store.load((2, 30))
    first = loaded["tokens"][: int(loaded["offsets"][1])]
    out = default_target.engine.prefill(first, taps=(2, 30), logits_rows="none")
    assert torch.equal(out.hidden[30].to(torch.bfloat16), loaded["h30"][: len(first)])
    assert loaded["loss_mask"].any() and not loaded["loss_mask"].all()
    # Interrupted after the first shard: the rerun extracts only what is missing, identically.
    folder = features_dir(default_target, data)
    index = json.loads((folder / "index.json").read_text())
    kept, dropped = index["shards"][:1], index["shards"][1:]
    for shard in dropped:
        (folder / shard["file"]).unlink()
    index.update(shards=kept, done=False)
    (folder / "index.json").write_text(json.dumps(index))
    resumed = ensure_features(default_target, (2, 30), data, progress=False).load((2, 30))
    assert torch.equal(resumed["tokens"], loaded["tokens"]) and torch.equal(resumed["h2"], loaded["h2"])
    # A new tap is added to every shard; the old ones stay as they were.
    extended = ensure_features(default_target, (15,), data, progress=False)
    assert extended.taps == (2, 15, 30)
    both = extended.load((2, 15))
    assert torch.equal(both["h2"], loaded["h2"]) and both["h15"].shape == loaded["h2"].shape
    with pytest.raises(BenchError, match="lacks tap 9"):
        extended.load((9,))


def test_other_target_weights_are_refused(default_target, cache):
    data = FeatureData(max_tokens=300, max_len=128)
    folder = features_dir(default_target, data)
    ensure_features(default_target, (30,), data, progress=False)
    index = json.loads((folder / "index.json").read_text())
    index["target_fingerprint"] = "feedfacefeedface"
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(BenchError, match="other target weights"):
        ensure_features(default_target, (30,), data, progress=False)
    (folder / "index.json").write_text("{broken")
    with pytest.raises(BenchError, match="unreadable"):
        FeatureStore(folder)


def test_self_distilled_replies_come_from_the_target(default_target, cache, one_thread):
    data = FeatureData(max_tokens=200, max_len=160, self_distill=True, reply_tokens=6)
    store = ensure_features(default_target, (30,), data, progress=False)
    loaded = store.load((30,))
    tokens, mask = loaded["tokens"], loaded["loss_mask"]
    end = int(loaded["offsets"][1])
    reply_start = int(mask[:end].nonzero()[0]) + 1  # first predicted reply token
    prompt, reply = tokens[:reply_start].tolist(), tokens[reply_start:end].tolist()
    logits = default_target.engine.prefill(torch.tensor(prompt)).logits[-1]
    assert reply[0] == int(logits.argmax())  # greedy answer of the target itself
    assert 1 <= len(reply) <= 6
