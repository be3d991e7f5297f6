"""The simulated engine under load (issue 61 #12), in-process on a free port: a long stream leaves
its event loop (the management plane's) free, queued probes of a saturated engine that makes
progress do not count at its default utilization 0, and a request whose client left stops."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import aiohttp
import pytest

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from engine_server.probing import HttpProbeClient, PeakSampler, Prober
from engine_server.status import Event, HealthStateMachine
from motor.contract.user_config import HealthCheckConfig
from motor.ports import free_port


async def started_sim(**args) -> SimEngine:
    engine = SimEngine(
        EngineOptions(role="union", instance_id="load", dp_rank=0, host="127.0.0.1", port=free_port(),
                      master_dp_ip="127.0.0.1", engine_args={"model": "load-model", **args})
    )  # fmt: skip
    await engine.start()
    return engine


@pytest.fixture
async def engines():
    started: list[SimEngine] = []

    async def start(**args) -> SimEngine:
        started.append(await started_sim(**args))
        return started[-1]

    yield start
    for engine in started:
        await engine.shutdown()


def read_stream(port: int, tokens: int, into: list[int]) -> None:
    """A fast client in its own thread (as a router in its own process): it never makes the
    server wait for its socket, so only the server's own yields free its loop."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": "long", "max_tokens": tokens, "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    into.append(sum(len(line) for line in response))
    connection.close()


async def test_a_long_stream_leaves_the_event_loop_free(engines):
    """One stream of 100k tokens to a fast reader: the loop the management plane shares is never
    held for long (it was for seconds: GetStatus went unanswered and the node manager killed it)."""
    engine = await engines()
    received: list[int] = []
    reader = threading.Thread(target=read_stream, args=(engine.options.port, 100_000, received), daemon=True)
    longest, last = 0.0, time.monotonic()
    reader.start()
    while reader.is_alive():
        await asyncio.sleep(0.01)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    assert received and received[0] > 100_000
    assert longest < 0.5, f"the event loop was held {longest:.2f}s by one stream"


async def test_queued_probes_of_a_saturated_engine_making_progress_do_not_count(engines):
    """At its default utilization 0, a sim whose seats are all taken by client requests that make
    progress is busy: a probe that times out in its queue is not counted (all three engines of a
    peak were killed within 7 s)."""
    engine = await engines(max_num_seqs=2, latency_ms=3000)
    settings = HealthCheckConfig(
        enable_virtual_inference=True, probe_timeout=0.5, utilization_window=0.5, utilization_sample_period=0.1
    )
    machine = HealthStateMachine()
    machine.fire(Event.HEALTH_UP, "up")
    client = HttpProbeClient(f"http://127.0.0.1:{engine.options.port}", "union", settings.probe_timeout)
    prober = Prober(
        settings,
        client,
        PeakSampler(engine.utilization_sampler(), settings.utilization_window, settings.utilization_sample_period),
        machine,
        progress=engine.progress,
    )
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{engine.options.port}/v1/completions"
        clients = [asyncio.create_task(session.post(url, json={"prompt": "p", "max_tokens": 2})) for _ in range(2)]
        try:
            while engine.capacity.running < 2:
                await asyncio.sleep(0.01)
            record = await prober.probe_once()
        finally:
            for task in clients:
                task.cancel()
            await client.close()
    assert not record.success, record  # it waited for a seat past its timeout
    assert not record.counted and prober.consecutive_failures == 0, record


async def test_a_request_whose_client_left_stops_and_leaves_the_in_flight_count(engines):
    """A client that gives up (its timeout, a router's retry elsewhere) takes its request out of
    the engine: it no longer holds a seat, nor counts in flight for the autoscaler."""
    engine = await engines(latency_ms=5000)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            await session.post(
                f"http://127.0.0.1:{engine.options.port}/v1/completions",
                json={"prompt": "p", "max_tokens": 2},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
    deadline = time.monotonic() + 1.5
    while engine.in_flight_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert engine.in_flight_requests() == 0 and engine.capacity.running == 0
