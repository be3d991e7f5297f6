"""Progress decides: the probe interval of a busy-looking engine, and the stall watchdog (in-process,
virtual clock)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from engine_server.metrics import EngineServerMetrics
from engine_server.probing import ProbeFailed, Prober
from engine_server.serving import CHECK_PERIOD, FAILED_IN_A_ROW, Serving, ServingChange, ServingWatchdog
from engine_server.status import Event, Health, HealthStateMachine
from motor.contract.user_config import HealthCheckConfig
from tests.support.probing_fakes import SEED, Progress, seed_prober
from tests.support.virtual_clock import VirtualClock


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


class ServesUntil:
    """A probe answered at once until `hang_at` (virtual seconds), then never (a hung engine core)."""

    def __init__(self, clock: VirtualClock, hang_at: float, timeout: float):
        self.clock, self.hang_at, self.timeout = clock, hang_at, timeout

    async def probe(self) -> None:
        if self.clock.monotonic() < self.hang_at:
            return
        await self.clock.sleep(self.timeout)
        raise ProbeFailed(f"timed out after {self.timeout:g}s")


async def test_an_engine_busy_in_its_first_round_then_hung_idle_is_abnormal_within_20s():
    """Issue 61 #11: the first round sees client tokens at 90 % and picks the busy interval (20 s);
    then the traffic ends and the engine hangs. The busy interval lasts only while progress goes on:
    with the seed's settings it is ABNORMAL within 20 s of the hang, not after 20 s + 3 x 5 s."""
    import asyncio

    clock, progress = VirtualClock(), Progress()
    prober, machine = seed_prober(clock, 90, progress)
    hang_at = clock.monotonic() + SEED.utilization_window  # just after the first round
    prober.client = ServesUntil(clock, hang_at, SEED.probe_timeout)

    async def client_traffic() -> None:
        while clock.monotonic() < hang_at:
            progress.count += 1
            await clock.sleep(0.25)

    tasks = [asyncio.create_task(client_traffic()), asyncio.create_task(prober.run())]
    try:
        await clock.run_until(lambda: prober.last is not None, limit=10)
        assert prober.interval == SEED.busy_probe_interval  # the first round read busy, rightly
        await clock.run_until(lambda: machine.state is Health.ABNORMAL, limit=120)
    finally:
        for task in tasks:
            task.cancel()
    took = clock.monotonic() - hang_at
    assert took <= 20, f"ABNORMAL {took:.1f}s after the hang"


@pytest.mark.parametrize(
    "peak, progressed, before, after",
    [
        (90, False, 20, 2),  # busy reading, no progress: a hung kernel, probed at probe_interval
        (3, False, 20, 2),  # at npu_usage_threshold, no progress: the same
        (2.9, False, 20, 2),  # idle anyway
        (90, True, 2, 20),  # busy and making progress
        (90, None, 2, 20),  # no progress source: utilization alone
        (50, True, 20, 20),  # in between, progressing: unchanged
        (50, None, 2, 2),
    ],
)
def test_interval_rule_with_progress(peak, progressed, before, after):
    prober, _ = seed_prober(VirtualClock(), 0, Progress())
    prober.interval = before
    assert prober.next_interval(peak, progressed) == after


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


# ------------------------------------------------------------------ the stall watchdog


class Activity:
    """What an engine reports, set by the test."""

    def __init__(self, in_flight: int = 0, progress: int | None = 0, outcomes: tuple[int, int] | None = (0, 0)):
        self.in_flight, self.count, self.outcomes = in_flight, progress, outcomes

    def in_flight_requests(self) -> int:
        return self.in_flight

    def progress(self) -> int | None:
        return self.count

    def request_outcomes(self) -> tuple[int, int] | None:
        return self.outcomes


class Ticker:
    """Drives a watchdog as its loop would: a check every CHECK_PERIOD on a manual clock."""

    def __init__(self, activity: Activity, settings: HealthCheckConfig = SEED, metrics=None):
        self.clock = VirtualClock()
        self.machine = HealthStateMachine(self.clock)
        self.machine.fire(Event.HEALTH_UP, "up")
        self.changes: list[ServingChange] = []
        self.watchdog = ServingWatchdog(
            settings, activity, self.machine, self.changes.append, metrics=metrics, clock=self.clock
        )
        self.activity = activity
        self.watchdog.check()

    def run(self, seconds: float, each=lambda: None) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end - 1e-9:
            self.clock.now = round(self.clock.now + CHECK_PERIOD, 6)
            each()
            self.watchdog.check()


