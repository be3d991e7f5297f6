"""An in-process simulated engine on a free port, and its answers read as a client reads them:
whole, or as server-sent events (each with the time it arrived)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from motor.ports import free_port


@asynccontextmanager
async def sim_session(**engine_args: Any) -> AsyncIterator[tuple[SimEngine, aiohttp.ClientSession]]:
    port = free_port()
    engine = SimEngine(
        EngineOptions(role="union", instance_id="t", dp_rank=0, host="127.0.0.1", port=port,
                      master_dp_ip="127.0.0.1", engine_args={"model": "tiny", **engine_args})
    )  # fmt: skip
    await engine.start()
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            yield engine, session
    finally:
        await engine.shutdown()


async def answer(session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def events(session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> list[tuple[float, Any]]:
    """The stream's events, each (monotonic time it arrived, its JSON or "[DONE]")."""
    received: list[tuple[float, Any]] = []
    async with session.post(path, json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            text = line.decode().strip()
            if text.startswith("data: "):
                data = text[len("data: ") :]
                received.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    return received


def streamed_tokens(chunks: list[tuple[float, Any]]) -> tuple[list[int], list[str]]:
    """A stream's generated ids and each token's text (a chat stream's role chunk and the usage left out)."""
    ids: list[int] = []
    texts: list[str] = []
    for _, chunk in chunks:
        if chunk == "[DONE]" or not chunk["choices"] or "role" in chunk["choices"][0].get("delta", {}):
            continue
        choice = chunk["choices"][0]
        ids += choice["token_ids"]
        texts.append(choice["delta"]["content"] if "delta" in choice else choice["text"])
    return ids, texts
