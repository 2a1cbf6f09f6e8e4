"""Record files: append, resume, crash recovery, refusal of mismatched settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.core.errors import BenchError
from bench.records import RunFile, read_records, records_path
from tasks import task_name

SETTINGS = {"method": "ar", "task": "tiny", "max_new_tokens": 12, "seed": 0,
            "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0}}


def turn(question_id: str, number: int, tokens: list[int]) -> dict:
    """A turn record as the schema wants it (bench.records.TURN_SCHEMA)."""
    return {"question_id": question_id, "turn": number, "prompt_hash": f"h{question_id}{number}", "tokens": tokens,
            "text": f"reply {question_id}/{number}", "ttft": 0.1, "decode_time": 0.2, "draft_time": 0.0,
            "verify_time": 0.2, "proposed_lengths": [], "accept_lengths": [], "tree_sizes": []}


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def path(tmp_path):
    return records_path(tmp_path / "results", "smollm2-135m", "tiny", "ar")


def test_records_path(tmp_path):
    assert records_path(tmp_path, "t", "mtbench", "eagle") == tmp_path / "t" / "mtbench" / "eagle.jsonl"
    assert records_path(tmp_path, "t", "mtbench", "eagle", "k4") == tmp_path / "t" / "mtbench" / "eagle-k4.jsonl"


def test_header_then_turns(path):
    records = RunFile(path, SETTINGS, "cpu")
    records.add_turn(turn("q1", 1, [1, 2]))
    header, first = lines(path)
    assert header["type"] == "header" and header["settings"] == SETTINGS
    provenance = header["provenance"]
    assert provenance["git_sha"] and "torch" in provenance["packages"]
    assert provenance["device"] == "cpu" and provenance["device_name"]
    assert first == {"type": "turn", "method": "ar", **turn("q1", 1, [1, 2])}  # a line says whose it is


def test_resume_reads_back_finished_turns(path):
    records = RunFile(path, SETTINGS, "cpu")
    records.add_turn(turn("q1", 1, [1, 2]))
    records.add_turn(turn("q1", 2, [3]))
    resumed = RunFile(path, SETTINGS, "cpu")
    assert resumed.done("q1", 1)["tokens"] == [1, 2]
    assert resumed.done("q1", 2)["text"] == "reply q1/2"
    assert resumed.done("q2", 1) is None
    resumed.add_turn(turn("q2", 1, [4]))
    headers, turns = read_records(path)
    assert len(headers) == 2  # every invocation leaves its provenance
    assert [(t["question_id"], t["turn"]) for t in turns] == [("q1", 1), ("q1", 2), ("q2", 1)]


def test_settings_as_json_sees_them(path):
    """Tuples read back as lists; the same settings must still match on resume."""
    settings = {**SETTINGS, "categories": ("math",)}
    RunFile(path, settings, "cpu")
    RunFile(path, settings, "cpu")


def test_half_written_last_line_is_dropped(path, capsys):
    RunFile(path, SETTINGS, "cpu").add_turn(turn("q1", 1, [1, 2]))
    with open(path, "a") as handle:  # a crash in the middle of writing the next turn
        handle.write(json.dumps({"type": "turn", **turn("q1", 2, [3])})[:25])
    resumed = RunFile(path, SETTINGS, "cpu")
    assert resumed.done("q1", 1) is not None and resumed.done("q1", 2) is None
    resumed.add_turn(turn("q1", 2, [3]))  # taking the file for writing cuts the crash's fragment off
    assert "dropping an unfinished last record" in capsys.readouterr().err
    headers, turns = read_records(path)
    assert len(headers) == 2 and [t["turn"] for t in turns] == [1, 2]
    assert RunFile(path, SETTINGS, "cpu").done("q1", 2)["tokens"] == [3]


def test_corrupt_middle_line_is_left_out_and_reported(path, capsys):
    """One rule for every reader: that line only is left out (and named); resume redoes it."""
    records = RunFile(path, SETTINGS, "cpu")
    records.add_turn(turn("q1", 1, [1]))
    records.add_turn(turn("q1", 2, [2]))
    text = path.read_text().splitlines()
    text[1] = text[1][:-3]
    path.write_text("\n".join(text) + "\n")
    resumed = RunFile(path, SETTINGS, "cpu")
    assert "corrupt" in capsys.readouterr().err
    assert resumed.done("q1", 1) is None and resumed.done("q1", 2)["tokens"] == [2]
    assert [(p.kind, p.where.rsplit("/", 1)[-1]) for p in resumed.problems] == [("corrupt", "ar.jsonl:2")]
    assert "malformed JSON" in resumed.problems[0].detail
    resumed.add_turn(turn("q1", 1, [1]))
    headers, turns = read_records(path)
    assert len(headers) == 2 and sorted(t["turn"] for t in turns) == [1, 2]


def test_header_goes_in_with_the_first_turn(path):
    """Taking the file writes nothing: a run stopped before its first turn leaves no header."""
    records = RunFile(path, SETTINGS, "cpu")
    records.claim()
    assert not path.exists()
    records.add_turn(turn("q1", 1, [1]))
    records.add_turn(turn("q1", 2, [2]))
    assert [json.loads(line)["type"] for line in path.read_text().splitlines()] == ["header", "turn", "turn"]


def test_settings_mismatch_suggests_tag(path):
    RunFile(path, SETTINGS, "cpu").add_turn(turn("q1", 1, [1]))
    before = path.read_bytes()
    with pytest.raises(BenchError, match=r"other settings \(max_new_tokens, seed\); use --tag"):
        RunFile(path, {**SETTINGS, "max_new_tokens": 64, "seed": 1}, "cpu")
    assert path.read_bytes() == before  # nothing appended to a file we refused


def test_unwritable_results_dir(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("a file where a folder should be")
    with pytest.raises(BenchError, match="cannot write results to"):
        RunFile(records_path(blocker, "t", "tiny", "ar"), SETTINGS, "cpu")


def test_read_records_skips_record_in_flight(path):
    RunFile(path, SETTINGS, "cpu").add_turn(turn("q1", 1, [1]))
    with open(path, "a") as handle:
        handle.write('{"type": "turn", "quest')
    headers, turns = read_records(path)
    assert len(headers) == 1 and len(turns) == 1


def test_read_records_missing_file(tmp_path):
    with pytest.raises(BenchError, match="cannot read records"):
        read_records(tmp_path / "none.jsonl")


# --- end to end on the real default target ------------------------------------------------

TURN_FIELDS = {"type", "question_id", "category", "turn", "prompt_len", "prompt_hash", "tokens", "text",
               "stop_reason", "ttft", "decode_time", "draft_time", "verify_time", "rounds", "proposed_lengths",
               "accept_lengths", "tree_sizes", "utilization", "exact_match"}


def test_run_writes_records_and_resumes(tiny_task, tmp_path):
    from bench.run import RunSettings, run

    settings = RunSettings(method="ar", task=str(tiny_task), max_new_tokens=12, device="cpu",
                           results_dir=str(tmp_path / "results"))
    summary = run(settings)
    path = Path(summary["_paths"]["ar"])
    assert path == tmp_path / "results" / "smollm2-135m" / task_name(str(tiny_task)) / "ar.jsonl"
    assert summary["ar"]["turns"] == 3 and list(summary) == ["ar", "_paths"]  # method 'ar': no baseline

    headers, turns = read_records(path)
    (header,) = headers
    assert header["settings"]["method"] == "ar" and header["settings"]["task"] == task_name(str(tiny_task))
    assert header["settings"]["seed"] == 0 and header["settings"]["max_new_tokens"] == 12
    assert header["settings"]["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    provenance = header["provenance"]
    assert provenance["git_sha"] != "" and {"torch", "transformers"} <= set(provenance["packages"])
    assert provenance["device"] == "cpu" and provenance["device_name"]

    assert [(t["question_id"], t["category"], t["turn"]) for t in turns] == [
        ("q1", "chat", 1), ("q1", "chat", 2), ("q2", "math", 1)]
    for record in turns:
        assert set(record) >= TURN_FIELDS
        assert 1 <= len(record["tokens"]) <= 12 and all(isinstance(i, int) for i in record["tokens"])
        assert isinstance(record["text"], str) and record["prompt_len"] > 0
        assert all(record[k] >= 0 for k in ("ttft", "decode_time", "draft_time", "verify_time"))
        # AR: one target step per token after the prefill's, and nothing drafted
        assert record["rounds"] == len(record["tokens"]) - 1 == len(record["accept_lengths"])
        assert len(record["proposed_lengths"]) == record["rounds"] and not any(record["accept_lengths"])
        assert record["utilization"]["kind"] == "cpu"
        assert record["stop_reason"] in ("eos", "length")
    assert turns[1]["prompt_len"] > turns[0]["prompt_len"] + 3  # turn 2 sees the first exchange

    run(settings)  # everything recorded: nothing is decoded again, nothing written
    headers, again = read_records(path)
    assert len(headers) == 1 and again == turns

    # Lose the last two turns (one is a second turn, rebuilt on turn 1's recorded reply).
    text = path.read_text().splitlines(keepends=True)
    kept = [line for line in text if json.loads(line).get("turn") != 2 and json.loads(line).get("question_id") != "q2"]
    path.write_text("".join(kept))
    run(settings)
    _, regenerated = read_records(path)
    assert [(t["question_id"], t["turn"]) for t in regenerated] == [("q1", 1), ("q1", 2), ("q2", 1)]
    for new, old in zip(regenerated, turns, strict=True):
        assert (new["tokens"], new["text"], new["prompt_hash"]) == (old["tokens"], old["text"], old["prompt_hash"])


def test_run_repeats_are_whole_passes_paired_within_themselves(tiny_task, tmp_path):
    from bench import metrics
    from bench.run import RunSettings, run

    settings = RunSettings(method="pld", task=str(tiny_task), max_new_tokens=8, device="cpu", tag="x",
                           results_dir=str(tmp_path / "results"))
    summary = run(settings, repeats=2)
    folder = tmp_path / "results" / "smollm2-135m" / task_name(str(tiny_task))
    assert sorted(p.name for p in folder.glob("*.jsonl")) == ["ar-x.jsonl", "ar-x.rep2.jsonl", "pld-x.jsonl",
                                                              "pld-x.rep2.jsonl"]
    passes = {name: [read_records(folder / f"{name}-{tag}.jsonl")[1] for tag in ("x", "x.rep2")]
              for name in ("ar", "pld")}
    first, second = passes["pld"]
    assert [t["tokens"] for t in second] == [t["tokens"] for t in first]  # greedy: the same tokens again
    assert {t["repeat"] for t in first} == {1} and {t["repeat"] for t in second} == {2}
    assert all(t["exact_match"] for t in first + second)
    row = summary["pld"]
    assert row["turns"] == 6 and row["repeats"] == 2
    assert row["speedup_repeats"] == [metrics.speedup(first, passes["ar"][0]), metrics.speedup(second, passes["ar"][1])]
    both = [t for p in passes["pld"] for t in p], [t for p in passes["ar"] for t in p]
    assert row["speedup"] == pytest.approx(metrics._ratio_of_sums(*both))
    run(settings, repeats=2)  # both passes recorded: nothing is decoded again
    assert read_records(folder / "pld-x.rep2.jsonl")[1] == second


def test_a_method_run_after_its_baseline_was_recorded_re_times_it_beside_each_turn(tiny_task, tmp_path):
    """The tag's baseline is recorded with the first method; a second method run later under
    the same tag decodes each baseline turn again right before its own and keeps those
    timings (paired_baseline), which its speedup then uses; the baseline's file is unchanged."""
    from bench import metrics
    from bench.run import RunSettings, run

    settings = RunSettings(method="pld", task=str(tiny_task), max_new_tokens=8, device="cpu", tag="x",
                           results_dir=str(tmp_path / "results"))
    run(settings)
    folder = tmp_path / "results" / "smollm2-135m" / task_name(str(tiny_task))
    baseline = (folder / "ar-x.jsonl").read_bytes()
    assert not any("paired_baseline" in t for t in read_records(folder / "pld-x.jsonl")[1])  # interleaved already

    summary = run(RunSettings(**{**settings.__dict__, "method": "lookahead"}))
    assert (folder / "ar-x.jsonl").read_bytes() == baseline
    _, turns = read_records(folder / "lookahead-x.jsonl")
    _, base = read_records(folder / "ar-x.jsonl")
    assert len(turns) == 3 and all(t["exact_match"] for t in turns)
    for mine, theirs in zip(turns, base, strict=True):
        own = mine["paired_baseline"]
        assert own["same_tokens"] and own["tokens"] == theirs["tokens"]  # the same turn, decoded again
        assert own["ttft"] > 0 and own["decode_time"] > 0 and own["utilization"]["kind"] == "cpu"
    assert summary["lookahead"]["speedup"] == pytest.approx(metrics._ratio_of_sums(
        turns, [{**t["paired_baseline"], "question_id": t["question_id"]} for t in turns]))
    run(RunSettings(**{**settings.__dict__, "method": "lookahead"}))  # all recorded: nothing re-timed
    assert read_records(folder / "lookahead-x.jsonl")[1] == turns


