"""A stand-in for the router and its engines, for the front door's tests of streams gone on with
(tests/front_door/test_stream_continuation*.py): an engine of a deterministic model (each token a
function of every id before it, as greedy decoding of a real one), so that a continuation from the
prompt's ids and the ids sent gives exactly the rest of the uninterrupted answer; and a client that
reads a stream through the door."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from front_door.policy import FrontDoor
from motor.ports import free_port
from tests.support import serve_app

BODY = {"model": "m", "prompt": "tell me", "max_tokens": 40, "stream": True, "temperature": 0}
SPLIT = 149  # a token whose text is half a character: its text comes with the next token's


def next_id(ids: list[int]) -> int:
    return 100 + (ids[-1] * 7 + len(ids) * 3) % 50


def text_of(ids: list[int], at: int) -> str:
    """The text of ids[at], as an incremental detokenizer primed with what came before gives it."""
    if ids[at] == SPLIT:
        return ""
    piece = f" w{ids[at]}"
    return ("é" + piece) if at and ids[at - 1] == SPLIT else piece


def prompt_ids(body: dict) -> list[int]:
    if isinstance(body.get("prompt"), list):
        return list(body["prompt"])
    text = body.get("prompt") or json.dumps(body.get("messages"))
    return [ord(c) % 90 + 10 for c in text]


def answer_ids(prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(next_id(ids))
    return ids[len(prompt) :]


class Engine:
    """The router and its engines: serves completions and chat completions of the model above."""

    def __init__(self) -> None:
        # per request: ("break" | "end" | "error", after k tokens), ("status", code) or ("router_failed", 0)
        self.faults: list[tuple[str, int]] = []
        self.bodies: list[dict] = []

    async def serve(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        how, at = self.faults.pop(0) if self.faults else ("", -1)
        if how == "status":
            return web.json_response({"error": {"message": "no workers", "code": at}}, status=at)
        if how == "router_failed":  # vllm-router's own, once its retries are spent
            return web.Response(status=500, text="Request failed: error sending request for url (...)")
        if not body.get("stream"):
            return web.json_response({"id": "whole", "choices": [{"index": 0, "text": "all of it"}]})
        chat = request.path.endswith("/chat/completions")
        prompt = prompt_ids(body)
        limit = body.get("max_tokens", body.get("max_completion_tokens", 16))
        ids = answer_ids(prompt, limit)
        asked = body.get("return_token_ids") is True
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        head = {"id": f"cmpl-{len(self.bodies)}", "object": "chat.completion.chunk" if chat else "text_completion"}
        head.update(created=1000 + len(self.bodies), model=body["model"])

        async def send(chunk: dict) -> None:
            await reply.write(b"data: " + json.dumps({**head, **chunk}).encode() + b"\n\n")
            await asyncio.sleep(0.002)

        if chat:
            first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            await send({**first, **({"prompt_token_ids": prompt} if asked else {})})
        whole = prompt + ids
        for n, token in enumerate(ids):
            if n == at:
                if how == "break":
                    request.transport.close()
                    return reply
                if how == "error":
                    await send({"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}})
                    break
                if how == "end":
                    break
            text = text_of(whole, len(prompt) + n)
            if n == 0 and prompt[-1] == SPLIT:  # as vLLM 0.32: a detokenizer primed mid-character
                text = "<the prompt's text>" + text
            last = "length" if n == len(ids) - 1 else None
            choice = {"index": 0, "finish_reason": last}
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            if asked:
                choice["token_ids"] = [token]
                if not chat and n == 0:
                    choice["prompt_token_ids"] = prompt
            await send({"choices": [choice]})
        else:
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}
                await send({"choices": [], "usage": {**usage, "total_tokens": len(prompt) + len(ids)}})
        if how != "end":
            await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply


async def stream(
    port: int, path: str, body: dict | None, data: bytes | None = None, headers: bytes = b""
) -> tuple[list, bool]:
    """The events of the answer (JSON, or "[DONE]") and whether its chunked body ended properly; the
    body `data` as given (else `body` as JSON), with more header lines (each ending CRLF)."""
    data = json.dumps(body).encode() if data is None else data
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
            + headers + b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
        )  # fmt: skip
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        raw, ended = b"", False
        while True:
            size_line = await asyncio.wait_for(reader.readline(), 10)
            if not size_line:
                break
            size = int(size_line.strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                ended = True
                break
            raw += chunk[:-2]
    finally:
        writer.close()
    events = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: "):
            payload = event[6:]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events, ended


def text(events: list, chat: bool) -> str:
    pieces = []
    for event in events:
        for choice in event.get("choices", []) if isinstance(event, dict) else ():
            pieces.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text", ""))
    return "".join(pieces)


def ids_shown(events: list) -> list[int]:
    return [i for e in events if isinstance(e, dict) for c in e.get("choices", []) for i in c.get("token_ids") or ()]


@asynccontextmanager
async def door_before(engine: Engine) -> AsyncIterator[FrontDoor]:
    """A front door (serving model "m") in front of `engine` as its router; `.port` is the door's."""
    app = web.Application()
    app.router.add_post("/v1/completions", engine.serve)
    app.router.add_post("/v1/chat/completions", engine.serve)
    runner, url = await serve_app(app)
    front = FrontDoor(url, lambda: {"m": None})
    front.port = free_port()
    await front.start("127.0.0.1", front.port)
    try:
        yield front
    finally:
        await front.close()
        await runner.cleanup()
