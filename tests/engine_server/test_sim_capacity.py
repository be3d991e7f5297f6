"""The simulated engine's capacity: `max_num_seqs` requests are served at once and the rest wait,
as vLLM's scheduler does; /metrics shows vllm:num_requests_running, vllm:num_requests_waiting and
vllm:kv_cache_usage_perc with vLLM's names, counting probes as vLLM counts every request."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from engine_server.probing import probe_request
from motor.ports import free_port


@pytest.fixture
async def sim():
    port = free_port()
    args = {"model": "cap-model", "latency_ms": 400, "max_num_seqs": 2}
    engine = SimEngine(
        EngineOptions(role="union", instance_id="cap", dp_rank=0, host="127.0.0.1", port=port,
                      master_dp_ip="127.0.0.1", engine_args=args)
    )  # fmt: skip
    await engine.start()
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
        yield engine, session
    await engine.shutdown()


async def complete(session, **headers) -> float:
    began = time.monotonic()
    async with session.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=headers) as r:
        assert r.status == 200
    return time.monotonic() - began


CAPACITY_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


async def vllm_series(session) -> dict[str, float]:
    """The capacity's series (the engine's other vLLM series, latencies and tokens, are not these)."""
    async with session.get("/metrics") as response:
        text = await response.text()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name in CAPACITY_SERIES and s.labels.get("model_name") == "cap-model"
    }


async def test_requests_beyond_max_num_seqs_wait_and_are_counted_as_vllm_counts_them(sim):
    engine, session = sim
    requests = [asyncio.create_task(complete(session)) for _ in range(5)]
    await asyncio.sleep(0.2)
    assert await vllm_series(session) == {
        "vllm:num_requests_running": 2,
        "vllm:num_requests_waiting": 3,
        "vllm:kv_cache_usage_perc": 1.0,
    }
    assert engine.in_flight_requests() == 5  # the controller's signal: running + waiting
    took = sorted(await asyncio.gather(*requests))
    # Two at a time, 0.4 s each: the fifth waits for two rounds before its own.
    assert took[0] < 0.8 and took[-1] >= 1.1
    assert await vllm_series(session) == {
        "vllm:num_requests_running": 0,
        "vllm:num_requests_waiting": 0,
        "vllm:kv_cache_usage_perc": 0.0,
    }


async def test_a_probe_takes_a_seat_like_any_request(sim):
    engine, session = sim
    probe = asyncio.create_task(complete(session, **probe_request("union")[1]))
    await asyncio.sleep(0.1)
    series = await vllm_series(session)
    assert series["vllm:num_requests_running"] == 1 and series["vllm:kv_cache_usage_perc"] == 0.5
    assert engine.in_flight_requests() == 0  # the engine server's own count leaves probes out
    await probe


def test_max_num_seqs_must_be_positive():
    from engine_server.engines.sim import SimArgs

    with pytest.raises(ValueError, match="max_num_seqs"):
        SimArgs.model_validate({"max_num_seqs": 0})
    assert SimArgs().max_num_seqs == 256  # vLLM's default
