"""The sync tells the front door which models Motor serves but no engine can serve right now
(router_sync/sync.py `unavailable`, pushed with the table): the door answers those 503 with
Retry-After, which clients retry, not 404 "does not exist", which they do not."""

from __future__ import annotations

import asyncio

from front_door.cli import PushedTable
from motor.v1 import controller_pb2, types_pb2
from router_sync.publish import TablePublisher
from router_sync.sync import RouterSync
from tests.support import serve_app
from tests.support.router_admin import FakeRouterAdmin


def endpoint(url: str, *models: str) -> controller_pb2.Endpoint:
    return controller_pb2.Endpoint(url=url, models=models, role=types_pb2.ROLE_UNION)


async def until(predicate, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_served_model_with_no_engine_is_pushed_as_unavailable_until_its_deployment_goes():
    door = PushedTable()
    runner, url = await serve_app(door.app())
    said: list[str] = []
    sync = RouterSync(FakeRouterAdmin(), said.append, by_model=True)
    publisher = TablePublisher(url, said.append, unavailable=sync.unavailable)
    sync.publish = publisher.push
    running = asyncio.create_task(sync.run())
    try:
        sync.apply(
            controller_pb2.WatchEndpointsResponse(
                snapshot=True,
                added=[endpoint("http://e1:1", "sim-a"), endpoint("http://e2:2", "sim-b")],
                models_added=["lora-a", "sim-a", "sim-b"],  # lora-a: in the deployment, not loaded anywhere
            )
        )
        await until(lambda: door.served() == {"sim-a": None, "sim-b": None}, "both models served")
        assert door.unavailable() == {"lora-a"}
        # sim-a's only engine stalls: out of the endpoints, its deployment still there.
        sync.apply(controller_pb2.WatchEndpointsResponse(removed=[endpoint("http://e1:1", "sim-a")]))
        await until(lambda: door.served() == {"sim-b": None}, "sim-a withdrawn")
        assert door.unavailable() == {"lora-a", "sim-a"}
        # Its deployment deleted: Motor serves it no more (404 again).
        sync.apply(controller_pb2.WatchEndpointsResponse(models_removed=["lora-a", "sim-a"]))
        await until(lambda: not door.unavailable(), "sim-a no longer Motor's")
        assert door.served() == {"sim-b": None}
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await publisher.close()
        await runner.cleanup()
    assert said == []


def test_a_push_without_unavailable_names_none_and_a_malformed_list_is_refused():
    table = PushedTable()
    assert table.take({"served": {"sim-a": None}}) is None and table.unavailable() == frozenset()
    assert table.take({"served": {}, "unavailable": ["sim-a"]}) is None and table.unavailable() == {"sim-a"}
    for bad in ({"served": {}, "unavailable": "sim-a"}, {"served": {}, "unavailable": [3]}):
        assert "give {" in table.take(bad)
    assert table.unavailable() == {"sim-a"}  # a refused push changes nothing
