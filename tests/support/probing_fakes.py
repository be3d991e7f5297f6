"""The engine server's prober on fakes: a scripted inference client and health endpoint, a fixed
sampler, the progress a probe reads, and a prober built from them."""

from __future__ import annotations

import asyncio

from aiohttp import web

from engine_server.engines.base import UtilizationSampler
from engine_server.probing import PeakSampler, ProbeFailed, Prober
from engine_server.status import Event, HealthStateMachine
from motor.clock import SystemClock
from motor.contract.user_config import HealthCheckConfig
from tests.support import serve_app
from tests.support.virtual_clock import VirtualClock

SETTINGS = HealthCheckConfig(
    enable_virtual_inference=True,
    npu_usage_threshold=3,
    max_failure_count=3,
    probe_interval=5,
    busy_probe_interval=20,
    busy_utilization=80,
    probe_timeout=0.2,
    utilization_window=3,
    utilization_sample_period=0.5,
)


class FixedSampler(UtilizationSampler):
    name = "fixed"

    def __init__(self, *values: float):
        self.values = list(values)
        self.calls = 0

    async def sample(self) -> float:
        self.calls += 1
        return self.values[min(self.calls - 1, len(self.values) - 1)]


class ScriptedClient:
    def __init__(self):
        self.fail: str | None = None
        self.hang = False
        self.calls = 0

    async def probe(self) -> None:
        self.calls += 1
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise ProbeFailed(self.fail)


class NoWaitClock(SystemClock):
    """The system clock, but a sleep returns at once."""

    async def sleep(self, seconds: float) -> None:
        return None


NO_WAIT = NoWaitClock()


def make_prober(sampler: UtilizationSampler, client=None, settings=SETTINGS, metrics=None, progress=lambda: None):
    machine = HealthStateMachine()
    machine.fire(Event.HEALTH_UP, "up")
    records = []
    prober = Prober(
        settings, client or ScriptedClient(), PeakSampler(sampler, settings.utilization_window,
        settings.utilization_sample_period, clock=NO_WAIT), machine, on_record=records.append, metrics=metrics,
        progress=progress,
    )  # fmt: skip
    return prober, machine, records


class Progress:
    """An engine's progress counter that moves only when told to."""

    def __init__(self):
        self.count = 0

    def __call__(self) -> int:
        return self.count


async def serve_completions(handler) -> tuple[str, web.AppRunner]:
    """(base URL, runner) of an in-process server answering POST /v1/completions with `handler`."""
    app = web.Application()
    app.add_routes([web.post("/v1/completions", handler)])
    runner, url = await serve_app(app)
    return url, runner


class ScriptedHealth:
    def __init__(self):
        self.problem: str | None = None
        self.calls = 0

    async def check(self) -> None:
        self.calls += 1
        if self.problem:
            raise ProbeFailed(self.problem)


# The seed's health settings (issue reports): probes every 2 s, 5 s timeout, 3 failures, 20 s busy.
SEED = HealthCheckConfig(
    enable_virtual_inference=True,
    probe_interval=2,
    probe_timeout=5,
    max_failure_count=3,
    busy_probe_interval=20,
)


class HungInference:
    """A probe to a hung engine core: no answer until the probe timeout (on the virtual clock)."""

    def __init__(self, clock: VirtualClock, timeout: float):
        self.clock, self.timeout, self.calls = clock, timeout, 0

    async def probe(self) -> None:
        self.calls += 1
        await self.clock.sleep(self.timeout)
        raise ProbeFailed(f"timed out after {self.timeout:g}s")


def seed_prober(clock: VirtualClock, utilization: float, progress: Progress) -> tuple[Prober, HealthStateMachine]:
    machine = HealthStateMachine(clock)
    machine.fire(Event.HEALTH_UP, "up")
    prober = Prober(
        SEED,
        HungInference(clock, SEED.probe_timeout),
        PeakSampler(FixedSampler(utilization), SEED.utilization_window, SEED.utilization_sample_period, clock),
        machine,
        clock=clock,
        progress=progress,
    )
    return prober, machine
