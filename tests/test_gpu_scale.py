"""scripts.gpu_scale: the drafters' archive survives parts, sends and merging, byte for byte."""

import json
from pathlib import Path

import pytest

from scripts import gpu_scale


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pack_send_merge_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_scale, "PART_BYTES", 1000)  # several parts from small files
    monkeypatch.setattr(gpu_scale, "PARTS_PER_CALL", 2)
    device, here = tmp_path / "device", tmp_path / "here"
    shipped = device / "checkpoints" / "smollm2-135m" / "eagle3"
    shipped.mkdir(parents=True)
    (shipped / "model.safetensors").write_bytes(bytes(range(256)) * 9)
    (shipped / "drafter.json").write_text(json.dumps({"method": "eagle3"}))
    monkeypatch.setenv("BENCH_CACHE", str(device / "cache"))
    training = device / "cache" / "drafters" / "smollm2-135m" / "eagle3"
    for name, data in {"model.safetensors": b"w" * 1500, "kept/200000-tokens/model.safetensors": b"k" * 700,
                       "checkpoint/optimizer.safetensors": b"o" * 5000, ".train.lock": b"1"}.items():
        (training / name).parent.mkdir(parents=True, exist_ok=True)
        (training / name).write_bytes(data)
    packed = device / "packed"
    index = gpu_scale._pack(["eagle3"], packed, device / "checkpoints")
    assert len(index["parts"]) >= 4
    calls = []
    for first in range(0, len(index["parts"]), 2):
        calls.append(tmp_path / f"call{first}")
        gpu_scale.send(first, calls[-1], packed)
        assert len(list(calls[-1].glob("drafters.part*"))) <= 2
    with pytest.raises(SystemExit, match="missing"):
        gpu_scale.merge(calls[:-1], here / "checkpoints")
    monkeypatch.setenv("BENCH_CACHE", str(here / "cache"))
    gpu_scale.merge(calls, here / "checkpoints")
    assert _tree(here / "checkpoints") == _tree(device / "checkpoints")
    merged = _tree(here / "cache" / "drafters" / "smollm2-135m" / "eagle3")
    assert merged == {"model.safetensors": b"w" * 1500, "kept/200000-tokens/model.safetensors": b"k" * 700}


def test_shipped_only_archive_leaves_the_training_folders_here_alone(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What `--run --minutes` sends back: the shipped drafters alone; merging it replaces the shipped
    folder and keeps this machine's training folder (its checkpoint may resume a CPU run)."""
    device, here = tmp_path / "device", tmp_path / "here"
    shipped = device / "checkpoints" / "smollm2-135m" / "dspark"
    shipped.mkdir(parents=True)
    (shipped / "model.safetensors").write_bytes(b"d" * 2500)
    monkeypatch.setenv("BENCH_CACHE", str(device / "cache"))
    training = device / "cache" / "drafters" / "smollm2-135m" / "dspark"
    training.mkdir(parents=True)
    (training / "model.safetensors").write_bytes(b"t" * 100)
    index = gpu_scale._pack(["dspark"], device / "packed", device / "checkpoints", shipped_only=True)
    assert index["shipped_only"] and len(index["parts"]) == 1
    gpu_scale.send(0, tmp_path / "call", device / "packed")
    monkeypatch.setenv("BENCH_CACHE", str(here / "cache"))
    ours = here / "cache" / "drafters" / "smollm2-135m" / "dspark"
    ours.mkdir(parents=True)
    (ours / "checkpoint").mkdir()
    (ours / "checkpoint" / "state.json").write_text("{}")
    gpu_scale.merge([tmp_path / "call"], here / "checkpoints")
    assert _tree(here / "checkpoints") == _tree(device / "checkpoints")
    assert _tree(ours) == {"checkpoint/state.json": b"{}"}


def test_carried_packages_keep_their_versions(tmp_path: Path) -> None:
    """A bare copy of gguf has no metadata, and transformers then refuses the GGUF ("Invalid
    version: 'N/A'"): the copy carries its name and version."""
    import importlib.metadata

    from packaging.version import Version

    from scripts.gpu_distill import _write_metadata

    _write_metadata(tmp_path, "gguf")
    carried = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert carried == {"gguf": importlib.metadata.version("gguf")}
    assert Version(carried["gguf"]) >= Version("0.10.0")


def test_features_go_to_memory_only_where_it_holds_them(tmp_path: Path) -> None:
    assert gpu_scale._cache_root(tmp_path, needed=1) == tmp_path / "bench-cache"
    assert gpu_scale._cache_root(tmp_path, needed=2**62) == Path("/tmp/bench-cache")
    assert gpu_scale._cache_root(tmp_path / "absent", needed=1) == Path("/tmp/bench-cache")


def _training_folder(root: Path, method: str, steps: int, max_steps: int) -> Path:
    folder = root / method
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "state.json").write_text(json.dumps({"step": steps}))
    (folder / "checkpoint" / "optimizer.safetensors").write_bytes(bytes(range(256)) * 20)
    (folder / "drafter.json").write_text(json.dumps({"training": {"steps": steps, "max_steps": max_steps}}))
    (folder / ".train.lock").write_text("1")
    return folder


