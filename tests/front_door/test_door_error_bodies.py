"""Every error the front door answers itself is in the shape OpenAI's clients read (vLLM's
ErrorResponse: `{"error": {"message", "type", "param", "code"}}`), whichever part refused the
request: a body that is not JSON (the router behind would answer it in plain text), a body past the
limit, an encoding the door cannot read."""

from __future__ import annotations

import gzip
import json

import aiohttp
import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app


@pytest.fixture
async def door():
    seen: list[bytes] = []

    async def router(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(text="Failed to parse the request body as JSON", status=400)  # vllm-router's own

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", router)
    runner, url = await serve_app(app)
    front = FrontDoor(url, lambda: {"m": None})
    front.relay.max_body = 1000
    front.port = free_port()
    front.seen = seen
    await front.start("127.0.0.1", front.port)
    yield front
    await front.close()
    await runner.cleanup()


async def post(door: FrontDoor, body: bytes, **headers: str) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        url = f"http://127.0.0.1:{door.port}/v1/completions"
        async with session.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as answer:
            raw = await answer.read()
            assert raw, f"{answer.status} with an empty body"
            return answer.status, dict(answer.headers), json.loads(raw)


def assert_openai_error(body: dict, status: int, kind: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert (error["code"], error["type"]) == (status, kind), body
    assert error["message"], body


async def test_a_body_that_is_not_json_is_answered_400_in_openais_shape_not_the_routers_plain_text(door):
    status, headers, body = await post(door, b"prompt=hi&model=m")
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert_openai_error(body, 400, "BadRequestError")
    assert "JSON object" in body["error"]["message"]
    assert door.seen == []  # the router never saw it


async def test_the_relays_own_refusals_are_in_openais_shape_too(door):
    status, _, body = await post(door, json.dumps({"model": "m", "prompt": "x" * 2000}).encode())
    assert status == 413
    assert_openai_error(body, 413, "BadRequestError")
    status, _, body = await post(door, b"\x00garbage", **{"Content-Encoding": "zstd-unknown"})
    assert status == 415
    assert_openai_error(body, 415, "BadRequestError")
    status, _, body = await post(door, gzip.compress(b"{}")[:10] + b"not deflate data", **{"Content-Encoding": "gzip"})
    assert status in (400, 415), body
    assert_openai_error(body, status, "BadRequestError")
