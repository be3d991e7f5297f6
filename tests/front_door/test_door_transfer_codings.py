"""A chunked request's framing stays the door's (front_door/relay.py, bodies.py): its trailers
are dropped, never passed to the router as headers, and a transfer coding under `chunked`
(`Transfer-Encoding: gzip, chunked`) is undone as a Content-Encoding is, within the same limit,
or refused 501 when the door cannot undo it: never passed on still coded as if plain."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app

BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()


@pytest.fixture
async def router():
    seen: list[tuple[dict, bytes]] = []

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append((dict(request.headers), body))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner, url = await serve_app(app)
    yield url, seen
    await runner.cleanup()


@pytest.fixture
async def door(router):
    front = FrontDoor(router[0], lambda: {"m": None})
    front.port = free_port()
    await front.start("127.0.0.1", front.port)
    yield front
    await front.close()


def chunked(body: bytes, coding: bytes = b"chunked", trailers: bytes = b"") -> bytes:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
    if trailers:
        head += b"Trailer: X-Checksum\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:]) if part)
    return head + b"Transfer-Encoding: " + coding + b"\r\n\r\n" + chunks + b"0\r\n" + trailers + b"\r\n"


async def exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        return head + await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()


async def test_a_chunked_requests_trailers_do_not_reach_the_router_as_headers(door, router):
    reply = await exchange(door.port, chunked(BODY, trailers=b"X-Checksum: abc\r\nX-Forged-User: admin\r\n"))
    assert reply.startswith(b"HTTP/1.1 200"), reply
    [(headers, body)] = router[1]
    assert body == BODY
    assert "X-Checksum" not in headers and "X-Forged-User" not in headers, headers


async def test_a_gzip_transfer_coding_is_undone_before_the_door_reads_the_model_and_passes_it_on(door, router):
    reply = await exchange(door.port, chunked(gzip.compress(BODY), b"gzip, chunked"))
    assert reply.startswith(b"HTTP/1.1 200"), reply
    [(headers, body)] = router[1]
    assert body == BODY and "Content-Encoding" not in headers
    # Read, not passed on unread: a model the door does not serve is its own 404.
    other = json.dumps({"model": "elsewhere", "prompt": "hi"}).encode()
    reply = await exchange(door.port, chunked(gzip.compress(other), b"gzip, chunked"))
    assert reply.startswith(b"HTTP/1.1 404"), reply
    assert len(router[1]) == 1


async def test_a_transfer_coding_the_door_cannot_undo_is_refused_501_and_not_passed_on(door, router):
    reply = await exchange(door.port, chunked(b"\x1f\x9d not really compress", b"compress, chunked"))
    assert reply.startswith(b"HTTP/1.1 501"), reply
    assert b"Transfer-Encoding" in reply
    assert router[1] == []
