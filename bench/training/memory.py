"""A training process's memory, bounded without giving up jemalloc's page reuse.

`bench train` runs under jemalloc with purging off (bench/cli/train.py): a step's large
temporaries reuse the pages the last step freed instead of faulting fresh zeroed pages in.
With purging on (any finite `dirty_decay_ms`) a step spends as much time in the kernel's
page faults as in its matmuls (measured on the at-scale trainers, results/README.md). But
steps differ in padded width, so the freed extents fit the next step's tensors less and
less and the retained memory grows: an at-scale EAGLE-3 trainer was killed at 17.6 GB.
`MemoryCap` purges every arena once whenever the process's anonymous memory passes a cap: a
one-off re-fault of the pages still in use, then reuse again.
"""

from __future__ import annotations

import ctypes
import os

DEFAULT_SHARE = 0.3  # of physical memory: two trainers, the feature taps' page cache and the rest fit


def anonymous_bytes() -> int:
    """Resident memory less file-backed pages (the mapped feature taps are reclaimable)."""
    with open("/proc/self/statm") as handle:
        fields = handle.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def _mallctl():
    """jemalloc's mallctl when jemalloc is this process's allocator, else None."""
    if "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
        return None
    try:
        function = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def purge_all_arenas() -> bool:
    """Return every arena's unused dirty pages to the system; False when not under jemalloc."""
    mallctl = _mallctl()
    return mallctl is not None and mallctl(b"arena.4096.purge", None, None, None, 0) == 0  # 4096: all arenas


class MemoryCap:
    """after_step(): purge jemalloc's arenas when anonymous resident memory exceeds the cap:
    `limit` bytes (default: DEFAULT_SHARE of physical memory, or $BENCH_TRAIN_MEMORY_GB), or
    twice the working set, whichever is larger. The working set is the most this process held
    after any of its first WARMUP steps (jemalloc keeps a step's peak): a cap below it would
    purge pages every step needs again, and fault them all back in. A cap set in
    $BENCH_TRAIN_MEMORY_GB gives way to the working set alone, not twice it: two trainers side by
    side on a small machine may not have that margin. `purges` counts purges."""

    WARMUP = 5

    def __init__(self, limit: int | None = None) -> None:
        configured = os.environ.get("BENCH_TRAIN_MEMORY_GB") if limit is None else None
        if limit is None:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            limit = int(float(configured) * 2**30) if configured else int(DEFAULT_SHARE * physical)
        self.margin = 1 if configured else 2  # times the working set the cap never goes below
        self.limit = limit
        self.enabled = _mallctl() is not None
        self.purges = 0
        self.steps = 0
        self.working_set = 0

    def cap(self) -> int:
        return max(self.limit, self.margin * self.working_set)

    def after_step(self) -> None:
        if not self.enabled:
            return
        held = anonymous_bytes()
        self.steps += 1
        if self.steps <= self.WARMUP:
            self.working_set = max(self.working_set, held)
        elif held > self.cap() and purge_all_arenas():
            self.purges += 1