def test_two_runs_never_write_one_file(path):
    """Reading is shared; writing takes the file's lock: a second writer gets a one-line error,
    and a writer that comes after another reads back its turns first."""
    import subprocess
    import sys
    import textwrap

    reader = RunFile(path, SETTINGS, "cpu")  # opened before the other run wrote anything
    script = textwrap.dedent(f"""
        import sys, time
        from bench.records import RunFile
        records = RunFile({str(path)!r}, {SETTINGS!r}, "cpu")
        records.add_turn({turn("q1", 1, [1, 2])!r})
        print("written", flush=True)
        sys.stdin.read()  # hold the lock until the test closes stdin
    """)
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "written"
        with pytest.raises(BenchError, match="being written by another run"):
            reader.add_turn(turn("q2", 1, [3]))
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert reader.done("q1", 1) is None  # not seen yet: read before the other run wrote it
    reader.claim()
    assert reader.done("q1", 1)["tokens"] == [1, 2]  # taking the file reads back what was written
    with pytest.raises(BenchError, match="already recorded"):
        reader.add_turn(turn("q1", 1, [9]))
    reader.add_turn(turn("q2", 1, [3]))
    assert [(t["question_id"], t["turn"]) for t in read_records(path)[1]] == [("q1", 1), ("q2", 1)]


