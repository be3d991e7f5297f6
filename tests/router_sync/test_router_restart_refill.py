"""A router restarted between two of the sync's passes is empty, and the front door keeps sending
it requests: the sync finds it and gives it its whole list within its watch interval (0.5 s), not
at the next re-list (5 s) or at the end of a backoff grown while the router was down. Default
settings throughout."""

from __future__ import annotations

import asyncio
import time

from motor.v1 import controller_pb2, types_pb2
from router_sync.sync import RouterSync
from tests.support.router_admin import FakeRouterAdmin

WANTED = {"http://e1:1", "http://e2:2"}


def snapshot() -> controller_pb2.WatchEndpointsResponse:
    added = [controller_pb2.Endpoint(url=url, models=["sim-a"], role=types_pb2.ROLE_UNION) for url in sorted(WANTED)]
    return controller_pb2.WatchEndpointsResponse(snapshot=True, added=added, models_added=["sim-a"])


async def seconds_until(predicate, timeout: float) -> float:
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - began


async def kept(admin: FakeRouterAdmin, said: list[str]):
    sync = RouterSync(admin, said.append, by_model=True)
    running = asyncio.create_task(sync.run())
    sync.apply(snapshot())
    await seconds_until(lambda: admin.held == WANTED and sync.held == WANTED, 5)
    return sync, running


async def test_a_router_restarted_between_passes_is_refilled_within_a_second():
    admin, said = FakeRouterAdmin(), []
    sync, running = await kept(admin, said)
    try:
        await asyncio.sleep(0.3)  # mid-way between re-lists
        admin.restart()
        took = await seconds_until(lambda: admin.held == WANTED, 6)
        assert took < 1.0, f"the restarted router was empty for {took:.1f}s"
        assert sync.router_restarts == 1
        assert any("restarted" in line for line in said), said
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_router_back_after_seconds_down_is_refilled_at_once_not_after_the_backoff():
    admin, said = FakeRouterAdmin(), []
    sync, running = await kept(admin, said)
    try:
        admin.down = True
        admin.restart()
        # A change while it is down: the sync's calls fail and its backoff grows (0.2 s doubling).
        sync.apply(controller_pb2.WatchEndpointsResponse(removed=[controller_pb2.Endpoint(url="http://e2:2")]))
        await asyncio.sleep(3.5)
        assert admin.held == set()
        admin.down = False  # started again, empty
        took = await seconds_until(lambda: admin.held == {"http://e1:1"}, 8)
        assert took < 1.0, f"the router was back and empty for {took:.1f}s"
        assert any("answers again" in line for line in said), said
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
