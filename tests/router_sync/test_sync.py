"""RouterSync against the real routers (vllm-router, and SGLang's gateway where it behaves the
same), simulated engine servers behind them."""

from __future__ import annotations

import asyncio
import time

import pytest

from motor.v1 import controller_pb2, types_pb2
from tests.support.engine_server_process import engine_server, sim_config  # noqa: F401 (fixtures)
from tests.support.model_routing import Running, snapshot, until
from tests.support.router_process import any_router, router  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes  # the real routers and engine servers

UNION = types_pb2.ROLE_UNION


def endpoint(engine, name: str) -> controller_pb2.Endpoint:
    return controller_pb2.Endpoint(
        instance_id=name, engine_id=f"{name}/rank0", role=UNION, url=f"http://127.0.0.1:{engine.port}"
    )


async def both_added(router, running, first, second) -> None:
    """Motor lists both engines; the router holds them both."""
    running.sync.apply(snapshot(endpoint(first, "u-0"), endpoint(second, "u-1")))
    await until(lambda: len(router.workers()) == 2, what="both engines added")


@pytest.fixture
def two_engines(engine_server):
    first = engine_server(sim_config("union"), role="union", instance_id="u-0")
    second = engine_server(sim_config("union"), role="union", instance_id="u-1")
    for engine in (first, second):
        engine.wait_status(types_pb2.HEALTH_STATUS_NORMAL)
    return first, second


async def test_snapshot_adds_listed_engines_and_removes_what_motor_does_not_list(any_router, two_engines):
    router = any_router
    first, second = two_engines
    stranger = f"http://127.0.0.1:{second.port}"
    router.add(stranger)  # a worker added by hand, not listed by Motor
    async with Running(router.url) as running:
        await asyncio.sleep(0.3)
        assert router.workers() == {stranger}, "before Motor's first list the router is left alone"
        running.sync.apply(snapshot(endpoint(first, "u-0")))
        await until(lambda: router.workers() == {f"http://127.0.0.1:{first.port}"}, what="the snapshot applied")
        assert running.events == []


async def test_a_removed_endpoint_leaves_the_router_within_milliseconds(any_router, two_engines):
    router = any_router
    first, second = two_engines
    async with Running(router.url) as running:
        await both_added(router, running, first, second)
        began = time.monotonic()
        running.sync.apply(controller_pb2.WatchEndpointsResponse(removed=[endpoint(second, "u-1")]))
        await until(lambda: router.workers() == {f"http://127.0.0.1:{first.port}"}, what="the removal")
        assert time.monotonic() - began < 1.0


async def test_a_restarted_router_gets_the_whole_list_again_with_one_announcement_each_way(any_router, two_engines):
    router = any_router
    first, second = two_engines
    async with Running(router.url) as running:
        await both_added(router, running, first, second)
        router.stop()
        running.sync.apply(controller_pb2.WatchEndpointsResponse(removed=[endpoint(second, "u-1")]))
        await until(lambda: any("not answering" in e for e in running.events), what="the router-down announcement")
        await asyncio.sleep(1.5)  # several failed retries: still one announcement
        assert sum("not answering" in e for e in running.events) == 1, running.events
        router.start()  # empty, on the same port
        await until(lambda: router.workers() == {f"http://127.0.0.1:{first.port}"}, what="the re-sync")
        await until(lambda: any("answers again" in e for e in running.events), what="the router-back announcement")
        assert len(running.events) == 2, running.events


async def test_a_worker_the_router_refuses_is_announced_with_its_answer_and_the_others_still_added(router, two_engines):
    first, _ = two_engines
    silent = controller_pb2.Endpoint(
        instance_id="gone", engine_id="gone/rank0", role=UNION, url="http://127.0.0.1:9"
    )  # nothing answers its /health
    async with Running(router.url) as running:
        running.sync.apply(snapshot(endpoint(first, "u-0"), silent))
        await until(
            lambda: any("refused worker http://127.0.0.1:9" in e for e in running.events),
            timeout=20,
            what="the refusal announcement",
        )
        assert router.workers() == {f"http://127.0.0.1:{first.port}"}
        assert "HTTP " in running.events[0] or "no answer within" in running.events[0]


async def test_a_flapping_endpoint_does_not_postpone_the_periodic_relist(router, two_engines):
    """The router's whole list is re-read every relist_interval whatever the stream does: a worker
    Motor does not list (left by a restarted router, added by hand) goes at the next re-list even
    while one deployment's endpoint comes and goes faster than that interval."""
    first, second = two_engines
    flapping = endpoint(second, "u-1")
    async with Running(router.url) as running:
        running.sync.apply(snapshot(endpoint(first, "u-0")))
        await until(lambda: router.workers() == {f"http://127.0.0.1:{first.port}"}, what="the snapshot applied")
        stranger = f"http://127.0.0.1:{second.port}"
        router.add(stranger)  # unknown to the sync: only a re-list finds it
        began, gone_after = time.monotonic(), None
        while time.monotonic() - began < 4.0:  # a change every 0.2 s, the re-list due every 0.5 s
            running.sync.apply(controller_pb2.WatchEndpointsResponse(removed=[flapping]))
            await asyncio.sleep(0.2)
            if gone_after is None and stranger not in router.workers():
                gone_after = time.monotonic() - began
        assert gone_after is not None, "the stranger stayed: the flapping stream postponed every re-list"
        assert gone_after < 3.0, gone_after


async def test_a_router_restarted_between_two_calls_is_counted_once_and_given_its_whole_list(router, two_engines):
    """What the controller is told (ReportFrontDoor's router_restarts): a restart the sync only sees
    as an empty list at its next re-list counts as one, like one it saw not answering."""
    first, second = two_engines
    urls = {f"http://127.0.0.1:{first.port}", f"http://127.0.0.1:{second.port}"}
    async with Running(router.url) as running:
        running.sync.apply(snapshot(endpoint(first, "u-0"), endpoint(second, "u-1")))
        await until(lambda: router.workers() == urls and running.sync.held == urls, what="both engines held")
        assert running.sync.router_restarts == 0
        router.stop()
        router.start()  # empty, on the same port
        await until(lambda: router.workers() == urls, what="the whole list given again")
        await until(lambda: running.sync.held == urls and running.sync.router_restarts == 1, what="one restart")
        await asyncio.sleep(1.5)  # several re-lists later: still one
        assert running.sync.router_restarts == 1, running.events
        assert len(running.events) in (1, 2), running.events  # "(restarted)", or "not answering" and "answers again"
