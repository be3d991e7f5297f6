"""How the front door moves bytes (front_door/relay.py), against a stand-in router: what an HTTP
client relies on from any proxy. The door's rules (models, 404s, adapters) are tested with the real
router in test_front_door.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app

# In process (a stand-in router), but its timers take 21 s in all (two tests 5-7 s each): the full suite's,
# as it was in tests/router before.
pytestmark = pytest.mark.slow

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


async def test_an_absolute_form_target_meets_the_same_rules_as_a_path(door, router):
    """HTTP/1.1 lets a client name the whole URL (`POST http://host/add_worker HTTP/1.1`), and the
    router routes it by its path (measured: vllm-router 0.1.17 added a worker for it): the door
    must read the path out of it too, or its 403 and its model check are stepped around."""
    for target in (b"http://door/add_worker?url=http://10.0.0.1:9", b"http://door/%61dd_worker?url=x"):
        reply = await raw(door.port, b"POST " + target + b" HTTP/1.1\r\nHost: door\r\nContent-Length: 0\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 403"), reply
    body = json.dumps({**COMPLETION, "model": "not-served"}).encode()
    assert (await raw(door.port, post("http://door/v1/completions", body))).startswith(b"HTTP/1.1 404")
    assert (await raw(door.port, post("http://door/v1/completions?x=1", json.dumps(COMPLETION).encode()))).startswith(
        b"HTTP/1.1 200"
    )
    assert [seen["path"] for seen in router.seen] == ["/v1/completions?x=1"]


async def test_a_malformed_request_sent_behind_another_never_takes_its_answer(door, router):
    """A client that pipelines a good request and then a broken one reads the good one's answer
    first: the 400 is the answer to the second, not the first."""
    reply = await raw(door.port, post("/v1/completions", json.dumps(COMPLETION).encode()) + b"NOT HTTP\r\n\r\n", True)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert b"HTTP/1.1 400" in reply


async def test_a_request_offering_an_upgrade_is_answered_over_http_11(door, router):
    """`curl --http2` on an http:// URL offers `Upgrade: h2c`; a server that does not switch
    answers in HTTP/1.1 (RFC 9110 7.8), as the router itself does."""
    data = (
        b"GET /health HTTP/1.1\r\nHost: door\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
    )
    reply = await raw(door.port, data)
    assert reply.startswith(b"HTTP/1.1 200"), reply


async def test_a_deeply_nested_body_is_answered_and_so_are_the_requests_around_it(door, router):
    """JSON nested past Python's recursion limit is still JSON to the door's rules: passed on (the
    router answers it), and the requests pipelined around it are answered too."""
    deep = b'{"model": "m", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    plain = post("/v1/completions", json.dumps(COMPLETION).encode())
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(plain + post("/v1/completions", deep) + plain)
    seen = b""
    while seen.count(b"HTTP/1.1 200") < 3:
        seen += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert len(router.seen) == 3


async def test_a_compressed_body_that_unpacks_past_the_limit_gets_413(door, router):
    """A few kB of gzip can unpack to gigabytes: the door's limit is on the body it reads."""
    door.relay.max_body = 100_000
    packed = gzip.compress(b'{"model": "m", "prompt": "' + b" " * 500_000 + b'"}')
    assert len(packed) < door.relay.max_body
    reply = await raw(door.port, post("/v1/completions", packed, b"Content-Encoding: gzip\r\n"))
    assert reply.startswith(b"HTTP/1.1 413") and b"front door" in reply, reply[:200]
    assert not router.seen


async def test_headers_past_a_bound_get_431_not_the_doors_memory(door, router):
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: door\r\n")
    try:
        for _ in range(2000):  # 2000 x 1 KiB headers, never ended
            writer.write(b"X-Pad: " + b"a" * 1024 + b"\r\n")
            await writer.drain()
    except ConnectionError:
        pass
    reply = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]


