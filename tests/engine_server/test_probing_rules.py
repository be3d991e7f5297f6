"""The prober's and the status machine's rules, one at a time, with injected clocks (in-process).

Written to kill the mutants `make mutation` found surviving: each test pins one rule a user relies
on (what a probe record says, when a failure counts, what is logged, what the status says)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from engine_server.engines.base import UtilizationSampler
from engine_server.metrics import EngineServerMetrics
from engine_server.probing import PeakSampler, ProbeFailed, ProbeRecord
from engine_server.status import Event, Health, HealthStateMachine, Transition
from tests.support.probing_fakes import (
    NO_WAIT,
    SETTINGS,
    FixedSampler,
    Progress,
    ScriptedClient,
    ScriptedHealth,
    make_prober,
)


class Clock:
    """A wall clock that moves only when told to (all the status machine reads)."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def time(self) -> float:
        return self.now


# ------------------------------------------------------------------ status machine


def test_a_new_machine_is_init_alive_and_dated():
    clock = Clock(1234.5)
    machine = HealthStateMachine(clock=clock)
    assert machine.state is Health.INIT and machine.dead is False and machine.changed_at == 1234.5
    assert machine.reason == "starting: waiting for the inference plane's GET /health to answer"


def test_listeners_get_the_event_and_the_time_of_each_transition():
    clock = Clock(10.0)
    machine = HealthStateMachine(clock=clock)
    seen: list[Transition] = []
    machine.on_transition(seen.append)
    clock.now = 12.0
    assert machine.fire(Event.HEALTH_UP, "up")
    assert seen == [Transition(Health.INIT, Health.NORMAL, Event.HEALTH_UP, "up", 12.0)]
    assert machine.changed_at == 12.0


def test_a_new_state_with_the_same_reason_text_is_still_a_change():
    machine = HealthStateMachine()
    assert machine.fire(Event.HEALTH_UP, machine.reason)
    assert machine.state is Health.NORMAL


def test_a_new_reason_in_the_same_state_is_a_change_and_a_repeat_is_not():
    machine = HealthStateMachine()
    seen = []
    machine.on_transition(seen.append)
    machine.fire(Event.HEALTH_UP, "up")
    machine.fire(Event.FAILURE_LIMIT, "3 probes failed")
    # ABNORMAL -> ABNORMAL with a new reason (the engine died): reported.
    assert machine.fire(Event.ENGINE_DIED, "engine core exited with 1")
    assert machine.state is Health.ABNORMAL and machine.reason == "engine core exited with 1" and machine.dead
    assert len(seen) == 3


def test_death_with_the_current_reason_is_final_but_no_news():
    machine = HealthStateMachine()
    seen = []
    machine.fire(Event.HEALTH_UP, "up")
    machine.fire(Event.FAILURE_LIMIT, "gone")
    machine.on_transition(seen.append)
    assert not machine.fire(Event.ENGINE_DIED, "gone")  # same state, same reason: nothing to tell
    assert seen == [] and machine.dead
    assert not machine.fire(Event.PROBE_SUCCEEDED, "a late probe")
    assert machine.state is Health.ABNORMAL


def test_abnormal_is_logged_as_a_warning_and_the_rest_as_info(caplog):
    caplog.set_level(logging.INFO, logger="engine_server.status")
    machine = HealthStateMachine()
    machine.fire(Event.HEALTH_UP, "up")
    machine.fire(Event.FAILURE_LIMIT, "3 probes failed")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "status INIT -> NORMAL (health_up): up"),
        ("WARNING", "status NORMAL -> ABNORMAL (failure_limit): 3 probes failed"),
    ]


# ------------------------------------------------------------------ one probe round


async def test_a_record_says_when_it_was_sent_and_how_long_the_probe_took():
    prober, _, records = make_prober(FixedSampler(0))
    ticks = iter([100.0, 100.25])
    prober.clock = SimpleNamespace(time=lambda: 1700000000.0, monotonic=lambda: next(ticks))
    assert prober.last is None
    record = await prober.probe_once()
    assert record.time == 1700000000.0 and record.latency == pytest.approx(0.25)
    assert record.success and record.error == ""
    assert prober.last is record and records == [record]


@pytest.mark.parametrize("outcome", ["ProbeFailed", "timeout", "bug"])
async def test_a_failed_probe_has_its_latency_and_reason(outcome, caplog):
    class Client:
        async def probe(self):
            if outcome == "ProbeFailed":
                raise ProbeFailed("HTTP 500: boom")
            if outcome == "timeout":
                await asyncio.sleep(3600)
            raise RuntimeError("boom")

    settings = SETTINGS.model_copy(update={"probe_timeout": 0.05})
    prober, _, _ = make_prober(FixedSampler(0), Client(), settings=settings)
    ticks = iter([100.0, 100.5])
    prober.clock = SimpleNamespace(time=time.time, monotonic=lambda: next(ticks))
    record = await prober.probe_once()
    assert not record.success and record.latency == pytest.approx(0.5)
    assert record.error == {"ProbeFailed": "HTTP 500: boom", "timeout": "timed out after 0.05s",
                            "bug": "RuntimeError: boom"}[outcome]  # fmt: skip
    bugs = [r for r in caplog.records if r.getMessage() == "probe client raised"]
    assert len(bugs) == (outcome == "bug") and all(r.exc_info for r in bugs)


