"""Utilization sampled in a background thread while a turn decodes.

On CUDA: GPU utilization and memory through pynvml (package nvidia-ml-py). Elsewhere:
this process's CPU utilization (CPU seconds over wall seconds, per core available).
"""

from __future__ import annotations

import os
import threading
import time


class UtilizationMonitor:
    def __init__(self, device: str, interval: float = 0.2) -> None:
        self.interval = interval
        self.kind = "cpu"
        self.samples: list[tuple[float, float, float]] = []  # (t, util %, memory MiB)
        self._handle = None
        if device.startswith("cuda"):
            try:
                import pynvml
                import torch

                pynvml.nvmlInit()
                index = torch.device(device).index or torch.cuda.current_device()
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._nvml = pynvml
                self.kind = "gpu"
            except Exception:  # no NVML (e.g. containers without the driver library)
                self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self, last: tuple[float, float]) -> tuple[float, float]:
        now = time.perf_counter()
        if self._handle is not None:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
            self.samples.append((now, float(util), memory))
            return last
        cpu = time.process_time()
        wall = now - last[0]
        if wall > 0:
            util = 100.0 * (cpu - last[1]) / wall / (os.cpu_count() or 1)
            self.samples.append((now, util, 0.0))
        return now, cpu

    def _loop(self) -> None:
        last = (time.perf_counter(), time.process_time())
        while not self._stop.wait(self.interval):
            last = self._sample(last)

    def __enter__(self) -> UtilizationMonitor:
        self._start = (time.perf_counter(), time.process_time())
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._end = (time.perf_counter(), time.process_time())

    def summary(self) -> dict:
        """Mean utilization over the whole span (CPU: exact from process times)."""
        if self.kind == "cpu":
            wall = self._end[0] - self._start[0]
            util = 100.0 * (self._end[1] - self._start[1]) / wall / (os.cpu_count() or 1) if wall else 0.0
            import torch

            # threads and cpus let a report tell a turn that shared the cores (bench.report.build).
            return {"kind": "cpu", "util_mean": round(util, 1), "threads": torch.get_num_threads(),
                    "cpus": os.cpu_count() or 1}
        utils = [s[1] for s in self.samples]
        return {"kind": "gpu", "util_mean": round(sum(utils) / len(utils), 1) if utils else None,
                "memory_max_mib": round(max((s[2] for s in self.samples), default=0.0), 1),
                "series": [(round(t - self._start[0], 3), u) for t, u, _ in self.samples]}
