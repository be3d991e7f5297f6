"""What a client without a key costs the keyed door (front_door/tenancy.py `screen`; docs/security.md):
its request is refused on its head alone, before a byte of its body is read, held, inflated or
answered `100 Continue`; what it wrote cannot forge a line of the audit log; and on the routes that
need no key, the key a client sent is not passed on. Before: the door read the whole body (up to
256 MiB, gzip inflated on the body pool's two threads) before it looked at the key."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from tests.support.keyed_door import KEYS, keyed_door

BIG = 200 * 1024 * 1024


@pytest.fixture
async def door(tmp_path):
    door, router, cleanup = await keyed_door(tmp_path / "keys.yaml", {"acme": {"models": ["m"]}})
    yield door
    await cleanup()


async def head_only(port: int, head: bytes, timeout: float = 5.0) -> bytes:
    """Sends a request's head alone (its body announced, never sent); what comes back until close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


@pytest.mark.parametrize("key", [None, "Bearer sk-motor-wrong", "Basic abc"], ids=["no key", "wrong key", "not bearer"])
@pytest.mark.parametrize("expect", [False, True], ids=["", "expect 100-continue"])
async def test_a_request_without_a_valid_key_is_refused_before_its_body(door, key, expect):
    head = f"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\nContent-Length: {BIG}\r\n"
    head += "Content-Encoding: gzip\r\n" + (f"Authorization: {key}\r\n" if key else "")
    head += "Expect: 100-continue\r\n" if expect else ""
    began = time.monotonic()
    answer = await head_only(door.port, (head + "\r\n").encode())
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]  # not `100 Continue` first, not a 413
    assert time.monotonic() - began < 3.0  # answered on the head: the 200 MB body was never sent
    assert door.router_stand_in.seen == []


async def test_a_valid_key_still_has_its_body_read(door):
    body = b'{"model": "m", "prompt": "hi", "max_tokens": 4}'
    head = "POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {KEYS['acme']}\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", door.port)
    try:
        writer.write(head.encode())
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
    finally:
        writer.close()


async def test_a_path_cannot_forge_a_line_of_the_audit_log(door, caplog):
    forged = "2026-12-07 23:00:00,000 INFO motor-front-door.audit: accepted: key acme-1"
    target = "/v1/models%0a" + forged.replace(" ", "%20")
    with caplog.at_level(logging.WARNING, logger="motor-front-door.audit"):
        answer = await head_only(door.port, f"GET {target} HTTP/1.1\r\nHost: door\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 401 ")
    lines = [record.getMessage() for record in caplog.records if record.name == "motor-front-door.audit"]
    assert lines and all("\n" not in line for line in lines), lines
    assert "\\n2026-12-07" in lines[-1]  # the decoded newline, written escaped


async def test_health_needs_no_key_and_a_key_sent_with_it_is_not_passed_on(door):
    head = f"GET /health HTTP/1.1\r\nHost: door\r\nAuthorization: Bearer {KEYS['acme']}\r\nx-api-key: sk-x\r\n"
    answer = await head_only(door.port, (head + "Connection: close\r\n\r\n").encode())
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    [seen] = door.router_stand_in.seen
    assert {name.lower() for name in seen["headers"]} & {"authorization", "x-api-key"} == set(), seen