async def test_a_failure_at_exactly_the_idle_threshold_does_not_count():
    client = ScriptedClient()
    client.fail = "HTTP 500"
    prober, _, _ = make_prober(FixedSampler(SETTINGS.npu_usage_threshold), client)
    record = await prober.probe_once()
    assert not record.counted and record.consecutive_failures == 0


async def test_recovery_says_why():
    client = ScriptedClient()
    client.fail = "HTTP 500"
    prober, machine, _ = make_prober(FixedSampler(0), client)
    for _ in range(SETTINGS.max_failure_count):
        await prober.probe_once()
    assert machine.state is Health.ABNORMAL
    client.fail = None
    await prober.probe_once()
    assert machine.state is Health.NORMAL and machine.reason == "virtual-inference probes succeed again"


async def test_failed_probes_are_logged_with_whether_they_counted(caplog):
    caplog.set_level(logging.INFO, logger="engine_server.probing")
    client = ScriptedClient()
    sampler = FixedSampler(1, 95)
    prober, _, _ = make_prober(sampler, client, settings=SETTINGS.model_copy(update={"utilization_window": 0.5}))
    await prober.probe_once()  # a success logs nothing
    client.fail = "HTTP 500"
    sampler.calls = 0
    sampler.values = [1]
    await prober.probe_once()
    sampler.values = [95]
    await prober.probe_once()
    assert [r.getMessage() for r in caplog.records if r.name == "engine_server.probing"] == [
        "probe failed (HTTP 500; peak 1%, counted, 1 consecutive)",
        "probe failed (HTTP 500; peak 95%, not counted: accelerator busy, 1 consecutive)",
    ]


async def test_a_round_longer_than_the_interval_starts_the_next_at_once():
    sleeps = []
    now = [0.0]

    async def fake_sleep(seconds):
        sleeps.append(seconds)
        raise asyncio.CancelledError

    def monotonic():
        now[0] += 4.0  # every reading moves the clock on: the round outlasts the 5 s interval
        return now[0]

    prober, _, _ = make_prober(FixedSampler(0))
    prober.clock = SimpleNamespace(time=time.time, monotonic=monotonic, sleep=fake_sleep)
    prober.interval = 5.0
    with pytest.raises(asyncio.CancelledError):
        await prober.run()
    assert sleeps == [0.0]


# ------------------------------------------------------------------ utilization peak


async def test_samples_are_spaced_by_the_period_without_a_trailing_sleep():
    sleeps = []

    async def record_sleep(seconds):
        sleeps.append(seconds)

    sampler = FixedSampler(5, 50, 7)
    assert await PeakSampler(sampler, 1.5, 0.5, clock=SimpleNamespace(sleep=record_sleep)).peak() == 50
    assert sampler.calls == 3 and sleeps == [0.5, 0.5]


async def test_a_window_of_one_period_takes_one_sample():
    sampler = FixedSampler(5)
    await PeakSampler(sampler, 0.5, 0.5, clock=NO_WAIT).peak()
    assert sampler.calls == 1


async def test_a_broken_sampler_is_reported_once(caplog):
    class Broken(UtilizationSampler):
        name = "broken"

        async def sample(self) -> float:
            raise RuntimeError("no driver")

    peak = PeakSampler(Broken(), 1, 0.5, clock=NO_WAIT)
    assert await peak.peak() == 0.0 and await peak.peak() == 0.0
    assert [r.getMessage() for r in caplog.records if r.name == "engine_server.probing"] == [
        "utilization sampler broken failed: no driver (counting as 0%)"
    ]


# ------------------------------------------------------------------ GET /health in the prober


async def test_a_round_that_fails_on_health_records_why_when_and_how_long():
    health = ScriptedHealth()
    health.problem = "GET /health answered 503"
    client = ScriptedClient()
    prober, machine, records = make_prober(FixedSampler(95), client)
    prober.health = health
    prober.interval = SETTINGS.busy_probe_interval  # a busy engine stops answering /health
    ticks = iter([100.0, 100.5, 200.0, 200.25, 300.0, 300.75])
    prober.clock = SimpleNamespace(time=lambda: 1700000000.0, monotonic=lambda: next(ticks))
    record = await prober.probe_once()
    assert record == ProbeRecord(
        time=1700000000.0, success=False, latency=0.5, error="GET /health answered 503", utilization_peak=0.0,
        next_interval=SETTINGS.probe_interval, consecutive_failures=1, counted=True, status=Health.NORMAL,
    )  # fmt: skip
    assert prober.interval == SETTINGS.probe_interval and records == [record] and client.calls == 0
    await prober.probe_once()
    record = await prober.probe_once()
    assert record.consecutive_failures == 3 and record.status is Health.ABNORMAL
    assert record.latency == pytest.approx(0.75)