# --- packed record files (bench pack) -----------------------------------------------------------


def test_a_packed_record_file_reads_as_before_and_resumes_unpacked(path):
    import gzip

    from bench.records import has_records, pack, packed_path, record_files

    records = RunFile(path, SETTINGS, "cpu")
    records.add_turn(turn("q1", 1, [1, 2]))
    plain = path.read_bytes()
    saved = pack(path)
    assert not path.exists() and gzip.decompress(packed_path(path).read_bytes()) == plain
    assert saved == len(plain) - packed_path(path).stat().st_size and pack(path) is None  # nothing left to pack
    assert has_records(path) and record_files(path.parent) == [path]  # found by its own name
    for name in (path, packed_path(path)):  # read as the record file it holds, by either name
        run = RunFile(name)
        assert run.path == path and run.method == "ar" and run.keys == {("q1", 1)} and not run.problems

    resumed = RunFile(path, SETTINGS, "cpu")  # a run that appends unpacks it first
    assert resumed.done("q1", 1)["tokens"] == [1, 2]
    resumed.add_turn(turn("q2", 1, [3]))
    assert not packed_path(path).exists() and path.read_bytes().startswith(plain)
    assert [(t["question_id"], t["turn"]) for t in read_records(path)[1]] == [("q1", 1), ("q2", 1)]


