"""Deployments of different models behind one real router kept by RouterSync: the endpoints they are
served by, the router fixture, the sync running, and the answers by model."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from motor.v1 import controller_pb2, types_pb2
from motorctl.router import TYPED_WORKER_FLAGS
from router_sync.admin import RouterAdmin
from router_sync.sync import RouterSync
from tests.support.engine_server_process import engine_server, sim_config  # noqa: F401 (fixtures)  # noqa: F401 (fixtures)
from tests.support.open_load import http
from tests.support.router_process import RouterProcess, any_router, router  # noqa: F401 (fixtures)


def served(engine, deployment: str, *models: str) -> controller_pb2.Endpoint:
    return controller_pb2.Endpoint(
        instance_id=engine.instance_id,
        engine_id=f"{engine.instance_id}/rank0",
        role=types_pb2.ROLE_UNION,
        url=f"http://127.0.0.1:{engine.port}",
        deployment=deployment,
        models=models,
    )


@pytest.fixture
def model_router(tmp_path):
    started = RouterProcess(str(tmp_path), extra=TYPED_WORKER_FLAGS)
    yield started
    started.stop()


@pytest.fixture
def chat_and_embed(engine_server):
    """Two engines of model sim-chat (deployment chat), one of sim-embed (deployment embed)."""
    engines = {}
    for instance_id, model in (("chat-0", "sim-chat"), ("chat-1", "sim-chat"), ("embed-0", "sim-embed")):
        engine = engine_server(
            sim_config("union", {"model": model, "latency_ms": 1}), role="union", instance_id=instance_id
        )
        engine.instance_id = instance_id
        engines[instance_id] = engine
    for engine in engines.values():
        engine.wait_status(types_pb2.HEALTH_STATUS_NORMAL)
    return engines


def complete(router_url: str, model: str) -> tuple[int, dict]:
    status, text = http("POST", router_url + "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})
    return status, json.loads(text)


def answers(router_url: str, model: str, count: int = 12) -> list[tuple[int, str]]:
    """(status, the model that answered) of `count` completions naming `model`. An engine of another
    model answers 404 (vLLM's body), so all 200 with the same model means no request went astray."""
    result = []
    for _ in range(count):
        status, body = complete(router_url, model)
        result.append((status, body.get("model") if status == 200 else body["error"]["type"]))
    return result


def snapshot(*endpoints) -> controller_pb2.WatchEndpointsResponse:
    return controller_pb2.WatchEndpointsResponse(added=endpoints, snapshot=True)


async def until(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class Running:
    """A RouterSync's run() in the background, and what it announced; `async with Running(url) as
    running:` closes it at the block's end."""

    def __init__(self, router_url: str, **options):
        self.events: list[str] = []
        self.admin = RouterAdmin(router_url, timeout=5)
        self.sync = RouterSync(self.admin, self.events.append, relist_interval=0.5, backoff_cap=0.5, **options)
        self.task = asyncio.get_running_loop().create_task(self.sync.run())

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.admin.close()

    async def __aenter__(self) -> Running:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
