"""A model Motor serves whose engines are all out right now (a stall, a restart) is answered 503
with Retry-After by the front door's own process, which clients retry; a name Motor does not
serve keeps vLLM's 404."""

from __future__ import annotations

import json

import httpx
import pytest
from aiohttp import web

from tests.support import serve_app
from tests.support.door_process import DoorProcess, door_log

pytestmark = pytest.mark.processes  # the front door in its own process


@pytest.fixture
async def router():
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner, url = await serve_app(app)
    yield url
    await runner.cleanup()


async def test_a_known_model_without_an_engine_is_503_with_retry_after_and_an_unknown_one_404(router, tmp_path):
    door = DoorProcess(router, door_log(tmp_path), served={"sim-b": None})
    try:
        assert door.push({"sim-b": None}, unavailable=["sim-a"])
        async with httpx.AsyncClient(base_url=door.url, timeout=5) as client:

            async def complete(model: str) -> httpx.Response:
                return await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})

            out = await complete("sim-a")
            assert out.status_code == 503, out.text
            assert out.headers.get("retry-after") == "1"
            error = out.json()["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
            assert "sim-a" in error["message"] and "Retry" in error["message"]
            missing = await complete("nope")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
            assert (await complete("sim-b")).status_code == 200
            listed = (await client.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == ["sim-b"]  # what can be sent now
            metrics = (await client.get("/metrics")).text
            assert 'motor_front_door_requests_total{code="503",model="sim-a"} 1.0' in metrics, json.dumps(metrics)
    finally:
        door.stop()
