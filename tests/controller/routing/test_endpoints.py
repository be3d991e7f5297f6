"""What routers are given: only engines that can serve (ListEndpoints), and every change of that
list on the WatchEndpoints feed; and the stop deadline covering what the engine asked for.
The controller against a fake node-manager client."""

from __future__ import annotations

import asyncio

from motor.contract import pbtime
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, running_example

ALL = {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}


def listed(h) -> set[str]:
    return {e.engine_id for e in h.controller.list_endpoints()}


def engine(h, engine_id: str) -> T.Engine:
    return next(e for node in h.client.engines.values() for key, e in node.items() if key == engine_id)


def beat_all(h) -> None:
    h.beat(*h.generations)


async def next_change(subscription) -> C.WatchEndpointsResponse:
    return await asyncio.wait_for(subscription.__anext__(), 5)


async def test_only_engines_that_can_serve_are_listed_and_every_change_is_streamed(harness):
    h = harness
    await running_example(h)
    feed = h.controller.endpoints.subscribe()
    snapshot = await next_change(feed)
    assert snapshot.snapshot and {e.engine_id for e in snapshot.added} == ALL == listed(h)

    engine(h, "decode-0/rank0").draining = True  # Drain or SIGTERM: it answers 503 now
    beat_all(h)
    change = await next_change(feed)
    assert [e.engine_id for e in change.removed] == ["decode-0/rank0"] and not change.added
    assert listed(h) == ALL - {"decode-0/rank0"}

    engine(h, "prefill-0/rank1").sleeping = True
    beat_all(h)
    assert [e.engine_id for e in (await next_change(feed)).removed] == ["prefill-0/rank1"]
    engine(h, "prefill-0/rank1").sleeping = False  # woken up: listed again
    beat_all(h)
    assert [e.engine_id for e in (await next_change(feed)).added] == ["prefill-0/rank1"]

    # One rank ABNORMAL: the instance is DEGRADED; that rank goes, its NORMAL sibling still serves.
    engine(h, "prefill-0/rank0").health = T.HEALTH_STATUS_ABNORMAL
    beat_all(h)
    assert [e.engine_id for e in (await next_change(feed)).removed] == ["prefill-0/rank0"]
    await async_wait_for(lambda: h.instance("prefill-0").state == C.INSTANCE_STATE_DEGRADED, timeout=5)
    assert listed(h) == {"prefill-0/rank1"}
    feed.close()


async def test_a_failed_engine_is_removed_on_the_stream_with_its_whole_instance(harness):
    h = harness
    await running_example(h)
    feed = h.controller.endpoints.subscribe()
    await next_change(feed)
    failed = engine(h, "prefill-0/rank0")
    failed.state = T.ENGINE_STATE_FAILED
    node_id = failed.node_id
    h.controller.report_engine_event(node_id, h.generations[node_id], failed, "killed by signal 9 (SIGKILL)")
    change = await next_change(feed)
    assert "prefill-0/rank0" in {e.engine_id for e in change.removed}, change
    assert "prefill-0/rank0" not in listed(h)
    feed.close()


async def test_a_deleted_deployment_leaves_the_list_before_any_engine_is_stopped(harness):
    h = harness
    await running_example(h)
    feed = h.controller.endpoints.subscribe()
    await next_change(feed)
    h.controller.delete_deployment()
    assert listed(h) == set() and h.controller.endpoints.current == {}  # at once, synchronously
    assert h.client.stops() == [], "no stop was sent before the list changed"
    removed = set()
    while removed != ALL:
        removed |= {e.engine_id for e in (await next_change(feed)).removed}
    feed.close()


async def test_the_stop_deadline_covers_the_engines_own_stop_grace(harness):
    h = harness
    await running_example(h)
    engine(h, "decode-0/rank0").stop_grace.CopyFrom(pbtime.duration(41.0))  # drain_timeout 30 + shutdown
    beat_all(h)
    h.controller.delete_deployment()
    await async_wait_for(lambda: len(h.client.stops()) == 3, timeout=5, what="three StopEngine calls")
    deadlines = {c[2]: c[4] for c in h.client.calls if c[0] == "stop"}
    assert deadlines["decode-0/rank0"] == 41.0
    assert deadlines["prefill-0/rank0"] == h.config.stop_deadline  # no stop grace stated: the default


