"""The front door's table, fed by the sync (front_door/cli.py, publish.py): in-process, no router.

What a client relies on: the door serves what the sync last pushed, keeps it when the sync is gone,
refuses a malformed push, and a model Motor withdraws leaves the door's table before the router
loses its last worker (else the router, with no worker of that model, would send its requests to
another model's engine)."""

from __future__ import annotations

import asyncio

from front_door.cli import PushedTable
from motor.ports import free_port
from motor.v1 import controller_pb2, types_pb2
from router_sync.publish import TablePublisher
from router_sync.sync import RouterSync
from tests.support import serve_app


def endpoint(url: str, model: str) -> controller_pb2.Endpoint:
    return controller_pb2.Endpoint(url=url, models=[model], role=types_pb2.ROLE_UNION)


class FakeAdmin:
    """The router's admin API as RouterSync uses it; `calls` in order, with the door's table at each."""

    base_url = "http://router"

    def __init__(self, door: PushedTable):
        self.door, self.held, self.calls = door, set(), []

    async def workers(self) -> set[str]:
        return set(self.held)

    async def add(self, url, worker_type=None, model=None) -> None:
        self.held.add(url)
        self.calls.append(("add", url, dict(self.door.served())))

    async def remove(self, url) -> None:
        self.held.discard(url)
        self.calls.append(("remove", url, dict(self.door.served())))


async def serving(table: PushedTable):
    return await serve_app(table.app())


def test_a_push_is_taken_whole_and_a_malformed_one_refused_naming_the_shape():
    table = PushedTable(clock=lambda: 10.0)
    assert not table.known() and table.served() == {} and table.age() == -1
    assert table.take({"served": {"sim-a": None, "lora": "sim-a"}}) is None
    assert table.known() and table.served() == {"sim-a": None, "lora": "sim-a"} and table.age() == 0
    for bad in (None, [], {"served": ["sim-a"]}, {"served": {"sim-a": 3}}, {"models": {}}):
        assert "give {" in table.take(bad)
    assert table.served() == {"sim-a": None, "lora": "sim-a"}  # a refused push changes nothing


async def test_a_withdrawn_model_leaves_the_doors_table_before_the_router_loses_its_worker():
    door = PushedTable()
    runner, url = await serving(door)
    said: list[str] = []
    publisher = TablePublisher(url, said.append)
    admin = FakeAdmin(door)
    sync = RouterSync(admin, said.append, by_model=True)
    sync.publish = publisher.push
    running = asyncio.create_task(sync.run())
    try:
        sync.apply(
            controller_pb2.WatchEndpointsResponse(
                snapshot=True, added=[endpoint("http://e1:1", "sim-a"), endpoint("http://e2:2", "sim-b")]
            )
        )
        for _ in range(100):
            if door.served() == {"sim-a": None, "sim-b": None}:
                break
            await asyncio.sleep(0.02)
        assert door.served() == {"sim-a": None, "sim-b": None}
        # Added first, then served: the door never names a model the router cannot route yet.
        assert [(call, table) for call, _, table in admin.calls] == [("add", {}), ("add", {})]
        sync.apply(controller_pb2.WatchEndpointsResponse(removed=[endpoint("http://e2:2", "sim-b")]))
        for _ in range(100):
            if "http://e2:2" not in admin.held:
                break
            await asyncio.sleep(0.02)
        assert admin.calls[-1] == ("remove", "http://e2:2", {"sim-a": None})
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await publisher.close()
        await runner.cleanup()
    assert said == []


async def test_a_door_that_does_not_answer_is_said_once_and_gets_the_table_when_back():
    door = PushedTable()
    port = free_port()
    said: list[str] = []
    publisher = TablePublisher(f"http://127.0.0.1:{port}", said.append, interval=0.05)
    pushing = asyncio.create_task(publisher.run(lambda: {"sim-a": None}))
    try:
        await asyncio.sleep(0.3)  # several periodic pushes fail: one announcement
        assert len(said) == 1 and "does not take the table" in said[0]
        runner, _ = await serve_app(door.app(), port)
        for _ in range(100):
            if door.known():
                break
            await asyncio.sleep(0.02)
        assert door.served() == {"sim-a": None}
        assert said[1:] == [f"front door http://127.0.0.1:{port}/served takes the table again"]
        await runner.cleanup()
    finally:
        pushing.cancel()
        await asyncio.gather(pushing, return_exceptions=True)
        await publisher.close()
