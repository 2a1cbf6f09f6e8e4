"""Hardware profile and the random-weight engines the GPU check times."""

import statistics

import pytest
import torch

from bench.core.costs import SHAPES, chain_costs, format_profile, random_engine, random_tree_mask, verify_latency


def test_random_tree_mask_is_ancestor_closed():
    mask, depth = random_tree_mask(6, 2, torch.device("cpu"))
    assert mask.shape == (7, 7) and depth.tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert mask.diagonal().all() and mask[:, 0].all()  # everyone sees itself and the root
    assert mask[3].tolist() == [True, True, False, True, False, False, False]  # node 3: child of node 1
    assert not mask.triu(1).any()  # parents come first


def test_verify_latency_rows_and_cache_rollback(one_thread):
    engine = random_engine("smollm2-135m", "cpu", torch.float32)
    assert engine.vocab_size == SHAPES["smollm2-135m"]["vocab_size"] and engine.num_layers == 30
    profile = verify_latency(engine, ks=(1, 4), context=16, repeats=2, warmup=1, tree_sizes=(7,))
    assert [(r["kind"], r["k"]) for r in profile["rows"]] == [("chain", 1), ("chain", 4), ("tree", 7)]
    assert profile["rows"][0]["ratio_to_k1"] == 1.0
    assert all(r["median_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in profile["rows"])
    assert engine.length == 16  # every timed pass was rolled back to the context
    assert "t(k)/t(1)" in format_profile(profile)
    # The memory-bound limit: the step's weights (30 layers + lm_head, fp32) over a bandwidth measured here.
    bound = profile["memory_bound"]
    layer = 4 * (576 * 960 + 576 * 576 + 2 * 576 * 1536 + 576 * 1536 + 2 * 576)
    assert bound["weight_bytes"] == 30 * layer + 4 * 576 + 4 * 49152 * 576
    assert bound["limit_s"] == pytest.approx(bound["weight_bytes"] / bound["read_bytes_per_s"])
    # Each round timed a one-token pass and a read beside it: the multiple is the median of the
    # rounds' step over that round's limit, and the rounds are kept.
    rounds = bound["rounds"]
    assert len(rounds) == 2
    assert statistics.median(step for step, _ in rounds) == pytest.approx(profile["rows"][0]["median_s"])
    read_bytes = 512 * 2**20
    paired = [step / (bound["weight_bytes"] * read / read_bytes) for step, read in rounds]
    assert bound["step_over_limit"] == pytest.approx(statistics.median(paired))
    assert bound["step_over_limit_range"] == pytest.approx([min(paired), max(paired)])
    assert bound["read_bytes_per_s"] == pytest.approx(read_bytes / statistics.median(r for _, r in rounds))
    assert "memory-bound one-token step" in format_profile(profile)
    # The compute-bound floor of a 16-row pass: 2 FLOPs per row and linear weight at the measured matmul rate.
    compute = profile["compute_bound"]
    params = 30 * (576 * 960 + 576 * 576 + 2 * 576 * 1536 + 576 * 1536) + 49152 * 576
    assert compute["k"] == 16 and compute["matmul_flops_per_s"] > 0
    assert compute["floor_s"] == pytest.approx(2 * 16 * params / compute["matmul_flops_per_s"])
    assert compute["least_ratio_to_k1"] == pytest.approx(compute["floor_s"] / profile["rows"][0]["median_s"])
    assert "compute-bound 16-token pass" in format_profile(profile)


@pytest.mark.slow  # the slow tier (make test-slow)
def test_bench_profile_stores_a_record(tmp_path, one_thread, monkeypatch):
    import json

    from click.testing import CliRunner

    from bench.cli import main

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))  # the copy methods read: never the user's cache
    result = CliRunner().invoke(main, ["profile", "--drafters", "pld,nosuch_x", "--results-dir", str(tmp_path)])
    assert result.exit_code == 2 and "unknown method 'nosuch_x'" in result.output
    result = CliRunner().invoke(main, ["profile", "--device", "cpu", "--dtype", "float32", "--ks", "1,3", "--trees",
                                       "5", "--repeats", "2", "--context", "16", "--drafters", "pld",
                                       "--results-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    from bench.core.provenance import cpu_isa, machine_key

    # one file per machine and thread count; the copy methods read, per thread count too
    kept = tmp_path / "smollm2-135m" / "profile" / f"cpu-float32-{machine_key('cpu')}-t1.json"
    record = json.loads(kept.read_text())
    assert json.loads((tmp_path / "cache" / "profiles" / "smollm2-135m" / "cpu-float32-t1.json").read_text()) == record
    assert record["provenance"]["cpu_isa"] == cpu_isa() and machine_key("cpu").endswith(cpu_isa().replace("_", "-"))
    assert [r["k"] for r in record["rows"]] == [1, 3, 5] and record["provenance"]["git_sha"]
    assert record["fingerprint"] and record["context"] == 16 and record["hf_generate"]["step_s"] > 0
    assert "transformers.generate" in result.output
    [pld] = record["drafters"]
    assert pld["method"] == "pld" and pld["rounds"] > 0 and pld["verify_ms_per_round"] > 0
    bad = CliRunner().invoke(main, ["profile", "--ks", "1,x"])
    assert bad.exit_code == 2 and "comma-separated" in bad.output


def test_chain_costs_interpolate_between_measured_lengths():
    profile = {"rows": [{"kind": "chain", "k": 1, "median_s": 1.0}, {"kind": "chain", "k": 5, "median_s": 3.0},
                        {"kind": "tree", "k": 3, "median_s": 9.0}]}
    assert chain_costs(profile, 7) == [1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0, 3.0]


def test_best_size_trades_expected_tokens_against_verification_cost():
    from bench.core.costs import best_size

    gains = [0.0, 0.6, 0.9, 1.0, 1.05]
    flat = [1.0] * 6  # free verification: the biggest tree wins
    assert best_size(gains, flat) == 4
    steep = [1.0, 1.0, 1.2, 1.5, 2.0, 2.5]  # rates: 1/1 1.6/1.2 1.9/1.5 2.0/2.0 2.05/2.5 -> n = 1
    assert best_size(gains, steep) == 1
    assert best_size([0.0, 0.01], [1.0, 1.0, 2.0]) == 0  # a draft that costs more than it brings: none


def test_stored_chain_costs_only_from_this_machine(tmp_path, monkeypatch):
    """Medusa sizes its tree from the stored profile when it was measured here (same weights,
    dtype, device name, torch threads), so the size does not move with timing noise."""
    import json
    from types import SimpleNamespace

    import pytest
    import torch

    from bench.core.costs import profile_path, stored_chain_costs
    from bench.core.provenance import device_name

    target = SimpleNamespace(name="tiny", fingerprint="f1",
                             engine=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))
    rows = [{"kind": "chain", "k": 1, "median_s": 0.01}, {"kind": "chain", "k": 4, "median_s": 0.04}]
    provenance = {"device_name": device_name("cpu"), "torch_threads": torch.get_num_threads()}
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    path = profile_path("tiny", "cpu", "float32")  # where `bench profile` stores it; never read from results/
    assert path.name == f"cpu-float32-t{torch.get_num_threads()}.json"  # 1 and 2 threads are profiles of their own
    path.parent.mkdir(parents=True)

    def stored(**changes) -> list[float] | None:
        profile = {"fingerprint": "f1", "dtype": "float32", "rows": rows, "provenance": provenance}
        path.write_text(json.dumps({**profile, **changes}))
        return stored_chain_costs(target, 4)

    assert stored() == pytest.approx([0.01, 0.01, 0.02, 0.03, 0.04])
    assert stored(fingerprint="other weights") is None
    assert stored(provenance={**provenance, "torch_threads": torch.get_num_threads() + 1}) is None
    assert stored(provenance={**provenance, "device_name": "another cpu"}) is None
    path.write_text("{not json")
    assert stored_chain_costs(target, 4) is None
    path.rename(tmp_path / "elsewhere.json")
    assert stored_chain_costs(target, 4) is None
    (tmp_path / "elsewhere.json").write_text(json.dumps({"fingerprint": "f1", "dtype": "float32", "rows": rows,
                                                         "provenance": provenance}))
    assert stored_chain_costs(target, 4, tmp_path / "elsewhere.json") == pytest.approx([0.01, 0.01, 0.02, 0.03, 0.04])


def test_a_fresh_machine_reads_its_kept_profile_not_seconds_of_timing(tmp_path, monkeypatch):
    """A cache without a profile (a fresh machine of a kind profiled before) gets this machine's
    record from results/ at a run's or a tuning's start, so Medusa's auto tree is the same size
    in every cell of a grid; an existing cache copy, or another machine's record, is left alone."""
    import json
    from types import SimpleNamespace

    import pytest
    import torch

    from bench.core.costs import profile_path, stored_chain_costs
    from bench.core.provenance import device_name
    from bench.profile import kept_profile_path, seed_profile_cache

    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    target = SimpleNamespace(name="tiny", fingerprint="f1",
                             engine=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))
    results = tmp_path / "results"
    assert seed_profile_cache(results, target) is None  # nothing kept for this machine: methods time it
    kept = kept_profile_path(results, target)
    assert kept.parent == results / "tiny" / "profile" and kept.name.endswith(f"-t{torch.get_num_threads()}.json")
    rows = [{"kind": "chain", "k": 1, "median_s": 0.01}, {"kind": "chain", "k": 4, "median_s": 0.04}]
    provenance = {"device_name": device_name("cpu"), "torch_threads": torch.get_num_threads()}
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"fingerprint": "f1", "dtype": "float32", "rows": rows, "provenance": provenance}))
    (kept.parent / "cpu-float32-another-machine-t2.json").write_text("{}")
    assert stored_chain_costs(target, 4) is None
    assert seed_profile_cache(results, target) == profile_path("tiny", "cpu", "float32")
    assert stored_chain_costs(target, 4) == pytest.approx([0.01, 0.01, 0.02, 0.03, 0.04])
    kept.write_text("{}")  # the cache's copy is this machine's own from then on
    assert seed_profile_cache(results, target) is None and stored_chain_costs(target, 4) is not None


def test_hf_generate_step_is_timed_on_the_same_weights_and_reported(default_target, one_thread):
    from bench.core.costs import hf_generate_step

    hf = hf_generate_step(default_target, context=16, new_tokens=4, repeats=1)
    assert hf["step_s"] > 0 and hf["new_tokens"] == 4
    profile = verify_latency(default_target.engine, ks=(1,), context=16, repeats=2, warmup=1)
    profile["hf_generate"] = hf
    ratio = hf["step_s"] / profile["rows"][0]["median_s"]
    assert f"{ratio:.2f}x faster" in format_profile(profile)