def test_packing_is_deterministic(path):
    from bench.records import pack, packed_path

    RunFile(path, SETTINGS, "cpu").add_turn(turn("q1", 1, [1, 2]))
    plain = path.read_bytes()
    pack(path)
    first = packed_path(path).read_bytes()
    packed_path(path).unlink()
    path.write_bytes(plain)
    pack(path)
    assert packed_path(path).read_bytes() == first  # a repack changes nothing git would see


def test_pack_refuses_unfinished_files_and_other_jsonl(path):
    from bench.records import pack

    RunFile(path, SETTINGS, "cpu").add_turn(turn("q1", 1, [1, 2]))
    with open(path, "ab") as handle:
        handle.write(b'{"type": "turn", "question_id"')
    with pytest.raises(BenchError, match="unfinished line"):
        pack(path)
    log = path.with_name("log.jsonl")
    log.write_text('{"step": 1}\n')
    with pytest.raises(BenchError, match="not a run record file"):
        pack(log)
    assert path.exists() and log.exists()  # both left as they were


def test_a_damaged_packed_file_is_reported_and_a_stale_copy_named(path):
    from bench.records import pack, packed_path

    RunFile(path, SETTINGS, "cpu").add_turn(turn("q1", 1, [1, 2]))
    plain = path.read_bytes()
    pack(path)
    packed = packed_path(path)
    packed.write_bytes(packed.read_bytes()[:-12])  # cut short
    run = RunFile(path)
    assert not run.turns and [p.kind for p in run.problems] == ["unreadable"]
    assert "not a whole gzip file" in run.problems[0].detail
    with pytest.raises(BenchError, match=r"cannot resume .*not a whole gzip file"):  # a run stops, loses nothing
        RunFile(path, SETTINGS, "cpu")
    path.write_bytes(plain)  # a plain file beside it is the one read
    run = RunFile(path)
    assert run.keys == {("q1", 1)} and [p.kind for p in run.problems] == ["packed copy"]


