"""How the front door moves bytes (router_sync/relay.py), against a stand-in router: what an HTTP
client relies on from any proxy. The door's rules (models, 404s, adapters) are tested with the real
router in test_front_door.py."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from motor.ports import free_port
from router_sync.front import FrontDoor
from tests.support import serve_app

COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}


class StandIn:
    """A router stand-in: echoes what it got, streams on request, and counts what it saw."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.streams_cancelled = 0
        self.events_written = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append({"path": request.path_qs, "headers": dict(request.headers), "body": body})
        return web.json_response({"path": request.path_qs, "body": body.decode(), "model": "m"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """`n` events of `size` bytes, `gap` s apart."""
        n, size, gap = (float(request.query.get(k, d)) for k, d in (("n", 5), ("size", 10), ("gap", 0.0)))
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        try:
            for i in range(int(n)):
                await reply.write(f"data: {i} ".encode() + b"x" * int(size) + b"\n\n")
                self.events_written += 1
                if gap:
                    await asyncio.sleep(gap)
        except (asyncio.CancelledError, ConnectionResetError):
            self.streams_cancelled += 1
            raise
        await reply.write_eof()
        return reply

    async def head(self, request: web.Request) -> web.Response:
        return web.Response(headers={"Content-Length": "1234", "X-Head": "yes"})

    async def start(self, port: int | None = None) -> StandIn:
        app = web.Application()
        app.router.add_route("HEAD", "/head", self.head)
        app.router.add_post("/stream", self.stream)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        self.runner, self.url = await serve_app(app, port)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
async def router():
    stand_in = await StandIn().start()
    yield stand_in
    await stand_in.stop()


@pytest.fixture
async def door(router):
    front = FrontDoor(router.url, lambda: {"m": None})
    port = free_port()
    await front.start("127.0.0.1", port)
    front.url = f"http://127.0.0.1:{port}"
    front.port = port
    yield front
    await front.close()


async def raw(port: int, data: bytes, until_closed: bool = False, timeout: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        if until_closed:
            return await asyncio.wait_for(reader.read(), timeout)
        return await asyncio.wait_for(reader.read(65536), timeout)
    finally:
        writer.close()


def post(path: str, body: bytes, extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"POST " + path.encode() + b" " + version + b"\r\nHost: door\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body
    )


async def test_a_request_reaches_the_router_as_the_client_sent_it_and_the_answer_comes_back(door, router):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            door.url + "/v1/completions?x=1", json=COMPLETION, headers={"X-Trace": "abc", "Cookie": "a=b"}
        ) as reply:
            assert reply.status == 200
            answer = await reply.json()
    assert answer["path"] == "/v1/completions?x=1" and json.loads(answer["body"]) == COMPLETION
    headers = router.seen[-1]["headers"]
    assert headers["X-Trace"] == "abc" and headers["Cookie"] == "a=b"
    assert int(headers["Content-Length"]) == len(router.seen[-1]["body"])


async def test_requests_on_one_connection_are_answered_in_order_even_sent_ahead(door, router):
    """HTTP/1.1 pipelining: a client may send its next requests before the first is answered."""
    bodies = [json.dumps({**COMPLETION, "prompt": f"p{i}"}).encode() for i in range(3)]
    data = b"".join(post("/v1/completions", body) for body in bodies)
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(data)
    seen = b""
    while seen.count(b"HTTP/1.1 200") < 3:
        seen += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert seen.index(b"p0") < seen.index(b"p1") < seen.index(b"p2")


async def test_a_client_that_expects_100_continue_gets_it_and_then_the_answer(door):
    """curl sends `Expect: 100-continue` for bodies over 1 KiB and waits a second for it."""
    body = json.dumps({**COMPLETION, "prompt": "x" * 2000}).encode()
    head = post("/v1/completions", b"", b"Expect: 100-continue\r\n").replace(
        b"Content-Length: 0", b"Content-Length: " + str(len(body)).encode()
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(head)
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)).startswith(b"HTTP/1.1 100 Continue")
    writer.write(body)
    assert (await asyncio.wait_for(reader.read(65536), 5)).startswith(b"HTTP/1.1 200")
    writer.close()


async def test_a_chunked_request_body_is_sent_on_whole_with_its_length(door, router):
    body = json.dumps(COMPLETION).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    data = (
        b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunked
    )
    assert (await raw(door.port, data)).startswith(b"HTTP/1.1 200")
    assert router.seen[-1]["body"] == body
    assert "Transfer-Encoding" not in router.seen[-1]["headers"]


async def test_a_head_request_is_answered_without_waiting_for_a_body(door):
    reply = await raw(door.port, b"HEAD /head HTTP/1.1\r\nHost: door\r\n\r\n", timeout=2)
    assert reply.startswith(b"HTTP/1.1 200") and b"X-Head: yes" in reply
    # the connection to the router is free for the next request
    async with aiohttp.ClientSession() as session:
        async with session.post(door.url + "/v1/completions", json=COMPLETION) as answer:
            assert answer.status == 200


async def test_an_http_10_client_is_answered_and_the_connection_closed(door):
    reply = await raw(door.port, post("/v1/completions", json.dumps(COMPLETION).encode(), version=b"HTTP/1.0"), True)
    assert reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n")[0]
    assert b'"model": "m"' in reply


async def test_a_stream_to_a_client_that_reads_nothing_slows_no_other_client(door, router):
    """Back-pressure: a stalled reader of a large stream fills its own buffers; the router's
    connection for it stops being read (the door does not hold the stream in memory), and
    everyone else is served as before."""
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(post("/stream?n=8000&size=8192", b"{}"))  # 64 MB the client never reads
    await asyncio.sleep(1.5)
    # what the kernel's socket buffers hold (a few MB each way), not the whole stream
    assert router.events_written < 4000, router.events_written
    began = time.monotonic()
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            async with session.post(door.url + "/v1/completions", json=COMPLETION) as reply:
                assert reply.status == 200
    assert time.monotonic() - began < 5
    writer.transport.abort()


async def test_a_client_leaving_mid_stream_stops_the_generation_at_the_router(door, router):
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(post("/stream?n=100&gap=0.05", b"{}"))
    assert b"data: 0" in await asyncio.wait_for(reader.readuntil(b"data: 0"), 5)
    writer.transport.abort()
    deadline = time.monotonic() + 5
    while router.streams_cancelled == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert router.streams_cancelled == 1


async def test_a_router_that_is_down_gets_502_in_vllms_format_and_the_door_serves_when_it_is_back():
    port = free_port()
    front = FrontDoor(f"http://127.0.0.1:{port}", lambda: {"m": None})
    door_port = free_port()
    await front.start("127.0.0.1", door_port)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{door_port}/v1/completions"
            async with session.post(url, json=COMPLETION) as reply:
                assert reply.status == 502
                assert (await reply.json())["error"]["type"] == "BadGatewayError"
            stand_in = await StandIn().start(port)
            try:
                async with session.post(url, json=COMPLETION) as reply:
                    assert reply.status == 200
            finally:
                await stand_in.stop()
        text = (await raw(door_port, b"GET /metrics HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n", True)).decode()
        assert "motor_front_door_router_errors_total 1.0" in text
        assert 'motor_front_door_requests_total{code="502",model="m"} 1.0' in text
    finally:
        await front.close()


async def test_a_kept_alive_connection_the_router_closed_is_replaced_without_a_failed_request():
    """Routers close idle keep-alive connections; a request sent on one as it closes is sent again
    on a new one (no byte of an answer came). The stand-in answers one request per connection and
    closes the connection when a second arrives on it."""
    answered = []

    async def one_answer_per_connection(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"model": "m"}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 14\r\n\r\n" + body)
        answered.append(1)
        await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: dropped
        writer.close()

    server = await asyncio.start_server(one_answer_per_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    front = FrontDoor(f"http://127.0.0.1:{port}", lambda: {"m": None})
    door_port = free_port()
    await front.start("127.0.0.1", door_port)
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(4):
                async with session.get(f"http://127.0.0.1:{door_port}/health") as reply:
                    assert reply.status == 200
        assert len(answered) == 4
    finally:
        await front.close()
        server.close()


async def test_a_body_over_the_limit_gets_413_and_a_malformed_request_400(door):
    door.relay.max_body = 1000
    reply = await raw(door.port, post("/v1/completions", b"x" * 2000), True)
    assert reply.startswith(b"HTTP/1.1 413")
    reply = await raw(door.port, b"NOT HTTP AT ALL\r\n\r\n", True)
    assert reply.startswith(b"HTTP/1.1 400")