def test_requests_in_flight_without_progress_leave_rotation_after_stall_timeout():
    ticker = Ticker(Activity(in_flight=12))
    ticker.run(SEED.stall_timeout - 0.3)
    assert ticker.watchdog.serving and ticker.changes == []
    ticker.run(0.4)
    assert ticker.watchdog.state is Serving.STALLED
    assert ticker.watchdog.not_serving_reason == "no progress for 2.0 s with 12 requests in flight"
    assert ticker.machine.state is Health.NORMAL  # out of the routers, not yet to be killed
    assert [c.after for c in ticker.changes] == [Serving.STALLED]


def test_progress_brings_a_stalled_engine_back_at_once():
    ticker = Ticker(Activity(in_flight=2))
    ticker.run(4)
    assert ticker.watchdog.state is Serving.STALLED
    ticker.activity.count += 1
    ticker.run(CHECK_PERIOD)
    assert ticker.watchdog.serving and ticker.watchdog.not_serving_reason == ""
    assert [c.after for c in ticker.changes] == [Serving.STALLED, Serving.SERVING]


def test_a_stall_lasting_stall_kill_after_is_abnormal_and_recovery_undoes_it():
    ticker = Ticker(Activity(in_flight=3))
    ticker.run(SEED.stall_kill_after - 0.5)
    assert ticker.machine.state is Health.NORMAL
    ticker.run(0.6)
    assert ticker.machine.state is Health.ABNORMAL
    assert ticker.machine.reason.startswith("no progress for 10.")
    assert "stall_kill_after 10 s" in ticker.machine.reason and "3 requests in flight" in ticker.machine.reason
    ticker.activity.in_flight = 0  # clients gave up: still stalled, still counting
    ticker.watchdog.probe_succeeded()
    assert ticker.watchdog.serving and ticker.machine.state is Health.NORMAL


def test_an_idle_engine_is_never_stalled():
    ticker = Ticker(Activity(in_flight=0))
    ticker.run(120)
    assert ticker.watchdog.serving and ticker.changes == []


def test_a_long_prefill_making_progress_never_leaves_rotation():
    """One 30 s chunked prefill: no token before the end, but a scheduler step every 50 ms."""
    ticker = Ticker(Activity(in_flight=1))

    def step():
        ticker.activity.count += 1

    ticker.run(30, each=step)
    assert ticker.watchdog.serving and ticker.changes == []


def test_a_deep_queue_draining_slowly_never_leaves_rotation():
    """200 requests queued behind one slow step each 1.5 s (below stall_timeout)."""
    ticker = Ticker(Activity(in_flight=200))
    ticks = [0]

    def slow_step():
        ticks[0] += 1
        if ticks[0] % round(1.5 / CHECK_PERIOD) == 0:
            ticker.activity.count += 1
            ticker.activity.in_flight -= 1

    ticker.run(60, each=slow_step)
    assert ticker.watchdog.serving and ticker.changes == []


def test_an_engine_without_a_progress_source_is_never_called_stalled():
    ticker = Ticker(Activity(in_flight=5, progress=None))
    ticker.run(60)
    assert ticker.watchdog.serving


def test_failed_requests_with_none_succeeding_leave_rotation():
    ticker = Ticker(Activity(in_flight=1))
    ticker.activity.outcomes = (0, FAILED_IN_A_ROW - 1)
    ticker.run(CHECK_PERIOD)
    assert ticker.watchdog.serving
    ticker.activity.outcomes = (0, FAILED_IN_A_ROW)
    ticker.activity.count += 1  # failing fast is still "progress": the outcomes decide
    ticker.run(CHECK_PERIOD)
    assert ticker.watchdog.state is Serving.FAILING
    assert ticker.watchdog.not_serving_reason == (
        f"{FAILED_IN_A_ROW} client requests in a row failed with a server error and none succeeded"
    )
    ticker.activity.outcomes = (1, FAILED_IN_A_ROW)
    ticker.run(CHECK_PERIOD)
    assert ticker.watchdog.serving


