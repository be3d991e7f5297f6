"""The front door measures time to first token as the client sees it
(`motor_front_door_time_to_first_token_seconds{model}`): from a streamed completion's arrival to its
first event written to the client, not to the response headers, which the router sends first."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app

PREFILL_S = 0.3  # the stand-in engine's wait between its headers and its first token


async def slow_first_token(request: web.Request) -> web.StreamResponse:
    await request.read()
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)  # the headers at once, as vLLM's streaming answer sends them
    await asyncio.sleep(PREFILL_S)
    await reply.write(b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n')
    await reply.write(b"data: [DONE]\n\n")
    await reply.write_eof()
    return reply


@pytest.fixture
async def door():
    app = web.Application()
    app.router.add_post("/v1/completions", slow_first_token)
    runner, url = await serve_app(app)
    front = FrontDoor(url, lambda: {"m": None})
    front.port = free_port()
    await front.start("127.0.0.1", front.port)
    yield front
    await front.close()
    await runner.cleanup()


def observed(door: FrontDoor, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram's observations for model "m"."""
    count = door.metrics.registry.get_sample_value(f"{name}_count", {"model": "m"})
    total = door.metrics.registry.get_sample_value(f"{name}_sum", {"model": "m"})
    return count or 0.0, total or 0.0


async def test_time_to_first_token_counts_to_the_first_event_not_to_the_headers(door):
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True})
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{door.port}/v1/completions", data=body) as answer:
            assert answer.status == 200
            assert (await answer.read()).endswith(b"data: [DONE]\n\n")
    count, total = observed(door, "motor_front_door_time_to_first_token_seconds")
    assert count == 1 and PREFILL_S <= total < PREFILL_S + 2, (count, total)
    count, total = observed(door, "motor_front_door_response_start_seconds")
    assert count == 1 and total < PREFILL_S, (count, total)  # the headers came before the first token
