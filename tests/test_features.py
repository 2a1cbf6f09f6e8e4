"""The shared feature cache: extraction, resume after interruption, adding taps, refusal
of another target's cache, and self-distilled data."""

import json

import pytest
import torch

from bench.core.errors import BenchError
from bench.training import features as features_module
from bench.training.features import FeatureData, FeatureStore, describe_cache, ensure_features, features_dir


@pytest.fixture
def cache(default_target, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(features_module, "SHARD_SEQUENCES", 2)
    return tmp_path


@pytest.mark.slow  # the slow tier (make test-slow)
def test_features_equal_a_fresh_forward_and_resume(default_target, cache, one_thread, monkeypatch):
    data = FeatureData(max_tokens=1200, max_len=256)
    store = ensure_features(default_target, (2, 30), data, progress=False)
    assert store.index["done"] and len(store.index["shards"]) >= 2
    # each shard keeps its extraction time, and the cache's description gives the rate
    assert all(shard["seconds"] >= shard["pass_seconds"] > 0 for shard in store.index["shards"])
    assert "tok/s" in describe_cache(store) and "s writing" in describe_cache(store)
    loaded = store.load((2, 30))
    first = loaded["tokens"][: int(loaded["offsets"][1])]
    out = default_target.engine.prefill(first, taps=(2, 30), logits_rows="none")
    assert torch.equal(out.hidden[30].to(torch.bfloat16), loaded["h30"][: len(first)])
    assert loaded["loss_mask"].any() and not loaded["loss_mask"].all()
    # The extracting engine's dtype is part of the key: a bf16 target gets its own cache.
    assert store.index["data"]["dtype"] == "float32"
    assert FeatureData(max_tokens=1200, max_len=256, dtype="bfloat16").key() != FeatureData(**store.index["data"]).key()
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


@pytest.mark.slow  # the slow tier (make test-slow)
def test_an_interruption_between_syncs_redoes_only_the_shards_not_yet_made_durable(
        default_target, cache, one_thread, monkeypatch):
    """Shards are fsync'd and listed in the index in groups (SYNC_EVERY_S): killed mid-group,
    the index names only the durable shards, the rows appended after them are cut off, and the
    rerun extracts the rest to the same bits."""
    data = FeatureData(max_tokens=2500, max_len=256)
    whole = ensure_features(default_target, (30,), data, progress=False)
    expected = {k: v.clone() for k, v in whole.load((30,)).items()}
    assert len(whole.index["shards"]) >= 4
    for path in whole.folder.iterdir():
        path.unlink()
    real, calls = features_module._extract_shard, []

    def dies_on_the_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    clock = iter(range(0, 10**6, 20))  # each shard "takes" 20 s: a sync after every second shard
    monkeypatch.setattr(features_module.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(features_module, "_extract_shard", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        ensure_features(default_target, (30,), data, progress=False)
    index = json.loads((whole.folder / "index.json").read_text())
    assert len(index["shards"]) == 2 and not index["done"]  # the third shard's rows were written, not listed
    listed_bytes = 2 * 576 * sum(s["tokens"] for s in index["shards"])
    assert features_module.tap_file(whole.folder, 30).stat().st_size > listed_bytes
    monkeypatch.setattr(features_module, "_extract_shard", real)
    resumed = ensure_features(default_target, (30,), data, progress=False).load((30,))
    assert torch.equal(resumed["tokens"], expected["tokens"]) and torch.equal(resumed["h30"], expected["h30"])


def test_features_wait_for_the_disk_unless_told_not_to(default_target, cache, one_thread, monkeypatch):
    """The tap files are fsync'd before the index counts their rows; BENCH_FEATURES_SYNC=0 (a
    lent machine that goes with its lease) skips that and extracts the same cache."""
    synced = []
    monkeypatch.delenv("BENCH_FEATURES_SYNC", raising=False)
    monkeypatch.setattr(features_module.os, "fsync", lambda fd: synced.append(fd))
    data = FeatureData(max_tokens=600, max_len=128)
    ensure_features(default_target, (30,), data, progress=False)
    assert synced
    first = ensure_features(default_target, (30,), data, progress=False).load((30,))["h30"].clone()
    for path in features_dir(default_target, data).iterdir():
        path.unlink()
    synced.clear()
    monkeypatch.setenv("BENCH_FEATURES_SYNC", "0")
    again = ensure_features(default_target, (30,), data, progress=False).load((30,))["h30"]
    assert not synced and torch.equal(again, first)


def test_dropped_taps_free_the_disk_and_come_back_on_demand(default_target, cache, one_thread):
    """`bench features --drop-tap`: the layer's file is deleted; a run asking for it again
    re-extracts it with the same bits; bad input is one line, exit 2."""
    from click.testing import CliRunner

    from bench.cli import main

    data = FeatureData(max_tokens=300, max_len=128)
    store = ensure_features(default_target, (2, 30), data, progress=False)
    before = store.load((2,))["h2"].clone()
    listed = CliRunner().invoke(main, ["features"])
    assert listed.exit_code == 0 and "taps [2, 30]" in listed.output and "GiB" in listed.output
    dropped = CliRunner().invoke(main, ["features", "--drop-tap", "2"])
    assert dropped.exit_code == 0, dropped.output
    assert "taps [30]" in dropped.output and not features_module.tap_file(store.folder, 2).exists()
    again = ensure_features(default_target, (2,), data, progress=False)
    assert again.taps == (2, 30) and torch.equal(again.load((2,))["h2"], before)
    refused = CliRunner().invoke(main, ["features", "--drop-tap", "7"])
    assert refused.exit_code == 2 and "has no tap 7" in refused.output and refused.output.count("\n") == 1
    bad = CliRunner().invoke(main, ["features", "--extract", "2,x", "--tokens", "300"])
    assert bad.exit_code == 2 and "takes tap numbers" in bad.output and bad.output.count("\n") == 1


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


def test_self_distilled_features_read_the_distilled_replies(default_target, cache, one_thread, tmp_path):
    """Features of `bench distill` data: reply tokens (every turn) are the targets, the
    prompts are not; an exhausted cache grows when more distilled shards arrive, and a run
    begun before keeps the pool it began on (its run folder's pool.json) until it ends."""
    from bench.training.distill import DistillSettings, distill

    conversations = [["Say hi.", "Now say bye."], ["What is 2+2?"], ["Name a color."]]
    entries = [{"id": str(i), "conversations": [m for text in turns for m in
                                                ({"from": "human", "value": text}, {"from": "gpt", "value": "x"})]}
               for i, turns in enumerate(conversations)]
    (tmp_path / "sg.json").write_text(json.dumps(entries))
    settings = DistillSettings(max_reply=24, max_context=300, shard_conversations=2, dtype="float32",
                               data_path=str(tmp_path / "sg.json"))
    with pytest.raises(BenchError, match="no self-distilled data"):
        ensure_features(default_target, (30,), FeatureData(self_distill=True), progress=False)
    with pytest.raises(BenchError, match="unreadable distilled data"):
        ensure_features(default_target, (30,), FeatureData(self_distill=True, distilled=str(tmp_path)),
                        progress=False)
    distilled = distill(default_target, settings, {}, shards=range(1), progress=False)
    data = FeatureData(max_tokens=10_000, max_len=256, self_distill=True)  # finds the target's distilled data
    run = tmp_path / "run"
    store = ensure_features(default_target, (30,), data, progress=False, run_dir=run)
    assert store.index["exhausted"] and store.index["data"]["distilled"] == str(distilled.folder)
    assert json.loads((run / "pool.json").read_text())["tokens"] == store.num_tokens
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "state.json").write_text("{}")  # the run has begun: a resume reads its pool
    rows = list(distilled.rows())
    loaded = store.load((30,))
    assert int(loaded["offsets"][-1]) == sum(len(r["tokens"]) for r in rows)
    first = rows[0]
    mask = loaded["loss_mask"][: len(first["tokens"])]
    predicted = {i + 1 for i in mask.nonzero().flatten().tolist()}
    assert predicted == {i for start, end in first["reply_spans"] for i in range(start, end)}
    distill(default_target, settings, {}, progress=False)  # the second shard arrives
    index = json.loads((store.folder / "index.json").read_text())
    del index["distilled_read"]  # a cache from before positions were kept: resumes by conversation count
    (store.folder / "index.json").write_text(json.dumps(index))
    resumed = ensure_features(default_target, (30,), data, progress=False, run_dir=run)
    assert resumed.num_tokens == store.num_tokens  # the run reads its pool, and grows no shard it would not read
    assert json.loads((store.folder / "index.json").read_text()) == index
    grown = ensure_features(default_target, (30,), data, progress=False)
    assert grown.index["distilled_read"] == {"0": 2, "1": 1}
    assert grown.num_tokens == sum(len(r["tokens"]) for r in distill(default_target, settings, {}).rows())
    resumed = ensure_features(default_target, (30,), data, progress=False, run_dir=run)
    assert resumed.num_tokens == store.num_tokens < grown.num_tokens
    assert resumed.load((30,))["h30"].shape == loaded["h30"].shape
    fresh = ensure_features(default_target, (30,), data, progress=False, run_dir=tmp_path / "fresh")
    assert fresh.num_tokens == grown.num_tokens  # a run begun now takes the grown pool
    pool = json.loads((run / "pool.json").read_text())
    (run / "pool.json").write_text(json.dumps(pool | {"tokens": grown.num_tokens + 1}))
    with pytest.raises(BenchError, match="began on .* tokens of feature cache"):
        ensure_features(default_target, (30,), data, progress=False, run_dir=run)
    (run / "pool.json").write_text(json.dumps(pool | {"cache": "sharegpt-len512-00000000"}))
    with pytest.raises(BenchError, match="began on feature cache sharegpt-len512-00000000"):
        ensure_features(default_target, (30,), data, progress=False, run_dir=run)


def test_distilled_shards_finishing_out_of_order_are_each_read_once(default_target, cache, one_thread, tmp_path):
    """Distillation runs shard ranges in parallel, so a shard before the ones a cache read can
    finish later: the cache keeps the distilled rows it read per shard and grows by the rest,
    never reading a conversation twice or skipping one (counting conversations would)."""
    from bench.training.distill import DistillSettings, distill

    entries = [{"id": str(i), "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "x"}]}
               for i, text in enumerate(["Say hi.", "What is 2+2?", "Name a color."])]
    (tmp_path / "sg.json").write_text(json.dumps(entries))
    settings = DistillSettings(max_reply=16, max_context=300, shard_conversations=1, dtype="float32",
                               data_path=str(tmp_path / "sg.json"))
    distill(default_target, settings, {}, shards=range(1, 2), progress=False)
    data = FeatureData(max_tokens=10_000, max_len=256, self_distill=True)
    first = ensure_features(default_target, (30,), data, progress=False)
    assert first.index["distilled_read"] == {"1": 1}
    distilled = distill(default_target, settings, {}, progress=False)  # shards 0 and 2 arrive
    by_shard = {shard: row["tokens"] for shard, _, row in distilled.rows_after({})}
    grown = ensure_features(default_target, (30,), data, progress=False)
    expected = by_shard[1] + by_shard[0] + by_shard[2]
    assert grown.load((30,))["tokens"].tolist() == expected
    assert grown.index["distilled_read"] == {"0": 1, "1": 1, "2": 1}


def test_states_are_mapped_from_tap_files_and_old_caches_convert(default_target, cache, one_thread):
    """States live in one flat file per tap, mapped (not read) at load; an interrupted
    shard's partial rows are cut back on resume; a cache with the states inside its shards
    (the layout before) converts once and loads the same numbers."""
    from safetensors import safe_open

    data = FeatureData(max_tokens=900, max_len=256)
    store = ensure_features(default_target, (2, 30), data, progress=False)
    folder = store.folder
    loaded = store.load((2, 30))
    n, d = loaded["h30"].shape
    assert (folder / "h30.bf16").stat().st_size == n * d * 2
    with safe_open(str(store.shard_paths()[0]), "pt") as handle:
        assert set(handle.keys()) == {"tokens", "loss_mask", "offsets"}
    # A shard interrupted after its rows were appended: they are cut back, then redone.
    with open(folder / "h2.bf16", "ab") as handle:
        handle.write(b"\0" * (d * 2 * 7))
    again = ensure_features(default_target, (2, 30), data, progress=False).load((2, 30))
    assert torch.equal(again["h2"], loaded["h2"])
    # The old layout: states inside the shards, no tap files.
    index = json.loads((folder / "index.json").read_text())
    from bench.training.features import _save_shard

    offset = 0
    for shard in index["shards"]:
        path = folder / shard["file"]
        with safe_open(str(path), "pt") as handle:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        rows = slice(offset, offset + shard["tokens"])
        tensors.update(h2=loaded["h2"][rows].clone(), h30=loaded["h30"][rows].clone())
        _save_shard(path, tensors)
        offset += shard["tokens"]
    for tap in (2, 30):
        (folder / f"h{tap}.bf16").unlink()
    del index["flat"], index["hidden_size"]
    (folder / "index.json").write_text(json.dumps(index))
    converted = ensure_features(default_target, (2, 30), data, progress=False)
    assert converted.index["flat"]
    assert torch.equal(converted.load((2, 30))["h30"], loaded["h30"])


def test_runs_of_any_size_share_one_growing_cache(default_target, cache, one_thread):
    """max_tokens is not part of the key: a larger run grows the smaller run's cache in the
    same order, a smaller run reads only the first shards, and neither extracts again."""
    small, large = FeatureData(max_tokens=500, max_len=128), FeatureData(max_tokens=1100, max_len=128)
    assert features_dir(default_target, small) == features_dir(default_target, large)
    first = ensure_features(default_target, (30,), small, progress=False)
    first_tokens, first_h = first.load((30,))["tokens"].clone(), first.load((30,))["h30"].clone()
    grown = ensure_features(default_target, (30,), large, progress=False)
    assert grown.num_tokens > first.num_tokens and grown.index["done"]
    assert torch.equal(grown.load((30,))["tokens"][: len(first_tokens)], first_tokens)
    assert torch.equal(grown.load((30,))["h30"][: len(first_tokens)], first_h)
    shards = len(grown.index["shards"])
    again = ensure_features(default_target, (30,), small, progress=False)
    assert len(again.index["shards"]) == shards and again.index["done"]  # nothing extracted
    assert torch.equal(again.load((30,))["tokens"], first_tokens)
    # A growth interrupted by a smaller run stays unfinished until the larger run comes back.
    index = json.loads((grown.folder / "index.json").read_text())
    index.update(shards=index["shards"][:-1], done=False)
    (grown.folder / "index.json").write_text(json.dumps(index))
    assert not ensure_features(default_target, (30,), small, progress=False).index["done"]
    assert ensure_features(default_target, (30,), large, progress=False).num_tokens == grown.num_tokens
