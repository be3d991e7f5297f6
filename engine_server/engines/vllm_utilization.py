"""Utilization samplers for the vLLM backend when there is no GPU/NPU to ask.

On the CPU build the figure is the engine core's progress, not CPU time (a stopped engine core
next to a live worker or API server could still show some CPU use, and a busier neighbour
would then keep failed probes from counting, hiding the hang): 100 % when the engine core
produced tokens for client requests since the previous reading, 0 % otherwise. Probes' tokens
do not count, so an idle engine reads 0 % (failed probes count) and a hung one reads 0 % even
with requests waiting; only an engine that is really serving reads as busy.

The same progress (`EngineProgress.total`: tokens plus scheduler steps) is what excuses a failed
probe on every build (probing.Prober): on a GPU or NPU the utilization comes from NVML or
npu-smi, and a kernel spinning in a hung collective reads near 100 % there, so a busy figure
counts only when the engine also made progress.

A fixed figure (engine_args `motor_utilization`) overrides the utilization, for operators who
want probe failures always counted (0), counted only when the engine makes no progress (100), or
the CPU build to read as a busy accelerator does (NVML near 100 % in a hung collective: 95).
"""

from __future__ import annotations

from collections.abc import Callable

from engine_server.engines.base import UtilizationSampler


class EngineProgress:
    """Tokens the engine core produced for client requests and scheduler steps it completed
    (probe-only steps excluded), counted by the probe filter's patches of vLLM's output
    processor and stat logger in the API-server process. Steps move during a long chunked
    prefill, before the first token."""

    def __init__(self) -> None:
        self.tokens = 0
        self.steps = 0
        # Whether a client request is in the engine now: a step counts only then, so the steps
        # of a probe (and the steps around it that carry no output) are no progress.
        self.serving_clients: Callable[[], bool] = lambda: False

    def add(self, tokens: int) -> None:
        self.tokens += tokens  # only from vLLM's loop thread; readers only read

    def step(self) -> None:
        if self.serving_clients():
            self.steps += 1

    @property
    def total(self) -> int:
        return self.tokens + self.steps


# The API server of this process (one engine per engine server).
PROGRESS = EngineProgress()


class FixedUtilizationSampler(UtilizationSampler):
    """Always the configured figure."""

    name = "fixed"

    def __init__(self, percent: float):
        self.percent = float(percent)

    async def sample(self) -> float:
        return self.percent


class EngineProgressSampler(UtilizationSampler):
    """100 when `progress` moved (tokens or steps) since the previous reading, else 0."""

    name = "engine-progress"

    def __init__(self, progress: EngineProgress = PROGRESS):
        self.progress = progress
        self._last = progress.total

    def read(self) -> float:
        now = self.progress.total
        moved, self._last = now != self._last, now
        return 100.0 if moved else 0.0

    async def sample(self) -> float:
        return self.read()
