"""Where a number came from: git commit, package versions, device and threads, time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

PACKAGES = ("torch", "transformers", "gguf", "triton", "pandas", "numpy", "safetensors")


def git_sha() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def training_machine(device: str) -> str:
    """Where a stretch of training ran, as the README's drafter table says it: the device and,
    on a CPU, the threads torch uses."""
    threads = torch.get_num_threads()
    return device_name(device) + ("" if device.startswith("cuda") else f", {threads} thread{'s' * (threads != 1)}")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        return set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")), []))
    except OSError:
        return set()


def cpu_isa() -> str:
    """The CPU's matmul tier, which decides bf16 speed and rounding: amx, avx512_bf16,
    avx512, avx2 or other (two CPUs can share a model name: "AMD EPYC" was AVX2 on one
    machine and AVX512-BF16 on another)."""
    flags = cpu_flags()
    for isa, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2")):
        if flag in flags:
            return isa
    return "other"


def cpu_model() -> str:
    """The CPU's vendor family, model and stepping (/proc/cpuinfo): two hosts that share a model
    name ("AMD EPYC") and tier measured half each other's matmul rate here."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model", "stepping") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        pass
    return " ".join(f"{k} {v}" for k, v in fields.items()) or "unknown"


def machine_key(device: str) -> str:
    """A file-name key for this machine: the device's name, and on a CPU its matmul tier."""
    name = device_name(device) + ("" if device.startswith("cuda") else f" {cpu_isa()}")
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def machine_file_name(target) -> str:
    """`<device>-<dtype>-<machine key>-t<torch threads>.json`: the name of a record kept per machine
    (a `bench profile`, a `bench tune`) for a loaded target."""
    device = str(target.engine.device)
    dtype = str(target.engine.dtype).removeprefix("torch.")
    return f"{device.split(':')[0]}-{dtype}-{machine_key(device)}-t{torch.get_num_threads()}.json"


def provenance(device: str) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {
        "git_sha": git_sha(),
        "python": sys.version.split()[0],
        "packages": versions,
        "device": device,
        "device_name": device_name(device),
        **({} if device.startswith("cuda") else {"cpu_isa": cpu_isa(), "cpu_model": cpu_model()}),
        "torch_threads": torch.get_num_threads(),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "started_at": timestamp(),
    }


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
