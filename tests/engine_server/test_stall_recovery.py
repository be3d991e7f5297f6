"""A stalled engine is back in the routers as soon as it answers again, not at the next
probe_interval (issue 61 #9): an engine server on a scripted engine and the virtual clock, a 3 s
hang under traffic at the default stall settings."""

from __future__ import annotations

import asyncio

import pytest

from engine_server.engines.base import EngineBackend, EngineOptions
from engine_server.probing import ProbeFailed
from engine_server.server import EngineServer
from engine_server.status import Health
from motor.contract.user_config import EngineSection
from tests.support.probing_fakes import FixedSampler
from tests.support.virtual_clock import VirtualClock

HANG_AT, HANG = 5.0, 3.0  # virtual seconds after the start; the hang lasts HANG


class HangingEngine(EngineBackend, engine_type="scripted"):
    """Four client requests in flight making progress (a token every 0.1 s) until the hang; the
    watchdog's 503s fail them back (nothing in flight after, so no progress either). During the
    hang a probe waits for its end, as one queued in a hung engine core does, up to its timeout;
    `failing` makes every probe fail at once (an engine answering 500)."""

    def __init__(self, options: EngineOptions, clock: VirtualClock, probe_timeout: float):
        super().__init__(options)
        self.clock, self.probe_timeout = clock, probe_timeout
        self.start_at = clock.monotonic()
        self.failed_back = False
        self.failing = False
        self.probes: list[float] = []  # when each probe was sent (virtual seconds from the start)

    def _at(self) -> float:
        return self.clock.monotonic() - self.start_at

    async def start(self) -> None:
        return None

    async def wait_dead(self) -> str:
        await asyncio.Event().wait()
        return ""

    async def shutdown(self) -> None:
        return None

    def stop_serving(self, reason: str) -> int:
        held = self.in_flight_requests()
        self.failed_back = True
        return held

    def in_flight_requests(self) -> int:
        return 0 if self.failed_back else 4

    def progress(self) -> int | None:
        return int(10 * min(self._at(), HANG_AT))

    def request_outcomes(self) -> tuple[int, int] | None:
        return (0, 0)

    async def probe(self) -> None:
        self.probes.append(self._at())
        if self.failing:
            raise ProbeFailed("HTTP 500: scripted")
        left = HANG_AT + HANG - self._at()
        if left > 0 and self._at() >= HANG_AT:
            await self.clock.sleep(min(left, self.probe_timeout))
            if self._at() < HANG_AT + HANG:
                raise ProbeFailed(f"timed out after {self.probe_timeout:g}s")


class AlwaysUp:
    async def check(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def engine_server(clock: VirtualClock, **health) -> tuple[EngineServer, HangingEngine]:
    options = EngineOptions(
        role="union", instance_id="u-0", dp_rank=0, host="127.0.0.1", port=1, master_dp_ip="127.0.0.1"
    )
    section = EngineSection.model_validate({"engine_type": "sim", "health_check_config": health})
    engine = HangingEngine(options, clock, section.health_check_config.probe_timeout)
    core = EngineServer(
        options, section, engine, sampler=FixedSampler(0), probe_client=engine, health_client=AlwaysUp(), clock=clock
    )
    await core.start()
    await clock.run_until(lambda: core.machine.state is Health.NORMAL, limit=5)
    return core, engine


async def out_of_traffic(clock: VirtualClock, core: EngineServer) -> tuple[float, float]:
    """(when the engine left the routers, when it came back), virtual seconds from now."""
    start = clock.monotonic()
    await clock.run_until(lambda: core.watchdog.not_serving_reason != "", limit=30)
    left = clock.monotonic() - start
    await clock.run_until(lambda: core.watchdog.not_serving_reason == "", limit=60)
    return left, clock.monotonic() - start


@pytest.mark.parametrize("probe_interval", [5.0, 30.0])
async def test_a_3s_hang_is_out_of_traffic_about_as_long_as_it_lasts_whatever_probe_interval(probe_interval):
    """Default stall_timeout (2 s) and stall_kill_after (10 s): the engine leaves the routers 2 s
    into the hang and is back within half a second of its end, never ABNORMAL; probe_interval
    (5 s, or 30 s, which used to get a 3 s hiccup killed) plays no part."""
    clock = VirtualClock()
    core, engine = await engine_server(clock, probe_interval=probe_interval)
    abnormal: list[str] = []
    core.machine.on_transition(lambda change: change.after is Health.ABNORMAL and abnormal.append(change.reason))
    try:
        left, back = await out_of_traffic(clock, core)
        began = clock.monotonic() - back  # out_of_traffic's start, virtual
        hang_starts = engine.start_at + HANG_AT - began
        assert hang_starts + 2.0 <= left <= hang_starts + 2.0 + 0.5, f"left the routers at {left:.1f}"
        assert abnormal == [], f"a {HANG:g} s hang got the engine killed (probe_interval {probe_interval:g} s)"
        assert back <= hang_starts + HANG + 0.5, (
            f"out of traffic {back - left:.1f} s for a {HANG:g} s hang (back {back - hang_starts - HANG:.1f} s "
            f"after it ended; probe_interval {probe_interval:g} s)"
        )
        assert "a probe was answered" in core.watchdog.reason or core.watchdog.reason == ""
    finally:
        await core.close(1.0)


async def test_recovery_probes_against_an_engine_failing_at_once_are_paced():
    """Probes that fail at once (inference answering 500) are not sent back to back: at most two
    a second, and the first goes at once, not after a probe_interval."""
    clock = VirtualClock()
    core, engine = await engine_server(clock, probe_interval=5.0, stall_kill_after=60.0)
    try:
        engine.failing = True
        await clock.run_until(lambda: core.watchdog.not_serving_reason != "", limit=30)
        began = clock.monotonic() - engine.start_at
        await clock.run_until(lambda: False, limit=10)
        sent = [at for at in engine.probes if at >= began]
        assert sent and sent[0] - began < 0.5, f"first recovery probe {sent[:1]} s, stall seen at {began:.1f} s"
        assert 10 <= len(sent) <= 21, f"{len(sent)} recovery probes in 10 s"
        engine.failing = False
        back = await clock.run_until(lambda: core.watchdog.not_serving_reason == "", limit=10)
        assert back <= 0.5 + 1e-9, f"back {back:.2f} s after the probes succeed again"
    finally:
        await core.close(1.0)


async def test_no_recovery_probe_while_draining_or_sleeping_and_one_at_once_after():
    clock = VirtualClock()
    core, engine = await engine_server(clock, stall_kill_after=60.0)
    try:
        core.draining = True
        await clock.run_until(lambda: core.watchdog.not_serving_reason != "", limit=30)
        began = len(engine.probes)
        await clock.run_until(lambda: False, limit=5)
        assert len(engine.probes) == began, "a recovery probe went to a draining engine"
        core.draining = False
        back = await clock.run_until(lambda: core.watchdog.not_serving_reason == "", limit=5)
        assert back <= 0.5 + 1e-9 and len(engine.probes) == began + 1
    finally:
        await core.close(1.0)