async def test_a_refresh_of_many_engines_goes_out_in_slices_that_yield_to_the_loop(harness, monkeypatch):
    """A change of every engine (tens of thousands in a big fleet) is re-read in slices, one
    message each, with the loop free between them; together they say what one refresh would."""
    from controller.routing import endpoints
    from controller.rules.slicing import Budget

    h = harness
    await running_example(h)
    feed = h.controller.endpoints.subscribe()
    await next_change(feed)
    monkeypatch.setattr(endpoints, "Budget", lambda: Budget(seconds=0.0))  # one engine per slice
    for engine_id in ALL:
        engine(h, engine_id).draining = True
    beat_all(h)
    removed = []
    for _ in ALL:
        change = await next_change(feed)
        assert len(change.removed) == 1 and not change.added
        removed += [e.engine_id for e in change.removed]
    assert sorted(removed) == sorted(ALL) and not listed(h)
    feed.close()


async def restarted_with_two_known_nodes(tmp_path) -> Harness:
    """A controller restarted on a store that knows two nodes (interval 1 s, a long start-up grace)."""
    h = Harness(tmp_path, heartbeat_interval=1.0, node_grace=5.0, startup_grace=30.0)
    await h.start()
    await h.register("node-a")
    await h.register("node-b")
    await h.stop()
    await h.start()
    return h


async def test_a_restarted_controller_gives_routers_its_endpoints_once_the_nodes_have_reported(tmp_path):
    """Before the nodes report to a new process it knows no engine's health: a snapshot then
    would take every worker out of the routers."""
    h = await restarted_with_two_known_nodes(tmp_path)
    try:
        heard = asyncio.create_task(h.controller.engines_heard())
        await asyncio.sleep(0.5)
        h.beat("node-a")
        await asyncio.sleep(0.3)
        assert not heard.done(), "one of two nodes has reported"
        h.beat("node-b")
        await asyncio.wait_for(heard, timeout=0.5)
    finally:
        await h.stop()


async def test_a_node_that_stays_silent_holds_the_endpoints_back_two_heartbeat_intervals_only(tmp_path):
    h = await restarted_with_two_known_nodes(tmp_path)
    try:
        h.beat("node-a")
        began = asyncio.get_running_loop().time()
        await asyncio.wait_for(h.controller.engines_heard(), timeout=10)
        assert 1.0 < asyncio.get_running_loop().time() - began < 4.0
    finally:
        await h.stop()


async def test_a_not_serving_engine_leaves_the_endpoints_at_once_with_an_event_and_comes_back(harness):
    # The engine's stall watchdog: requests in flight and no progress. Its health stays NORMAL
    # (it is not killed yet), but routers must stop sending to it now.
    h = harness
    await running_example(h)
    feed = h.controller.endpoints.subscribe()
    await next_change(feed)
    stalled = engine(h, "decode-0/rank0")
    stalled.not_serving_reason = "no progress for 3.0 s with 12 requests in flight"
    h.controller.report_engine_event(stalled.node_id, h.generations[stalled.node_id], stalled, "not serving: ...")
    change = await next_change(feed)
    assert [e.engine_id for e in change.removed] == ["decode-0/rank0"] and not change.added
    assert listed(h) == ALL - {"decode-0/rank0"}
    assert h.instance("decode-0").state == C.INSTANCE_STATE_READY  # nothing restarts it yet
    events = [e for e in h.controller.events.recent if e.type == C.EVENT_TYPE_ENGINE_NOT_SERVING]
    assert [e.message for e in events] == [
        f"engine decode-0/rank0 on {stalled.node_id} not serving: no progress for 3.0 s with 12 requests in "
        "flight; out of the endpoints"
    ]
    assert events[0].engine_id == "decode-0/rank0" and events[0].instance_id == "decode-0"

    stalled.not_serving_reason = ""  # progress resumed
    beat_all(h)
    assert [e.engine_id for e in (await next_change(feed)).added] == ["decode-0/rank0"]
    events = [e for e in h.controller.events.recent if e.type == C.EVENT_TYPE_ENGINE_NOT_SERVING]
    assert events[-1].message == f"engine decode-0/rank0 on {stalled.node_id} serving again"
    feed.close()
