"""What the simulated engine answers, in the OpenAI wire format vLLM's API server speaks: the
deterministic text for a prompt, completions and chat completions (whole, or as server-sent
events), and vLLM's error bodies."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine_server.engines.admission import UNAVAILABLE_HEADERS, unavailable_body

WORDS = (
    "motor sim engine token answer fast cache prefill decode quiet river stone light model "
    "graph cloud field north amber signal"
).split()


def deterministic_text(prompt: str, tokens: int) -> str:
    """The same prompt always gives the same answer."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return " ".join(WORDS[digest[i % len(digest)] % len(WORDS)] for i in range(tokens))


def count_tokens(text: str) -> int:
    return max(1, len(text.split()))


def completion(answer_id: str, model: str, text: str, chat: bool, usage: dict[str, int]) -> dict[str, Any]:
    """A whole (not streamed) completion or chat completion."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": answer_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def model_not_found(model: str, served: str) -> web.Response:
    """vLLM's answer to a request for a model it does not serve (entrypoints/serve/engine/serving.py)."""
    message = f"The model `{model}` does not exist. Valid aliases: {served}."
    return web.json_response(
        {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}, status=404
    )


def unavailable(message: str) -> web.Response:
    return web.Response(status=503, body=unavailable_body(message), headers=UNAVAILABLE_HEADERS)


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def json_body(request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
    try:
        body = await request.json()
    except ValueError:
        return {}, error(400, "the body must be a JSON object")
    if not isinstance(body, dict):
        return {}, error(400, "the body must be a JSON object")
    return body, None


# Chunks of a stream written between two yields of the event loop: a write to a fast reader never
# waits, and the loop is the management plane's too (GetStatus unanswered for seconds is a kill).
CHUNKS_PER_YIELD = 32


async def stream(
    request: web.Request,
    answer_id: str,
    model: str,
    text: str,
    chat: bool,
    usage: dict[str, int],
    sent: Callable[[int], None] = lambda count: None,
) -> web.StreamResponse:
    """The answer as SSE chunks, a word each, yielding the loop every CHUNKS_PER_YIELD; `sent` is told
    of each batch written (the engine's progress: a long stream is work, not a hang)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    words = text.split(" ")
    for index, word in enumerate(words):
        if index and not index % CHUNKS_PER_YIELD:
            sent(CHUNKS_PER_YIELD)
            await asyncio.sleep(0)
        piece = word if index == 0 else " " + word
        last = index == len(words) - 1
        if chat:
            choice = {"index": 0, "delta": {"content": piece}, "finish_reason": "length" if last else None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": "length" if last else None}
        chunk = {
            "id": answer_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
        if last:
            chunk["usage"] = usage
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
