"""Probing logic in-process: interval rule, failure counting, busy engines, the probe request."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from engine_server.engines.base import UtilizationSampler, is_probe_request_id, probe_token
from engine_server.metrics import EngineServerMetrics
from engine_server.probing import HttpProbeClient, PeakSampler, ProbeFailed, probe_request
from engine_server.status import Health
from tests.support.probing_fakes import (
    NO_WAIT,
    SETTINGS,
    FixedSampler,
    Progress,
    ScriptedClient,
    ScriptedHealth,
    make_prober,
    serve_completions,
)


@pytest.mark.parametrize(
    "peak, before, after",
    [(0, 20, 5), (2.9, 20, 5), (3, 20, 20), (50, 5, 5), (50, 20, 20), (79.9, 5, 5), (80, 5, 20), (100, 5, 20)],
)
def test_interval_rule(peak, before, after):
    prober, _, _ = make_prober(FixedSampler(0))
    prober.interval = before
    assert prober.next_interval(peak) == after


async def test_idle_failures_count_to_abnormal_and_a_success_resets():
    client = ScriptedClient()
    prober, machine, records = make_prober(FixedSampler(1), client)
    client.fail = "HTTP 500"
    for expected in (1, 2):
        record = await prober.probe_once()
        assert record.counted and record.consecutive_failures == expected and record.status is Health.NORMAL
    record = await prober.probe_once()
    assert record.consecutive_failures == 3 and record.status is Health.ABNORMAL
    assert "3 consecutive" in machine.reason and "HTTP 500" in machine.reason
    client.fail = None
    record = await prober.probe_once()
    assert record.success and record.consecutive_failures == 0 and machine.state is Health.NORMAL
    assert len(records) == 4


async def test_a_success_in_between_restarts_the_count():
    client = ScriptedClient()
    prober, machine, _ = make_prober(FixedSampler(0), client)
    for fail in ("x", "x", None, "x", "x"):
        client.fail = fail
        await prober.probe_once()
    assert prober.consecutive_failures == 2 and machine.state is Health.NORMAL


async def test_busy_accelerator_with_failing_probes_never_turns_abnormal():
    client = ScriptedClient()
    client.fail = "timed out"
    prober, machine, _ = make_prober(FixedSampler(95), client)
    for _ in range(50):
        record = await prober.probe_once()
        assert not record.counted and record.next_interval == 20
    assert machine.state is Health.NORMAL and prober.consecutive_failures == 0


async def test_a_busy_reading_without_progress_is_a_hang_and_counts():
    """A kernel spinning in a hung collective reads near 100 %: with the engine's progress known,
    failures count unless it produced something since the previous round."""
    client, progress = ScriptedClient(), Progress()
    client.hang = True
    prober, machine, _ = make_prober(FixedSampler(95), client, progress=progress)
    for expected in (1, 2, 3):
        record = await prober.probe_once()
        assert record.counted and record.consecutive_failures == expected
    assert machine.state is Health.ABNORMAL
    assert "made no progress" in machine.reason and "95%" in machine.reason and "timed out" in machine.reason


async def test_a_long_request_making_progress_excuses_failed_probes():
    """A long prefill keeps probes waiting, but its steps move the engine on: not a failure."""
    client, progress = ScriptedClient(), Progress()
    client.fail = "timed out after 0.2s"

    class Stepping(FixedSampler):
        async def sample(self) -> float:
            progress.count += 1  # steps complete while the window is sampled
            return await super().sample()

    prober, machine, _ = make_prober(Stepping(95), client, progress=progress)
    for _ in range(10):
        record = await prober.probe_once()
        assert not record.counted and record.consecutive_failures == 0
    assert machine.state is Health.NORMAL


async def test_progress_between_rounds_counts_for_the_next_round():
    client, progress = ScriptedClient(), Progress()
    client.fail = "HTTP 500"
    prober, _, _ = make_prober(FixedSampler(95), client, progress=progress)
    assert (await prober.probe_once()).counted  # nothing moved during the first round
    progress.count += 5  # tokens produced while waiting for the next round
    assert not (await prober.probe_once()).counted
    assert (await prober.probe_once()).counted  # nothing since


async def test_progress_never_excuses_a_failure_on_an_idle_accelerator():
    client, progress = ScriptedClient(), Progress()
    client.fail = "HTTP 500"
    prober, _, _ = make_prober(FixedSampler(1), client, progress=progress)
    progress.count += 1
    assert (await prober.probe_once()).counted


async def test_peak_over_the_window_decides_not_the_last_sample():
    # Idle at the end of the window, but busy during it: the failure must not count.
    client = ScriptedClient()
    client.fail = "slow"
    sampler = FixedSampler(90, 40, 1, 1, 1, 1)
    prober, _, _ = make_prober(sampler, client)
    record = await prober.probe_once()
    assert record.utilization_peak == 90 and not record.counted
    assert sampler.calls == 6  # 3 s window / 0.5 s period


async def test_probe_timeout_is_a_failure_with_the_reason():
    client = ScriptedClient()
    client.hang = True
    prober, _, _ = make_prober(FixedSampler(0), client)
    record = await prober.probe_once()
    assert not record.success and "timed out after 0.2s" in record.error and record.counted


async def test_a_broken_sampler_counts_as_idle():
    class Broken(UtilizationSampler):
        name = "broken"

        async def sample(self) -> float:
            raise RuntimeError("no driver")

    assert await PeakSampler(Broken(), 1, 0.5, clock=NO_WAIT).peak() == 0.0


async def test_run_probes_start_to_start_every_interval():
    sleeps = []
    now = [0.0]

    async def fake_sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) >= 3:
            raise asyncio.CancelledError

    def monotonic():
        now[0] += 0.25  # every reading of the clock moves it on
        return now[0]

    prober, _, _ = make_prober(FixedSampler(0))
    prober.clock = SimpleNamespace(time=time.time, monotonic=monotonic, sleep=fake_sleep)
    with pytest.raises(asyncio.CancelledError):
        await prober.run()
    assert all(0 < s < 5 for s in sleeps)  # the round's own time is taken off the interval


async def test_metrics_follow_the_probes():
    registry = CollectorRegistry()
    metrics = EngineServerMetrics(registry)
    client = ScriptedClient()
    prober, _, _ = make_prober(FixedSampler(0), client, metrics=metrics)
    await prober.probe_once()
    client.fail = "x"
    await prober.probe_once()
    value = registry.get_sample_value
    assert value("motor_engine_server_probes_total", {"outcome": "success"}) == 1
    assert value("motor_engine_server_probes_total", {"outcome": "failure"}) == 1
    assert value("motor_engine_server_probe_counted_failures_total") == 1
    assert value("motor_engine_server_probe_latency_seconds_count") == 2
    assert value("motor_engine_server_probe_interval_seconds") == 5
    assert value("motor_engine_server_consecutive_failures") == 1


def test_probe_request_shape():
    body, headers = probe_request("prefill", now=1700000000.5)
    assert body == {"prompt": "1", "max_tokens": 1}
    assert headers == {"X-Request-Id": f"1700000000500-{probe_token()}_virtual"}
    assert is_probe_request_id(f"cmpl-{headers['X-Request-Id']}-0")
    # A client's id is never taken for a probe, whatever it ends with.
    assert not is_probe_request_id("1700000000500_virtual") and not is_probe_request_id("cmpl-order_virtual-0")
    decode, _ = probe_request("decode")
    assert decode["kv_transfer_params"]["do_virtual"] is True
    assert decode["kv_transfer_params"]["do_remote_prefill"] is False


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_http_probe_client_sends_the_probe_and_checks_the_answer(role):
    seen = []
    answer = {"status": 200, "body": {"choices": [{"text": "x"}]}}

    async def completions(request):
        seen.append((request.headers.get("X-Request-Id"), await request.json()))
        return web.json_response(answer["body"], status=answer["status"])

    url, runner = await serve_completions(completions)
    client = HttpProbeClient(url, role, timeout=2)
    try:
        await client.probe()
        request_id, body = seen[0]
        assert re.fullmatch(rf"\d+-{probe_token()}_virtual", request_id)
        assert body["prompt"] == "1" and body["max_tokens"] == 1
        assert ("kv_transfer_params" in body) == (role == "decode")
        answer.update(status=500, body={"error": "boom"})
        with pytest.raises(ProbeFailed, match="HTTP 500"):
            await client.probe()
        answer.update(status=200, body={"choices": []})
        with pytest.raises(ProbeFailed, match="no choices"):
            await client.probe()
    finally:
        await client.close()
        await runner.cleanup()
    with pytest.raises(ProbeFailed, match="Connect"):
        refused = HttpProbeClient(url, role, timeout=2)
        try:
            await refused.probe()
        finally:
            await refused.close()


async def test_failed_health_checks_count_to_abnormal_and_a_200_recovers():
    """While nothing probes, GET /health alone is checked for the engine's whole life."""
    health = ScriptedHealth()
    prober, machine, _ = make_prober(FixedSampler(0))
    changes = []
    prober.health, prober.on_health_check = health, lambda: changes.append(machine.state)
    await prober.check_health_once()
    assert changes == [] and prober.consecutive_failures == 0  # a 200 on a healthy engine: no news
    health.problem = "GET /health timed out after 2s"
    for _ in range(SETTINGS.max_failure_count):
        await prober.check_health_once()
    assert machine.state is Health.ABNORMAL and prober.consecutive_failures == 3
    assert machine.reason == "3 consecutive health checks failed: GET /health timed out after 2s"
    health.problem = None
    await prober.check_health_once()
    assert machine.state is Health.NORMAL and machine.reason == "GET /health answers 200 again"
    assert prober.consecutive_failures == 0 and len(changes) == 4


