"""Shared fixtures. The real default target loads once per session (~0.5 s from the cached
safetensors copy; the first run on a machine converts the GGUF once, ~25 s)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET when a kernel is first defined, and a test module collected
# before tests/test_verify_triton.py may import triton (transformers does): interpret mode
# on a machine without CUDA is set here, before any test module is imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tasks

TINY_TASK = [  # MT-bench format; one two-turn question so conversations are exercised
    {"question_id": "q1", "category": "chat", "turns": ["Say hi.", "Now say bye."]},
    {"question_id": "q2", "category": "math", "turns": ["What is 2+2?"]},
]


@pytest.fixture(scope="session")
def default_target():
    from bench.core.target import load_target

    return load_target(device="cpu")


@pytest.fixture(scope="session")
def hf_model(default_target):
    from bench.core.target import load_hf_model

    return load_hf_model(default_target.path, "cpu")


@pytest.fixture
def data_dir(monkeypatch) -> Path:
    """The shared task data beside the checkout, else the bundled copies; exported as $BENCH_DATA_DIR."""
    folder = tasks.REPO_ROOT.parent / "shared" / "data"
    if not (folder / "mt_bench" / "question.jsonl").exists():
        folder = tasks.REPO_ROOT / "tasks" / "data"  # the bundled copies (a clean clone in CI)
    monkeypatch.setenv("BENCH_DATA_DIR", str(folder))
    return folder


@pytest.fixture
def tiny_task(tmp_path) -> Path:
    """A two-question custom task file."""
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in TINY_TASK), encoding="utf-8")
    return path


@pytest.fixture
def offline(monkeypatch, tmp_path) -> list[str]:
    """No local data and no network: urlopen fails (and records the URLs it was asked for)."""
    requested: list[str] = []

    def refuse(url, *args, **kwargs):
        requested.append(url)
        raise OSError("network disabled in tests")

    monkeypatch.setattr(tasks.urllib.request, "urlopen", refuse)
    monkeypatch.setattr(tasks, "REPO_ROOT", tmp_path / "checkout")  # hides the shared/data beside it
    monkeypatch.delenv("BENCH_DATA_DIR", raising=False)
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    return requested


@pytest.fixture(autouse=True)
def no_shipped_distilled_data(monkeypatch):
    """Tests make their own distilled data: the project's (methods/distilled/, growing while a
    distillation runs) would otherwise be found by the trainers and the feature extraction."""
    from bench.training import distill

    monkeypatch.setattr(distill, "SHIPPED_ROOTS", [])


@pytest.fixture
def one_thread():
    """Thousands of tiny forwards: intra-op threads only add contention."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