def test_reports_read_packed_records_as_plain_ones(tmp_path):
    from report_helpers import write_clean

    from bench.records import pack, record_files
    from bench.report.tables import load_records

    results = tmp_path / "results"
    write_clean(results)
    before = load_records(results)
    for file in record_files(results, "*/*/*"):
        pack(file)
    after = load_records(results)
    assert not list(results.glob("*/*/*.jsonl")) and len(list(results.glob("*/*/*.jsonl.gz"))) == 4
    assert [(r.path, r.turns, r.headers) for r in after.runs] == [(r.path, r.turns, r.headers) for r in before.runs]
    assert after.problems == before.problems


def test_a_drafters_heldout_note_is_not_part_of_a_runs_identity():
    """Records made before drafters carried their held-out prediction resume and keep their
    grid revision: the note is derived from the manifest that manifest_sha names."""
    from bench.records import identity_of

    old = {"method": "dflash", "drafter": {"drafter": "x", "manifest_sha": "abc"}}
    new = {"method": "dflash", "drafter": {"drafter": "x", "manifest_sha": "abc", "heldout": {"rounds_tau": 2.0}}}
    assert identity_of(old) == identity_of(new)
    assert identity_of(dict(new, drafter={**new["drafter"], "manifest_sha": "def"})) != identity_of(old)


def test_training_against_serving_flags_a_gap_over_ten_percent():
    from types import SimpleNamespace

    from bench.report.serving_gap import gap_table

    def run(method, predicted, accepts, temperature=0.0):
        turns = [{"accept_lengths": accepts, "proposed_lengths": [4] * len(accepts)}]
        drafter = {"drafter": "x", "heldout": {"rounds_tau_first_128": predicted}} if predicted else {"drafter": "x"}
        return SimpleNamespace(method=method, task="gsm8k", series="grid", pooled=turns,
                               settings={"drafter": drafter, "sampling": {"temperature": temperature}})

    frame = gap_table([run("dflash", 3.0, [1, 1, 1, 1]), run("eagle", 2.1, [1, 1, 1, 1]), run("pld", None, [1])])
    assert list(frame["method"]) == ["dflash", "eagle"]  # pld names no prediction
    assert list(frame["measured τ"]) == [2.0, 2.0]
    flagged = dict(zip(frame["method"], frame["flag"]))
    assert flagged["dflash"] and not flagged["eagle"]  # -33% flagged, -5% not


def test_pack_never_writes_over_a_packed_copy_it_did_not_grow_from(path):
    """X.jsonl (1 turn) beside X.jsonl.gz (2 turns): packing would lose a turn, so it is refused
    and both stay; a plain file grown from its packed copy (a resumed run) packs over it."""
    import gzip

    from bench.records import pack, packed_path

    records = RunFile(path, SETTINGS, "cpu")
    records.add_turn(turn("q1", 1, [1, 2]))
    records.add_turn(turn("q2", 1, [3]))
    pack(path)
    packed = packed_path(path).read_bytes()
    short = RunFile(path.with_name("other.jsonl"), SETTINGS, "cpu")
    short.add_turn(turn("q1", 1, [1, 2]))
    path.write_bytes(path.with_name("other.jsonl").read_bytes())
    with pytest.raises(BenchError, match="hold different lines"):
        pack(path)
    assert packed_path(path).read_bytes() == packed and path.exists()
    path.write_bytes(gzip.decompress(packed) + b"")  # the same lines: a resumed run before it appended
    grown = RunFile(path, SETTINGS, "cpu")
    grown.add_turn(turn("q3", 1, [4]))
    assert pack(path) is not None and not path.exists()
    assert [t["question_id"] for t in read_records(path)[1]] == ["q1", "q2", "q3"]


