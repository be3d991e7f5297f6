"""Utilization samplers for the vLLM backend when there is no GPU/NPU to ask.

On the CPU build the "accelerator" is the CPU the engine core computes on, so the figure is the
CPU usage of the engine-core process tree (its workers included) as a percentage of the CPUs
this process may run on. A fixed figure (engine_args `motor_utilization`) overrides it: for
tests, and for operators who want probe failures always counted (0) or never (100).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

import psutil

from engine_server.engines.base import UtilizationSampler

logger = logging.getLogger(__name__)


class FixedUtilizationSampler(UtilizationSampler):
    """Always the configured figure."""

    name = "fixed"

    def __init__(self, percent: float):
        self.percent = float(percent)

    async def sample(self) -> float:
        return self.percent


class ProcessCpuSampler(UtilizationSampler):
    """CPU usage of a set of processes and their children since the previous reading.

    `pids` is called at each reading, so processes that appear later (the engine core starts
    after the sampler is created) are picked up; before any exists the reading is 0."""

    name = "cpu"

    def __init__(self, pids: Callable[[], Iterable[int]], cpu_count: int | None = None):
        self._pids = pids
        self._cpu_count = cpu_count or len(os.sched_getaffinity(0)) or 1
        self._processes: dict[int, psutil.Process] = {}

    def _tree(self) -> list[psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for pid in self._pids():
            try:
                root = self._processes.get(pid) or psutil.Process(pid)
                found[pid] = root
                for child in root.children(recursive=True):
                    found[child.pid] = self._processes.get(child.pid) or child
            except psutil.Error:
                continue
        self._processes = found
        return list(found.values())

    def read(self) -> float:
        total = 0.0
        for process in self._tree():
            try:
                # First call per process returns 0 and starts its measurement window.
                total += process.cpu_percent(interval=None)
            except psutil.Error:
                continue
        return max(0.0, min(100.0, total / self._cpu_count))

    async def sample(self) -> float:
        return self.read()
