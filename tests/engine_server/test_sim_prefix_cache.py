"""The simulated engine's prefix cache: blocks, LRU eviction, hits, its KV events (vLLM's wire
format, read back by a real ZMQ subscriber), and a prefill that pays only for uncached tokens."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import zmq
import zmq.asyncio

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from engine_server.engines.sim_prefix_cache import SimPrefixCache
from motor.contract.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode
from motor.ports import free_port


def cache(capacity: int):
    published: list = []
    return SimPrefixCache(capacity, published.extend, ("m", "0")), published


def test_a_repeated_prefix_hits_its_full_blocks_and_events_say_what_was_stored():
    prefix, events = cache(10)
    prompt = list(range(40))  # two full blocks and 8 tokens
    assert prefix.lookup(prompt) == 0
    prefix.store(prompt)
    stored = events[0]
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.token_ids == list(range(32)) and len(stored.block_hashes) == 2 and stored.block_size == 16
    assert prefix.lookup(list(range(40)) + [99] * 10) == 32  # the same two blocks
    assert prefix.lookup([7] + list(range(1, 40))) == 0  # one token differs in the first block: nothing
    assert prefix.lookup(list(range(32))) == 16  # wholly cached: the last block is computed again
    prefix.store(list(range(48)))  # the third block follows the two cached: its parent is the second
    assert events[1].parent_block_hash == stored.block_hashes[1] and events[1].token_ids == list(range(32, 48))
    assert prefix.queried == 40 + 50 + 40 + 32 and prefix.hit == 32 + 16


def test_the_least_recently_used_blocks_are_evicted_and_published_removed():
    prefix, events = cache(4)
    a, b, c = ([n] * 32 for n in (1, 2, 3))  # two blocks each
    prefix.store(a)
    prefix.store(b)
    prefix.lookup(a)
    prefix.store(a)  # a used again: b is now the least recently used
    prefix.store(c)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and set(removed[0].block_hashes) == set(prefix.hashes(b))
    assert len(prefix) == 4 and prefix.lookup(a + [0]) == 32 and prefix.lookup(b + [0]) == 0
    prefix.clear()
    assert len(prefix) == 0 and isinstance(events[-1], AllBlocksCleared)


def test_an_adapters_blocks_are_its_own():
    prefix, _ = cache(10)
    prefix.store([5] * 32, adapter="lora-a")
    assert prefix.lookup([5] * 33) == 0 and prefix.lookup([5] * 33, adapter="lora-a") == 32


def test_no_capacity_caches_nothing():
    prefix, events = cache(0)
    prefix.store([1] * 32)
    assert prefix.lookup([1] * 33) == 0 and events == []


@pytest.fixture
async def engine():
    port, events_port = free_port(), free_port()
    args = {"model": "tiny", "kv_cache_blocks": 64, "kv_events_port": events_port, "prefill_ms_per_token": 2}
    sim = SimEngine(EngineOptions(role="union", instance_id="u", dp_rank=0, host="127.0.0.1", port=port,
                                  master_dp_ip="127.0.0.1", engine_args=args))  # fmt: skip
    await sim.start()
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(f"tcp://127.0.0.1:{events_port}")
    await asyncio.sleep(0.3)  # (a SUB socket joins a moment after it connects)
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
        yield sim, session, subscriber
    subscriber.close(0)
    context.term()
    await sim.shutdown()


async def timed(session, prompt: str) -> float:
    began = time.monotonic()
    async with session.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as response:
        assert response.status == 200
        await response.read()
    return time.monotonic() - began


async def test_a_cached_prefix_is_not_prefilled_again_and_its_events_go_out_on_zmq(engine):
    sim, session, subscriber = engine
    system = " ".join(f"rule{n}" for n in range(160))  # 160 tokens: 10 blocks, 0.32 s to prefill
    cold = await timed(session, system + " first question")
    warm = await timed(session, system + " second question")
    assert cold >= 0.3 and warm < cold / 3, (cold, warm)  # only the 2 new tokens are prefilled
    assert sim.prefix.hit == 160 and sim.prefix.queried == 324
    seq, batch = decode(await asyncio.wait_for(subscriber.recv_multipart(), 5))
    assert seq == 0 and isinstance(batch.events[0], BlockStored) and len(batch.events[0].block_hashes) == 10
    async with session.get("/metrics") as response:
        text = await response.text()
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 160.0' in text
    async with session.post("/reset_prefix_cache") as response:  # (vLLM's endpoint)
        assert response.status == 200
    assert len(sim.prefix) == 0 and await timed(session, system + " third") >= 0.3