def test_a_success_in_between_resets_the_failures():
    ticker = Ticker(Activity())
    for outcomes in ((0, 2), (1, 2), (1, 4)):
        ticker.activity.outcomes = outcomes
        ticker.run(CHECK_PERIOD)
    assert ticker.watchdog.serving


def test_failing_for_stall_kill_after_is_abnormal():
    ticker = Ticker(Activity())
    ticker.activity.outcomes = (0, 10)
    ticker.run(CHECK_PERIOD)
    assert ticker.watchdog.state is Serving.FAILING
    ticker.run(SEED.stall_kill_after + CHECK_PERIOD)
    assert ticker.machine.state is Health.ABNORMAL and "client requests failing" in ticker.machine.reason


def test_metrics_follow_the_watchdog():
    registry = CollectorRegistry()
    ticker = Ticker(Activity(in_flight=1), metrics=EngineServerMetrics(registry))
    value = registry.get_sample_value
    assert value("motor_engine_server_not_serving", {"cause": "stalled"}) == 0
    ticker.run(SEED.stall_timeout + CHECK_PERIOD)
    assert value("motor_engine_server_not_serving", {"cause": "stalled"}) == 1
    assert value("motor_engine_server_serving_changes_total", {"to": "stalled"}) == 1
    ticker.activity.count += 1
    ticker.run(CHECK_PERIOD)
    assert value("motor_engine_server_not_serving", {"cause": "stalled"}) == 0
    assert value("motor_engine_server_serving_changes_total", {"to": "serving"}) == 1


def test_stall_settings_are_validated():
    with pytest.raises(ValidationError, match="stall_kill_after"):
        HealthCheckConfig(stall_timeout=5, stall_kill_after=2)
    with pytest.raises(ValidationError, match="stall_timeout"):
        HealthCheckConfig(stall_timeout=0)
    defaults = HealthCheckConfig()
    assert (defaults.stall_timeout, defaults.stall_kill_after) == (2.0, 10.0)


# ------------------------------------------------------------------ vLLM's request outcomes


@pytest.mark.parametrize(
    "path, request_id, status, counted",
    [
        ("/v1/completions", "client-1", 200, (1, 0)),
        ("/v1/chat/completions", "", 500, (0, 1)),
        ("/v1/completions", "client-2", 503, (0, 0)),  # draining, sleeping: on purpose
        ("/v1/completions", "client-3", 400, (0, 0)),  # the request's own fault
        ("/health", "", 500, (0, 0)),  # not inference
        ("/v1/completions", "probe", 500, (0, 0)),  # a probe is no client request
    ],
)
async def test_the_vllm_middleware_counts_how_client_inference_requests_end(path, request_id, status, counted):
    from engine_server.engines.admission import Admission
    from engine_server.engines.base import probe_request_id
    from engine_server.engines.vllm_admission import AdmissionMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(message):
        sent.append(message)

    rid = probe_request_id(1) if request_id == "probe" else request_id
    headers = [(b"x-request-id", rid.encode())] if rid else []
    middleware = AdmissionMiddleware(app, Admission())
    await middleware({"type": "http", "method": "POST" if path != "/health" else "GET", "path": path,
                      "headers": headers}, None, send)  # fmt: skip
    assert sent[0]["status"] == status
    assert (middleware.outcomes.succeeded, middleware.outcomes.failed) == counted


def test_the_stall_clock_starts_at_the_first_reading_not_at_construction():
    """The watchdog is made before the engine loads (vLLM: tens of seconds): requests already in
    flight at its first reading have had no time to stall."""
    clock = VirtualClock()
    machine = HealthStateMachine(clock)
    machine.fire(Event.HEALTH_UP, "up")
    watchdog = ServingWatchdog(SEED, Activity(in_flight=4), machine, clock=clock)
    clock.now += 60  # loading
    watchdog.check()
    assert watchdog.serving
    clock.now += SEED.stall_timeout
    watchdog.check()
    assert watchdog.state is Serving.STALLED
