"""The CPU's bf16 decode kernels (bench/core/kernels/cpu_bf16.cpp), built on first use.

Linear layers and attention whose rows are computed independently of how many rows share
a pass, so a k-token verification rounds exactly as k one-token steps. They replace the
engine's earlier invariant path (fp64 attention, oneDNN GEMMs in row chunks and column
pieces), which kept bf16 token-exact but cost ~40% at k = 16.

The build is for this CPU's instruction tier (AMX tiles for the linears, else AVX512-BF16,
else AVX2 + FMA), cached under torch's extensions folder in a folder named by everything
it depends on (tier, compiler flags, source, torch's version and install path), so neither
two machines sharing a home nor two checkouts or virtualenvs ever run or rebuild each
other's binary. One process builds at a time, under an OS file lock that dies with its
owner: a build killed midway leaves no lock that wedges the next run (its half-written
folder is rebuilt), and a wait past BENCH_KERNEL_LOCK_TIMEOUT seconds (default 900) names
the lock and goes on without the kernels. Without a compiler or either tier, `kernels()`
is None and the engine keeps its earlier path. SPEC_BENCH_CPU_KERNELS=0 turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import weakref
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.core.provenance import cpu_flags

SOURCE = Path(__file__).parent / "kernels" / "cpu_bf16.cpp"
_AVX512BF16 = ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"},
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-DSB_AVX512BF16"])
TIERS = {  # tier -> (flags the CPU must have, compiler flags), best first
    "amx": (_AVX512BF16[0] | {"amx_tile", "amx_bf16"}, [*_AVX512BF16[1], "-mamx-tile", "-mamx-bf16", "-DSB_AMX"]),
    "avx512bf16": _AVX512BF16,
    "avx2": ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
}


def cpu_tier() -> str | None:
    """The best kernel tier this CPU runs, or None."""
    flags = cpu_flags()
    return next((tier for tier, (needed, _) in TIERS.items() if needed <= flags), None)


def enabled() -> bool:
    return os.environ.get("SPEC_BENCH_CPU_KERNELS", "1") != "0"


@functools.cache
def kernels(tier: str | None = None) -> ModuleType | None:
    """The compiled kernels for `tier` (default: this CPU's best), or None where they cannot
    be built here (one line on stderr says why)."""
    tier = tier or cpu_tier()
    if tier is None or not enabled():
        return None
    try:
        return build(SOURCE, tier)
    except Exception as error:  # no compiler, headers or disk: the engine's earlier path still works
        print(f"spec-bench: CPU bf16 kernels not built ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
              "using oneDNN and fp64 attention", file=sys.stderr)
        return None


_PACKED: dict[int, tuple[weakref.ref, int, Tensor]] = {}


def build_name(source: Path, tier: str, prefix: str, cflags: list[str]) -> str:
    """The build's folder name: tier, then a hash of what the binary depends on."""
    depends = [Path(source).read_bytes(), " ".join(cflags).encode(), torch.__version__.encode(),
               str(Path(torch.__file__).resolve().parent).encode(), sys.version.encode()]
    digest = hashlib.sha1(b"\0".join(depends)).hexdigest()[:12]
    return f"{prefix}_{tier}_{digest}"


def extensions_root() -> Path:
    """torch's extensions folder (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


class LockTimeout(Exception):
    pass


def _hold(lock_path: Path, timeout: float):
    """An exclusive OS lock on lock_path (released by the kernel when its owner dies), waited
    for at most `timeout` seconds; one line on stderr while waiting."""
    import fcntl
    import time

    handle = open(lock_path, "a+")
    waited, said = 0.0, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if waited >= timeout:
                handle.close()
                raise LockTimeout(f"waited {timeout:g} s for {lock_path} (another process is building the kernels)") \
                    from None
            if not said:
                print(f"spec-bench: waiting for another process to build the CPU kernels ({lock_path})",
                      file=sys.stderr)
                said = True
            time.sleep(0.5)
            waited += 0.5


def build(source: Path, tier: str, prefix: str = "spec_bench_cpu_bf16") -> ModuleType:
    """Compile `source` for `tier` into its own folder (build_name), one process at a time;
    torch's own `lock` file there, left by a build that was killed, is cleared first (it can
    only be stale: every builder of this folder holds our lock)."""
    from torch.utils.cpp_extension import load

    cflags = ["-O3", "-fopenmp", *TIERS[tier][1]]
    name = build_name(source, tier, prefix, cflags)
    folder = extensions_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get("BENCH_KERNEL_LOCK_TIMEOUT", "900"))
    handle = _hold(folder.with_name(name + ".build-lock"), timeout)
    try:
        (folder / "lock").unlink(missing_ok=True)
        return load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                    build_directory=str(folder), verbose=False)
    finally:
        handle.close()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, on the kernels for bf16 inference on a CPU that builds them. `weight` is packed
    once and kept while that tensor lives unchanged (F.linear re-packs a bf16 weight on every
    call on the CPU): for weights that persist (a module's, a drafter's lm_head copy), not views
    made per call."""
    if (x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16 or x.device.type != "cpu"
            or x.numel() == 0 or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
        return F.linear(x, weight, bias)
    built = kernels()
    if built is None:
        return F.linear(x, weight, bias)
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != weight._version:
        entry = (weakref.ref(weight, lambda _, key=key: _PACKED.pop(key, None)), weight._version,
                 built.pack(weight.detach().contiguous()))
        _PACKED[key] = entry
    out = built.linear(x, entry[2], weight.shape[0])
    return (out if bias is None else out + bias).to(x.dtype)


class PackedLinear(nn.Linear):
    """nn.Linear whose bf16 inference on the CPU runs `linear` above (drafters' layers)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
