"""Progress decides: the probe interval of a busy-looking engine, and the stall watchdog (in-process,
virtual clock)."""

from __future__ import annotations

from engine_server.probing import PeakSampler, ProbeFailed, Prober
from engine_server.status import Event, Health, HealthStateMachine
from motor.contract.user_config import HealthCheckConfig
from tests.engine_server.test_probing import FixedSampler, Progress
from tests.engine_server.virtual_clock import VirtualClock

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


async def run_prober_until_abnormal(utilization: float) -> tuple[float, Prober]:
    import asyncio

    clock, progress = VirtualClock(), Progress()
    prober, machine = seed_prober(clock, utilization, progress)
    task = asyncio.create_task(prober.run())
    try:
        took = await clock.run_until(lambda: machine.state is Health.ABNORMAL, limit=120)
    finally:
        task.cancel()
    return took, prober


async def test_a_hang_at_high_utilization_without_traffic_is_probed_at_probe_interval():
    """A kernel spinning in a hung collective reads 90 %: without progress that is not busy, so
    the next probe comes at probe_interval, and the seed's settings find it ABNORMAL within 30 s."""
    took, prober = await run_prober_until_abnormal(90)
    assert took <= 30, f"ABNORMAL only after {took:.1f}s"
    assert prober.interval == SEED.probe_interval


async def test_high_utilization_with_progress_is_busy_and_probed_at_busy_interval():
    clock, progress = VirtualClock(), Progress()
    prober, _ = seed_prober(clock, 90, progress)
    progress.count = 1
    prober._progress_seen = 0  # it moved since the previous round
    prober.client = type("Ok", (), {"probe": staticmethod(lambda: _ok())})()
    record = await _one_round(clock, prober)
    assert record.next_interval == SEED.busy_probe_interval


async def test_an_engine_without_a_progress_source_is_judged_by_utilization_alone():
    clock = VirtualClock()
    prober, _ = seed_prober(clock, 90, Progress())
    prober.progress = lambda: None
    record = await _one_round(clock, prober)
    assert record.next_interval == SEED.busy_probe_interval and not record.counted


async def _ok() -> None:
    return None


async def _one_round(clock: VirtualClock, prober: Prober):
    import asyncio

    task = asyncio.create_task(prober.probe_once())
    await clock.run_until(task.done, limit=60)
    return task.result()