async def test_a_100_continue_for_a_request_sent_ahead_never_lands_inside_an_earlier_answer(door, router):
    """`100 Continue` is written once the requests before it are answered, never into the middle
    of a stream still on its way."""
    body = json.dumps(COMPLETION).encode()
    second = post("/v1/completions", b"", b"Expect: 100-continue\r\n").replace(
        b"Content-Length: 0", b"Content-Length: " + str(len(body)).encode()
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(post("/stream?n=20&gap=0.05", b"{}"))
    await asyncio.wait_for(reader.readuntil(b"data: 0"), 5)
    writer.write(second)
    seen = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)  # the stream's last chunk
    writer.write(body)
    seen += await asyncio.wait_for(reader.readuntil(b'"model": "m"}'), 5)
    writer.close()
    assert b"100 Continue" not in seen.split(b"0\r\n\r\n")[0], seen


async def test_an_upstream_that_switches_protocols_unasked_is_cut_off_without_an_error_in_the_log(caplog):
    """The door strips `Upgrade`, so a 101 from upstream is a router gone wrong: the client's
    answer ends there, the door's log stays clean and the request is counted as ended."""

    async def switching(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nxx")
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(switching, "127.0.0.1", 0)
    front = FrontDoor(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", lambda: {"m": None})
    door_port = free_port()
    await front.start("127.0.0.1", door_port)
    try:
        reply = await raw(door_port, b"GET /health HTTP/1.1\r\nHost: door\r\n\r\n", True, timeout=3)
        assert reply.startswith(b"HTTP/1.1 101")
        text = (await raw(door_port, b"GET /metrics HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n", True)).decode()
        assert "motor_front_door_requests_in_flight 0.0" in text
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    finally:
        await front.close()
        server.close()


async def test_idle_and_trickling_connections_are_closed_and_a_long_answer_is_not(door, router):
    """A client that keeps a connection with nothing asked, or sends its headers a byte at a time
    (slowloris), holds a socket of the door's for ever otherwise; one waiting on a long stream
    keeps it."""
    door.relay.idle_timeout = 0.5
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", door.port)
    idle_writer.write(post("/v1/completions", json.dumps(COMPLETION).encode()))
    assert (await asyncio.wait_for(idle_reader.readuntil(b'"model": "m"}'), 5)).startswith(b"HTTP/1.1 200")
    slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", door.port)
    stream_reader, stream_writer = await asyncio.open_connection("127.0.0.1", door.port)
    stream_writer.write(post("/stream?n=30&gap=0.1", b"{}"))  # 3 s of events
    for byte in b"GET /health HTTP/1.1\r\nHost: door\r\n":
        if slow_reader.at_eof():
            break
        slow_writer.write(bytes([byte]))
        await asyncio.sleep(0.1)
    for reader in (slow_reader, idle_reader):
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except ConnectionResetError:
            pass  # closed by the door while the slow client still wrote
    streamed = await asyncio.wait_for(stream_reader.readuntil(b"0\r\n\r\n"), 10)
    assert b"data: 29 " in streamed
    for writer in (idle_writer, slow_writer, stream_writer):
        writer.close()
    assert not door.relay.connections or all(c.closing for c in door.relay.connections)


async def test_requests_the_door_cannot_read_are_counted_by_their_code(door, router):
    """An operator watching `motor_front_door_requests_total` by code sees the door's own 400s,
    413s, 415s and 431s too, not only what reached the router."""
    door.relay.max_body = 1000
    await raw(door.port, b"NOT HTTP AT ALL\r\n\r\n", True)
    await raw(door.port, post("/v1/completions", b"x" * 2000), True)
    await raw(door.port, post("/v1/completions", b"xx", b"Content-Encoding: zstd\r\n"))
    await raw(door.port, b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 70000 + b"\r\n\r\n", True)
    text = (await raw(door.port, b"GET /metrics HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n", True)).decode()
    for code in (400, 413, 415, 431):
        assert f'motor_front_door_requests_total{{code="{code}",model=""}} 1.0' in text, code


async def test_a_fragment_in_the_target_steps_around_no_rule(door, router):
    """The router drops a target's `#fragment` and routes by the rest (measured: vllm-router
    0.1.17 answered `POST /v1/completions#x` from its completions route): the door reads the path
    without it too, and passes no fragment on."""
    reply = await raw(door.port, b"POST /workers#x HTTP/1.1\r\nHost: door\r\nContent-Length: 2\r\n\r\n{}")
    assert reply.startswith(b"HTTP/1.1 403"), reply
    unknown = json.dumps({**COMPLETION, "model": "not-served"}).encode()
    assert (await raw(door.port, post("/v1/completions#x", unknown))).startswith(b"HTTP/1.1 404")
    reply = await raw(door.port, post("/v1/completions?a=1#x", json.dumps(COMPLETION).encode()))
    assert reply.startswith(b"HTTP/1.1 200")
    assert [seen["path"] for seen in router.seen] == ["/v1/completions?a=1"]


async def test_a_router_connection_paused_for_a_slow_client_is_read_again_once_pooled(door, router):
    """A large answer's last read can fill a slow client's buffer as it ends the answer: the
    router connection, paused for that client, goes back to the pool. The next request sent on it
    must still be read (it hung: its answer never read)."""
    size = 4_000_000
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    for connection in door.relay.connections:  # small buffers: the door's writes back up at once
        connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    for _ in range(3):
        writer.write(post("/stream?n=1&size=" + str(size), b"{}"))
        await asyncio.sleep(0.5)  # the router's answer all read, the client reading nothing yet
        seen = b""
        while not seen.endswith(b"0\r\n\r\n"):
            seen = seen[-10:] + await asyncio.wait_for(reader.read(1 << 20), 10)
        async with aiohttp.ClientSession() as session:
            for _ in range(3):  # the pool's connections, the last given back first
                async with session.post(
                    door.url + "/v1/completions", json=COMPLETION, timeout=aiohttp.ClientTimeout(total=5)
                ) as reply:
                    assert reply.status == 200
    writer.close()


async def test_the_next_answer_to_a_client_still_not_reading_is_held_back_too():
    """Back-pressure holds across pipelined requests: an answer that ends as it fills a client's
    buffer leaves the client unread, and the next request's stream must wait for it too, not be
    read into the door's memory."""
    streamed = [0]

    async def upstream(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST /one"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100_000)
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                while True:  # for ever, as fast as the door reads it
                    writer.write(b"2000\r\n" + b"y" * 8192 + b"\r\n")
                    streamed[0] += 8192
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):  # the door or the test gone
            writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    front = FrontDoor(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", lambda: {"m": None})
    door_port = free_port()
    await front.start("127.0.0.1", door_port)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", door_port))
        reader, writer = await asyncio.open_connection(sock=client)
        await asyncio.sleep(0.1)
        for connection in front.relay.connections:
            connection.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        writer.write(post("/one", b"{}") + post("/endless", b"{}"))
        await asyncio.sleep(2)
        assert streamed[0] < 16_000_000, streamed[0]  # what sockets hold, not what the door has read
        writer.transport.abort()
    finally:
        await front.close()
        server.close()


async def test_the_doors_own_answers_keep_their_place_among_pipelined_requests(door, router):
    """A request the door answers itself (404 for a model not served), sent behind one still with
    the router, is answered after it, not before."""
    unknown = post("/v1/completions", json.dumps({**COMPLETION, "model": "zz"}).encode())
    slow = post("/stream?n=5&gap=0.1", b"{}")
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    writer.write(unknown + slow + unknown + post("/v1/completions", json.dumps(COMPLETION).encode()))
    seen = b""
    while seen.count(b"HTTP/1.1 ") < 4:
        seen += await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", seen)
    assert statuses == [b"404", b"200", b"404", b"200"]
    assert seen.index(b"data: 4") < seen.rindex(b"NotFoundError")