async def test_failed_health_checks_are_logged_with_the_count(caplog):
    caplog.set_level(logging.INFO, logger="engine_server.probing")
    health = ScriptedHealth()
    prober, _, _ = make_prober(FixedSampler(0))
    prober.health = health
    health.problem = "GET /health answered 503"
    await prober.check_health_once()
    health.problem = "GET /health timed out after 2s"
    await prober.probe_once()
    assert [r.getMessage() for r in caplog.records if r.name == "engine_server.probing"] == [
        "health check failed (GET /health answered 503; 1 consecutive)",
        "health check failed (GET /health timed out after 2s; 2 consecutive)",
    ]


async def test_the_failure_gauge_follows_health_checks():
    registry = CollectorRegistry()
    health = ScriptedHealth()
    prober, _, _ = make_prober(FixedSampler(0), metrics=EngineServerMetrics(registry))
    prober.health = health
    health.problem = "GET /health answered 503"
    await prober.check_health_once()
    await prober.check_health_once()
    assert registry.get_sample_value("motor_engine_server_consecutive_failures") == 2
    health.problem = None
    await prober.check_health_once()
    assert registry.get_sample_value("motor_engine_server_consecutive_failures") == 0


async def test_a_200_from_health_does_not_clear_failed_probes():
    """/health answering says the server is up, not that inference works: once a counted probe
    failure follows failed health checks, only a successful probe brings the engine back."""
    health, client = ScriptedHealth(), ScriptedClient()
    prober, machine, _ = make_prober(FixedSampler(0), client)
    prober.health = health
    health.problem = "GET /health answered 503"
    await prober.probe_once()
    await prober.probe_once()
    health.problem = None
    client.fail = "HTTP 500"
    await prober.probe_once()
    assert machine.state is Health.ABNORMAL and machine.reason.startswith("3 consecutive virtual-inference probes")
    reason = machine.reason
    await prober.check_health_once()  # probing paused: /health alone answers 200
    assert machine.state is Health.ABNORMAL and machine.reason == reason and prober.consecutive_failures == 3


async def test_run_health_checks_start_to_start_every_probe_interval():
    health = ScriptedHealth()
    sleeps = []
    now = [0.0]

    async def fake_sleep(seconds):
        sleeps.append(seconds)
        raise asyncio.CancelledError

    def monotonic():
        now[0] += 4.5  # every reading moves the clock on: a check takes 4.5 s of the 5 s interval
        return now[0]

    prober, _, _ = make_prober(FixedSampler(0))
    prober.health = health
    prober.clock = SimpleNamespace(time=time.time, monotonic=monotonic, sleep=fake_sleep)
    with pytest.raises(asyncio.CancelledError):
        await prober.run_health_checks()
    assert health.calls == 1 and sleeps == [0.5]


# ------------------------------------------------------------------ why a failure counted


async def test_a_progress_source_that_stops_answering_leaves_the_judgement_to_utilization(caplog):
    """Progress that cannot be read (None) is not progress: the log must not claim the engine moved."""
    caplog.set_level(logging.INFO, logger="engine_server.probing")
    readings = iter([5, None, None, 7])
    client = ScriptedClient()
    client.fail = "HTTP 500"
    prober, _, _ = make_prober(FixedSampler(95), client, progress=lambda: next(readings))
    assert not (await prober.probe_once()).counted  # 5 then None
    assert not (await prober.probe_once()).counted  # None then 7
    assert [r.getMessage() for r in caplog.records if r.name == "engine_server.probing"] == [
        "probe failed (HTTP 500; peak 95%, not counted: accelerator busy, 0 consecutive)",
    ] * 2


async def test_failures_at_exactly_the_idle_threshold_without_progress_say_no_progress():
    client, progress = ScriptedClient(), Progress()
    client.fail = "HTTP 500"
    threshold = SETTINGS.npu_usage_threshold
    prober, machine, _ = make_prober(FixedSampler(threshold), client, progress=progress)
    for _ in range(SETTINGS.max_failure_count):
        await prober.probe_once()
    assert machine.state is Health.ABNORMAL and machine.reason == (
        "3 consecutive virtual-inference probes failed while the engine made no progress (no tokens or scheduler "
        f"steps) although utilization peaked at {threshold:.0f}%; last error: HTTP 500"
    )
