"""The relay's details (front_door/relay.py) a proxy must get right: an h2c upgrade offer with a
body, headers a client names in `Connection:`, a POST never sent twice, a deadline on the
router's first byte."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app

BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()


class Echo:
    def __init__(self) -> None:
        self.seen: list[tuple[dict, bytes]] = []

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((dict(request.headers), body))
        return web.json_response({"body": body.decode()})


@pytest.fixture
async def echo():
    router = Echo()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", router.echo)
    runner, router.url = await serve_app(app)
    yield router
    await runner.cleanup()


async def start_door(router_url: str, **options) -> FrontDoor:
    door = FrontDoor(router_url, lambda: {"m": None})
    for name, value in options.items():
        setattr(door.relay, name, value)
    door.port = free_port()
    await door.start("127.0.0.1", door.port)
    return door


async def exchange(port: int, data: bytes, answers: int = 1, timeout: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    seen = b""
    try:
        while seen.count(b"HTTP/1.1 ") < answers:
            part = await asyncio.wait_for(reader.read(65536), timeout)
            if not part:
                break
            seen += part
    finally:
        writer.close()
    return seen


async def test_a_post_offering_an_h2c_upgrade_is_answered_over_http_11_with_its_body(echo):
    """`curl --http2 http://...` offers `Upgrade: h2c` on a POST with its body: the door does not
    switch, so the body is the request's, not a second request on the connection."""
    door = await start_door(echo.url)
    try:
        data = (
            b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
        )
        reply = await exchange(door.port, data + data, answers=2)
    finally:
        await door.close()
    assert reply.count(b"HTTP/1.1 200") == 2 and b"HTTP/1.1 400" not in reply, reply
    assert [body for _, body in echo.seen] == [BODY, BODY]
    assert all("HTTP2-Settings" not in headers and "Upgrade" not in headers for headers, _ in echo.seen)


async def test_headers_the_client_names_in_connection_are_not_passed_on(echo):
    door = await start_door(echo.url)
    try:
        data = (
            b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nConnection: keep-alive, X-Hop, x-other\r\n"
            b"X-Hop: 1\r\nX-Other: 2\r\nX-Kept: 3\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
        )
        assert (await exchange(door.port, data)).startswith(b"HTTP/1.1 200")
    finally:
        await door.close()
    headers = echo.seen[-1][0]
    assert "X-Hop" not in headers and "X-Other" not in headers and headers["X-Kept"] == "3"


async def one_answer_per_connection_router(arrived: list[bytes]):
    """Answers the first request on each connection, and closes it when a second arrives, before
    any byte of an answer: a kept-alive connection the router closed as the request went out."""

    async def request(reader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
        if length:
            await reader.readexactly(int(length[0].split(b":")[1]))
        return head

    async def serve(reader, writer):
        arrived.append(await request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        arrived.append(await request(reader))
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_post_is_never_sent_twice_when_a_kept_alive_router_connection_closes_unanswered():
    """A POST the router may have started (a generation) is answered 502, not run a second time;
    a GET is sent again as before."""
    arrived: list[bytes] = []
    server, url = await one_answer_per_connection_router(arrived)
    door = await start_door(url)
    post = b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Length: " + str(len(BODY)).encode()
    post += b"\r\n\r\n" + BODY
    try:
        first = await exchange(door.port, post)
        second = await exchange(door.port, post)
        gets = [await exchange(door.port, b"GET /health HTTP/1.1\r\nHost: door\r\n\r\n") for _ in range(2)]
    finally:
        await door.close()
        server.close()
    assert first.startswith(b"HTTP/1.1 200")
    assert second.startswith(b"HTTP/1.1 502") and b"not sent again" in second, second
    posts = [head for head in arrived if head.startswith(b"POST")]
    assert len(posts) == 2, arrived  # the second POST reached the router once
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in gets), gets


async def test_a_router_that_sends_no_first_byte_within_the_deadline_gets_504():
    async def silent(reader, writer):
        await reader.read(65536)
        await asyncio.sleep(30)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    door = await start_door(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", first_byte_timeout=0.5)
    try:
        answer = await exchange(door.port, b"GET /health HTTP/1.1\r\nHost: door\r\n\r\n", timeout=5)
    finally:
        await door.close()
        server.close()
    assert answer.startswith(b"HTTP/1.1 504"), answer