async def test_a_probe_round_checks_health_first_and_does_not_probe_while_it_fails():
    health, client = ScriptedHealth(), ScriptedClient()
    prober, machine, records = make_prober(FixedSampler(95), client)
    prober.health = health
    health.problem = "GET /health answered 503"
    record = await prober.probe_once()
    assert client.calls == 0 and not record.success and record.counted and record.error == "GET /health answered 503"
    client.fail = "HTTP 500"
    health.problem = None
    prober.progress = lambda: None  # judged by utilization alone: a busy reading excuses the probe
    record = await prober.probe_once()
    assert client.calls == 1 and not record.counted and record.consecutive_failures == 1
    health.problem = "GET /health failed: ClientConnectorError"
    await prober.probe_once()
    await prober.probe_once()
    assert machine.state is Health.ABNORMAL and machine.reason == (
        "3 consecutive health checks failed: GET /health failed: ClientConnectorError (probes wait until it answers "
        "200)"
    )
    health.problem = None
    client.fail = None
    assert (await prober.probe_once()).success and machine.state is Health.NORMAL
    assert machine.reason == "virtual-inference probes succeed again"


def test_metric_help_names_the_settings_that_really_apply():
    """The help an operator reads in /metrics must name the timeout the probes use."""
    metrics = EngineServerMetrics(CollectorRegistry())
    latency = metrics.probe_latency._documentation
    assert "probe_timeout" in latency and "health_collector_timeout" not in latency
    assert "scheduler steps" in metrics.counted_failures._documentation