def test_unfinished_runs_come_back_with_their_checkpoints_and_travel_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease ends with runs unfinished: after the drafters, their folders come back in more parts;
    merged here they sit where the same command resumes them, and staged they travel to the next
    lease, one folder a call, and land there byte for byte."""
    monkeypatch.setattr(gpu_scale, "PART_BYTES", 6000)  # tar pads to 10 KiB: two parts an archive
    monkeypatch.setattr(gpu_scale, "PARTS_PER_CALL", 2)
    monkeypatch.setattr(gpu_scale, "STAGE_BYTES", 3000)
    device, here = tmp_path / "device", tmp_path / "here"
    shipped = device / "checkpoints" / "smollm2-135m" / "mtp"
    shipped.mkdir(parents=True)
    (shipped / "model.safetensors").write_bytes(b"m" * 100)
    _training_folder(device / "scale", "mtp", 553, 2119)
    _training_folder(device / "scale", "dspark", 1158, 1158)  # finished: nothing to resume
    packed = device / "packed"
    index = gpu_scale._pack(["mtp"], packed, device / "checkpoints", shipped_only=True)
    index = gpu_scale._add_resume(index, ["mtp", "dspark"], packed, device / "scale")
    assert list(index["resume"]) == ["mtp"] and gpu_scale._all_parts(index)[0] == "drafters.part00"
    calls = []
    assert len(index["parts"]) == 2
    for first in range(0, len(gpu_scale._all_parts(index)), 2):
        calls.append(tmp_path / f"call{first}")
        gpu_scale.send(first, calls[-1], packed)
    ours = _training_folder(here / "scale", "mtp", 105, 4632)  # a CPU run of the same method here
    gpu_scale.merge(calls[:1], here / "checkpoints", here / "scale")  # the drafters alone: nothing restored
    assert _tree(ours)["checkpoint/state.json"] == b'{"step": 105}'
    gpu_scale.merge(calls, here / "checkpoints", here / "scale")
    came = {k: v for k, v in _tree(device / "scale" / "mtp").items() if k != ".train.lock"}
    assert _tree(here / "scale" / "mtp") == came
    assert [p.name.split(".")[0] for p in (here / "scale").iterdir()] == ["mtp", "mtp"]  # ours kept aside
    # the next lease
    carried = tmp_path / "gpu_distill"
    gpu_scale.stage(["mtp"], carried, here / "scale")
    staged = json.loads((carried / "resume.json").read_text())
    assert len(staged["folders"]) >= 2 and all((carried / f / "part").stat().st_size <= 3000 for f in staged["folders"])
    (carried / staged["folders"][-1] / "part").rename(tmp_path / "left-behind")
    with pytest.raises(SystemExit, match="carry every one"):
        gpu_scale.unstage(carried, tmp_path / "lease2")
    (tmp_path / "left-behind").rename(carried / staged["folders"][-1] / "part")
    gpu_scale.unstage(carried, tmp_path / "lease2")
    assert _tree(tmp_path / "lease2" / "mtp") == came
    (tmp_path / "lease2" / "mtp" / "checkpoint" / "state.json").write_text('{"step": 900}')  # trained on
    gpu_scale.unstage(carried, tmp_path / "lease2")  # the lease's next call: nothing put back
    assert _tree(tmp_path / "lease2" / "mtp")["checkpoint/state.json"] == b'{"step": 900}'
