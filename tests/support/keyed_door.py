"""A front door with API keys in front of a stand-in router, for the keys' and limits' tests."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import yaml
from aiohttp import web

from front_door.keys import KeyRing, digest
from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app

KEYS = {"acme": "sk-motor-acme-0123456789abcdef", "beta": "sk-motor-beta-0123456789abcdef"}
SERVED = {"m": None, "m-lora": "m", "other": None}


def key_file(path, tenants: dict, keys: dict[str, str] | None = None) -> str:
    """A key file of `tenants` ({name: {models, limits}}), one key a tenant (`keys`: tenant -> key)."""
    keys = keys or {name: KEYS.get(name, f"sk-motor-{name}-key") for name in tenants}
    body = {
        "tenants": tenants,
        "keys": [{"id": f"{name}-1", "tenant": name, "sha256": digest(key).hex()} for name, key in keys.items()],
    }
    path.write_text(yaml.safe_dump(body))
    return str(path)


class StandIn:
    """The router: completions answered with `usage` after `delay` seconds (the query's `delay`),
    at most `capacity` at once (the others queue), the headers of each request kept."""

    def __init__(self, capacity: int = 1000, usage: tuple[int, int] = (10, 5)) -> None:
        self.capacity = asyncio.Semaphore(capacity)
        self.usage = usage
        self.seen: list[dict] = []
        self.delay = 0.0
        self.in_flight: Counter[str] = Counter()  # requests here now, by the body's `user`
        self.most: Counter[str] = Counter()  # the most of them here at once

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"headers": dict(request.headers), "body": body, "path": request.path})
        user = str(body.get("user", ""))
        self.in_flight[user] += 1
        self.most[user] = max(self.most[user], self.in_flight[user])
        try:
            async with self.capacity:
                await asyncio.sleep(float(request.query.get("delay", self.delay)))
        finally:
            self.in_flight[user] -= 1
        prompt, completion = self.usage
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if body.get("stream"):
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            chunk = {"id": "c", "object": "text_completion", "created": 1, "model": body["model"]}
            first = {**chunk, "choices": [{"index": 0, "text": "hi", "prompt_token_ids": [1, 2, 3], "token_ids": [7]}]}
            await reply.write(b"data: " + json.dumps(first).encode() + b"\n\n")
            last = {**chunk, "choices": [{"index": 0, "text": "!", "token_ids": [8], "finish_reason": "stop"}]}
            await reply.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            await reply.write(b"data: [DONE]\n\n")
            await reply.write_eof()
            return reply
        answer = {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": body["model"],
            "choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
            "usage": usage,
        }
        return web.json_response(answer)

    async def anything(self, request: web.Request) -> web.Response:
        self.seen.append({"headers": dict(request.headers), "path": request.path})
        return web.json_response({"router": request.path})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        app.router.add_route("*", "/{tail:.*}", self.anything)
        return app


async def keyed_door(path, tenants: dict, router: StandIn | None = None, **door_args):
    """(door, router, cleanup) with the door on door.port."""
    router = router or StandIn()
    runner, url = await serve_app(router.app())
    ring = KeyRing(key_file(path, tenants))
    door = FrontDoor(url, lambda: SERVED, keys=ring, **door_args)
    door.port = free_port()
    door.router_stand_in = router
    await door.start("127.0.0.1", door.port)

    async def cleanup():
        await door.close()
        await runner.cleanup()

    return door, router, cleanup


async def exchange(port: int, data: bytes, reads: int = 1, timeout: float = 5.0) -> bytes:
    """Raw bytes sent, what comes back until the connection closes or `timeout`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                break
            got += chunk
            if got.count(b"HTTP/1.1 ") >= reads and reads_whole(got, reads):
                break
    except TimeoutError:
        pass
    finally:
        writer.close()
    return got


def reads_whole(data: bytes, answers: int) -> bool:
    """Whether `data` holds `answers` whole answers with a Content-Length each."""
    at = 0
    for _ in range(answers):
        end = data.find(b"\r\n\r\n", at)
        if end < 0:
            return False
        head = data[at:end].lower()
        length = 0
        for line in head.split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        at = end + 4 + length
        if len(data) < at:
            return False
    return True


def post(path: str, body: dict, headers: list[tuple[str, str]] = (), target: str | None = None) -> bytes:
    data = json.dumps(body).encode()
    lines = [f"POST {target or path} HTTP/1.1", "Host: door", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data