def test_a_turn_from_another_method_is_set_aside_and_decoded_again(path):
    """A line naming another method, or a drafting turn in AR's file, is never counted and
    never resumed past as done."""
    records = RunFile(path, SETTINGS, "cpu")
    records.add_turn(turn("q1", 1, [1, 2]))
    with open(path, "a") as handle:
        handle.write(json.dumps({"type": "turn", "method": "pld", **turn("q2", 1, [3])}) + "\n")
        drafted = {**turn("q3", 1, [4, 5]), "proposed_lengths": [3], "accept_lengths": [1]}
        handle.write(json.dumps({"type": "turn", **drafted}) + "\n")
    run = RunFile(path)
    assert run.keys == {("q1", 1)}
    assert sorted(p.detail.split(";")[0] for p in run.problems if p.kind == "foreign turn") == [
        "a pld turn in ar's file", "a turn that drafted tokens, in the AR baseline's file"]
    assert RunFile(path, SETTINGS, "cpu").done("q2", 1) is None


def test_exact_match_is_derived_from_the_token_ids_not_the_stored_flag():
    from bench import metrics

    base = [{**turn("q1", 1, [1, 2]), "repeat": 1}, {**turn("q2", 1, [3]), "repeat": 1}]
    ours = [{**turn("q1", 1, [1, 2]), "repeat": 1, "exact_match": True},
            {**turn("q2", 1, [9]), "repeat": 1, "exact_match": True}]  # tokens replaced, flag left true
    row = metrics.summarize(ours, base)
    assert row["match_rate"] == 0.5 and row["mismatches"] == 1 and row["flag_disagrees"] == 1


def test_a_method_is_paired_only_with_a_baseline_of_the_same_settings():
    from bench.records import pairing_difference

    method = dict(SETTINGS, method="pld", dtype="bfloat16")
    assert pairing_difference(method, dict(SETTINGS, dtype="bfloat16")) is None
    assert "max_new_tokens 16" in pairing_difference(dict(method, max_new_tokens=16), dict(SETTINGS, dtype="bfloat16"))
    assert "dtype" in pairing_difference(method, dict(SETTINGS, dtype="float32"))
    assert "batch_size" in pairing_difference(dict(method, batch_size=4), dict(SETTINGS, dtype="bfloat16"))


def test_the_grid_picks_a_matching_revision_and_never_reuses_a_retired_one(tmp_path):
    """A cell runs into the first kept revision recorded with its settings, else after the
    newest kept one; a revision whose files were retired (none kept) is skipped, since a cell
    run into it would sit below the newest revision the reports read."""
    from bench.grid import choose_tag
    from bench.records import records_path

    def settings(method, tokens):
        return {"method": method, "task": "t", "target": "m", "max_new_tokens": tokens, "sampling": {},
                "seed": 0, "device": "cpu", "dtype": "float32", "method_options": {}, "lossless": True}

    def keep(method, tag, tokens):
        path = records_path(tmp_path, "m", "t", method, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": "header", "settings": settings(method, tokens)}) + "\n")

    def pick(tokens):
        return choose_tag(tmp_path, "m", "t", "pld", "grid", settings("pld", tokens), settings("ar", tokens))

    assert pick(8) == "grid"  # nothing kept yet
    keep("pld", "grid", 8), keep("ar", "grid", 8)
    assert pick(8) == "grid" and pick(16) == "grid.r2"
    keep("pld", "grid.r3", 16), keep("ar", "grid.r3", 16)  # r2 retired (or never kept)
    assert pick(16) == "grid.r3" and pick(32) == "grid.r4"
    keep("ar", "grid.r2", 32)  # another method's baseline below pld's newest: pld's r2 stays retired
    assert pick(32) == "grid.r4"
    keep("ar", "grid.r5.rep2", 64)  # a repeat of r5 names r5 the newest: r4 is a gap below it now
    assert pick(32) == "grid.r5"
