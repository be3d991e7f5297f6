"""Per-tenant limits at the front door (front_door/admission.py, front_door/usage.py): requests and
tokens per minute, requests at once, 429 with Retry-After in OpenAI's shape; one tenant's flood
does not starve another."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import openai
import pytest

from front_door.admission import Admission, Refusal, Ticket
from front_door.keys import Limits, Tenant
from front_door.usage import estimate, usage_in
from tests.support.keyed_door import KEYS, StandIn, keyed_door

BODY = {"model": "m", "prompt": "hi", "max_tokens": 4}


def client(door, tenant: str = "acme", **extra) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key=KEYS[tenant], max_retries=0, **extra)


def sample(door, name: str, **labels) -> float:
    return door.metrics.registry.get_sample_value(name, labels) or 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_buckets_refill_and_tokens_are_charged_as_answered():
    clock = Clock()
    admission = Admission(clock)
    tenant = Tenant("t", limits=Limits(requests_per_minute=2, tokens_per_minute=100, concurrent_requests=5))
    first, second = admission.admit(tenant), admission.admit(tenant)
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    refused = admission.admit(tenant)
    assert isinstance(refused, Refusal) and refused.reason == "requests" and refused.retry_after == pytest.approx(30)
    clock.now += 30  # one request's worth back
    third = admission.admit(tenant)
    assert isinstance(third, Ticket)
    admission.give_back(first, 150, tenant)  # the bucket below zero: no more until refilled above it
    admission.give_back(first, 150, tenant)  # (given back once only)
    assert admission.in_flight("t") == 2
    clock.now += 15  # 25 tokens back: the bucket at -25
    admission.give_back(second, 0, tenant)
    refused = admission.admit(tenant)
    assert isinstance(refused, Refusal) and refused.reason == "tokens"
    assert refused.retry_after == pytest.approx(15.6, abs=0.1)  # 26 tokens to come back at 100 a minute


def test_concurrency_is_counted_until_the_ticket_is_given_back():
    admission = Admission(Clock())
    tenant = Tenant("t", limits=Limits(concurrent_requests=1))
    ticket = admission.admit(tenant)
    refused = admission.admit(tenant)
    assert isinstance(refused, Refusal) and refused.reason == "concurrency"
    admission.give_back(ticket, 0, tenant)
    assert isinstance(admission.admit(tenant), Ticket)


def test_usage_is_read_from_an_answers_tail_and_estimated_where_none_came():
    answer = b'{"id":"x","choices":[{"text":"{\\"usage\\": 1}"}],"usage":{"prompt_tokens":12,"total_tokens":20,'
    answer += b'"completion_tokens":8,"prompt_tokens_details":null},"kv_transfer_params":null}'
    assert usage_in(answer) == (12, 8)
    assert usage_in(b'{"usage": {"prompt_tokens": 7, "total_tokens": 7}}') == (7, 0)  # embeddings
    assert usage_in(b'{"choices": []}') is None
    assert usage_in(answer.replace(b"null}", b'{"cached_tokens":3}}')) == (12, 8)
    body = json.dumps({"prompt": "x" * 400, "max_tokens": 50}).encode()
    assert estimate(body) == (len(body) // 4, 50)


async def test_requests_per_minute_refused_429_with_retry_after_as_openais_client_raises_it(tmp_path):
    tenants = {"acme": {"limits": {"requests_per_minute": 3}}, "beta": {}}
    door, _, cleanup = await keyed_door(tmp_path / "keys.yaml", tenants)
    try:
        acme = client(door)
        for _ in range(3):
            await acme.completions.create(**BODY)
        with pytest.raises(openai.RateLimitError) as raised:
            await acme.completions.create(**BODY)
        response = raised.value.response
        assert int(response.headers["retry-after"]) == 20
        assert response.json()["error"]["type"] == "requests"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        await client(door, "beta").completions.create(**BODY)  # another tenant is not touched
        assert sample(door, "motor_front_door_tenant_rejections_total", tenant="acme", reason="requests") == 1
        assert sample(door, "motor_front_door_tenant_requests_total", tenant="acme", code="200") == 3
    finally:
        await cleanup()


async def test_tokens_per_minute_count_answers_as_answered_streams_and_not(tmp_path):
    tenants = {"acme": {"limits": {"tokens_per_minute": 40}}}
    door, router, cleanup = await keyed_door(tmp_path / "keys.yaml", tenants, StandIn(usage=(10, 15)))
    try:
        acme = client(door)
        await acme.completions.create(**BODY)  # 25 tokens: 15 left
        assert sample(door, "motor_front_door_tenant_tokens_total", tenant="acme", kind="prompt") == 10
        assert sample(door, "motor_front_door_tenant_tokens_total", tenant="acme", kind="completion") == 15
        # a stream: its tokens are the ids the door follows (3 of the prompt, 2 sent), hidden from the client
        stream = await acme.completions.create(**BODY, stream=True)
        chunks = [chunk async for chunk in stream]
        assert "".join(chunk.choices[0].text for chunk in chunks) == "hi!"
        assert sample(door, "motor_front_door_tenant_tokens_total", tenant="acme", kind="prompt") == 13
        assert sample(door, "motor_front_door_tenant_tokens_total", tenant="acme", kind="completion") == 17
        await acme.completions.create(**BODY)  # 10 left: admitted, and takes the bucket below zero
        with pytest.raises(openai.RateLimitError) as raised:
            await acme.completions.create(**BODY)
        assert raised.value.response.json()["error"]["type"] == "tokens"
        assert int(raised.value.response.headers["retry-after"]) >= 1
    finally:
        await cleanup()


async def test_requests_at_once_are_given_back_when_each_answer_ends(tmp_path):
    tenants = {"acme": {"limits": {"concurrent_requests": 2}}}
    door, router, cleanup = await keyed_door(tmp_path / "keys.yaml", tenants)
    try:
        acme = client(door)
        slow = acme.with_options(base_url=f"http://127.0.0.1:{door.port}/v1")
        router.delay = 0.5
        running = [asyncio.ensure_future(slow.completions.create(**BODY)) for _ in range(2)]
        await asyncio.sleep(0.2)
        with pytest.raises(openai.RateLimitError) as raised:
            await acme.completions.create(**BODY)
        assert raised.value.response.json()["error"]["type"] == "concurrency"
        await asyncio.gather(*running)
        router.delay = 0.0
        await acme.completions.create(**BODY)
        # a client that leaves before its answer gives its place back too
        router.delay = 2.0
        leaving = asyncio.ensure_future(acme.completions.create(**BODY))
        await asyncio.sleep(0.2)
        assert door.tenancy.admission.in_flight("acme") == 1
        leaving.cancel()
        deadline = time.monotonic() + 2
        while door.tenancy.admission.in_flight("acme") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert door.tenancy.admission.in_flight("acme") == 0
    finally:
        await cleanup()


async def test_one_tenants_flood_does_not_starve_another(tmp_path):
    """Side by side: a router that serves 8 requests at once, 50 ms each; tenant `acme` floods it
    with 40 clients at once, `beta` sends one request at a time. Without limits, acme fills every
    seat and beta waits behind its queue; with acme held to 4 at once, acme never has more than 4
    at the router, so beta always finds a seat. (Beta's waits are printed: timings on a shared
    machine are not asserted.)"""
    waits = {}
    for limited in (False, True):
        limits = {"concurrent_requests": 4} if limited else {}
        tenants = {"acme": {"limits": limits}, "beta": {"limits": limits}}
        router = StandIn(capacity=8)
        router.delay = 0.05
        door, _, cleanup = await keyed_door(tmp_path / f"keys-{limited}.yaml", tenants, router)
        stop = asyncio.Event()
        refused = 0

        async def flood(acme) -> None:
            nonlocal refused
            while not stop.is_set():
                try:
                    await acme.completions.create(**BODY, user="acme")
                except openai.RateLimitError:
                    refused += 1
                    await asyncio.sleep(0.05)  # (a client of this test's process: its CPU is the door's)

        try:
            floods = [asyncio.ensure_future(flood(client(door))) for _ in range(40)]
            await asyncio.sleep(0.3)
            beta, taken = client(door, "beta"), []
            for _ in range(10):
                began = time.monotonic()
                await beta.completions.create(**BODY, user="beta")
                taken.append(time.monotonic() - began)
            stop.set()
            await asyncio.gather(*floods)
        finally:
            await cleanup()
        waits[limited] = statistics.median(taken)
        if limited:
            assert refused > 0 and router.most["acme"] <= 4, router.most
        else:
            assert router.most["acme"] > 8, router.most  # (queued at the router beyond its 8 seats)
    print(f"beta's median wait: {waits[False] * 1000:.0f} ms unlimited, {waits[True] * 1000:.0f} ms with limits")
