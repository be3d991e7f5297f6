"""The engines the sync pushes to the front door's KV routing: those Motor lists with a KV-events
address (the controller's --kv-events), as the door parses them, dropped when Motor drops them,
none in a P/D router."""

from __future__ import annotations

import asyncio

from front_door.cli import PushedTable
from front_door.kv_routing import parse_engines
from motor.v1 import controller_pb2, types_pb2
from router_sync.publish import TablePublisher
from router_sync.sync import RouterSync
from tests.support import serve_app


def endpoint(n: int, kv_events: bool = True, generation: int = 1, role=types_pb2.ROLE_UNION):
    return controller_pb2.Endpoint(
        engine_id=f"u-{n}/rank0",
        url=f"http://e{n}:80",
        models=["sim-a", "lora-1"],
        role=role,
        kv_events=f"tcp://e{n}:90" if kv_events else "",
        tokenizer="sim" if kv_events else "",
        generation=generation,
    )


def sync(pd: bool = False) -> RouterSync:
    return RouterSync(admin=None, announce=lambda line: None, pd=pd)  # type: ignore[arg-type]


def test_the_listed_engines_with_kv_events_are_pushed_as_the_door_parses_them():
    s = sync()
    s.apply(controller_pb2.WatchEndpointsResponse(snapshot=True, added=[endpoint(2), endpoint(1), endpoint(3, False)]))
    engines = s.kv_engines()
    assert engines == [
        {"engine_id": f"u-{n}/rank0", "generation": 1, "url": f"http://e{n}:80", "models": ["sim-a", "lora-1"],
         "kv_events": f"tcp://e{n}:90", "tokenizer": "sim"} for n in (1, 2)
    ]  # fmt: skip
    parsed = parse_engines(engines)
    assert [(e.engine_id, e.kv_events, e.models) for e in parsed] == [
        ("u-1/rank0", "tcp://e1:90", frozenset({"sim-a", "lora-1"})),
        ("u-2/rank0", "tcp://e2:90", frozenset({"sim-a", "lora-1"})),
    ]
    # Replaced in one change (a new copy at the same URL): the new generation is pushed.
    s.apply(controller_pb2.WatchEndpointsResponse(removed=[endpoint(1)], added=[endpoint(1, generation=2)]))
    assert [(e["url"], e["generation"]) for e in s.kv_engines()] == [("http://e1:80", 2), ("http://e2:80", 1)]
    s.apply(controller_pb2.WatchEndpointsResponse(removed=[endpoint(2)]))
    assert [e["url"] for e in s.kv_engines()] == ["http://e1:80"]
    s.apply(controller_pb2.WatchEndpointsResponse(snapshot=True, added=[endpoint(3, False)]))
    assert s.kv_engines() == []


def test_a_pd_router_pushes_no_engine():
    # A request sent straight to one engine would skip its prefill/decode pair.
    s = sync(pd=True)
    s.apply(
        controller_pb2.WatchEndpointsResponse(
            snapshot=True, added=[endpoint(1, role=types_pb2.ROLE_PREFILL), endpoint(2, role=types_pb2.ROLE_DECODE)]
        )
    )
    assert s.kv_engines() == []


async def test_the_push_carries_the_engines_to_the_door():
    door = PushedTable()
    taken: list = []
    door.take_engines = lambda value: taken.append(value)  # (KvRouting.take: None, taken)
    runner, url = await serve_app(door.app())
    s = sync()
    s.apply(controller_pb2.WatchEndpointsResponse(snapshot=True, added=[endpoint(1)]))
    publisher = TablePublisher(url, lambda line: None, engines=s.kv_engines)
    try:
        await publisher.push(lambda: {"sim-a": None})
        assert door.served() == {"sim-a": None}
        assert taken == [s.kv_engines()] and taken[0][0]["kv_events"] == "tcp://e1:90"
    finally:
        await publisher.close()
        await runner.cleanup()
    await asyncio.sleep(0)
