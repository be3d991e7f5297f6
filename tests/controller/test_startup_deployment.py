"""The start-up --deployment on a new store (controller/startup_deployment.py): deferred until the
registered nodes run every engine it describes or the startup grace ends; an operator's call
meanwhile wins; a store that knows a deployment is never changed by the file (fake node-manager
client and clock, no processes; the real-process test is test_database_lost.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from controller.startup_deployment import POLL_SECONDS, StartupDeployment
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import (
    NODES,
    Harness,
    _lose_the_store,
    example_deployment,
    running_example,
    small_deployment,
)


async def _a_few_polls() -> None:
    await asyncio.sleep(3 * POLL_SECONDS)


async def test_a_lost_store_applies_the_file_once_the_nodes_run_every_engine_it_describes(harness):
    await running_example(harness)
    running = await _lose_the_store(harness)
    StartupDeployment(harness.controller, "deployment.yaml", example_deployment(), window=600).begin()
    await _a_few_polls()
    assert harness.controller.deployment is None  # no node registered yet: nothing to adopt
    # The node running fewer engines first: the other one still holds some of the file's engines.
    first, last = sorted(NODES, key=lambda n: len(harness.client.engines.get(n, {})))
    await harness.register(first)
    await _a_few_polls()
    assert harness.controller.deployment is None
    await harness.register(last)
    await async_wait_for(lambda: harness.controller.deployment is not None, timeout=5, what="the file applied")
    harness.beat(*NODES)
    await async_wait_for(
        lambda: all(i.state == C.INSTANCE_STATE_READY for i in harness.controller.instances.values()),
        timeout=5,
        what="every instance READY with the adopted engines",
    )
    assert not harness.client.starts() and not harness.client.stops()
    slots = {(s.node_id, s.engine_id): s.generation for s in harness.controller.state.slots.values()}
    assert slots == {k: g for k, (_, g) in running.items()}
    assert any("2 instance(s) adopted" in e.message for e in harness.controller.events.recent)


@contextlib.asynccontextmanager
async def waiting_on_a_new_store(tmp_path) -> AsyncIterator[tuple[Harness, ManualClock]]:
    """A controller on a new store whose start-up file waits (startup grace 5 s, a manual clock)."""
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock)
    try:
        await h.start()
        StartupDeployment(h.controller, "deployment.yaml", example_deployment(), window=5).begin()
        yield h, clock
    finally:
        await h.stop()


async def test_a_first_start_applies_the_file_when_the_startup_grace_ends(tmp_path):
    async with waiting_on_a_new_store(tmp_path) as (h, clock):
        await h.register("node-a")  # a brand-new node: it runs nothing
        await _a_few_polls()
        assert h.controller.deployment is None
        clock.advance(5)
        await async_wait_for(lambda: h.controller.revision == 1, timeout=5, what="the file applied after the grace")
        await async_wait_for(lambda: len(h.client.starts()) == 3, timeout=5, what="its engines started")


async def test_without_a_startup_grace_the_file_is_applied_at_once(tmp_path):
    h = Harness(tmp_path, startup_grace=0)
    try:
        await h.start()
        StartupDeployment(h.controller, "deployment.yaml", example_deployment(), window=0).begin()
        assert h.controller.revision == 1
    finally:
        await h.stop()


async def test_an_operators_apply_during_the_wait_wins_over_the_file(tmp_path):
    async with waiting_on_a_new_store(tmp_path) as (h, clock):
        own = small_deployment([{"name": "u", "role": "union", "count": 1}])
        await h.controller.apply(own)
        clock.advance(5)
        await _a_few_polls()
        assert h.controller.revision == 1 and h.controller.deployment.instance_groups[0].name == "u"


async def test_a_store_that_knows_a_deployment_is_not_changed_by_the_file(tmp_path, caplog):
    """The stored revision may be an operator's newer apply (or, under HA, the file is handed to
    every controller and begins on each election): the file seeds a new store only."""
    h = Harness(tmp_path)
    try:
        await h.start()
        h.controller.apply_deployment(example_deployment())
        await h.stop()
        await h.start()
        changed = example_deployment()
        changed.restart_policy.max_failures = 9
        with caplog.at_level("INFO", logger="controller.startup_deployment"):
            StartupDeployment(h.controller, "deployment.yaml", changed, window=600).begin()
            await _a_few_polls()
        assert h.controller.revision == 1 and h.controller.deployment.restart_policy.max_failures != 9
        assert "deployment.yaml not applied: the store holds revision 1, a different deployment" in caplog.text
        h.controller.delete_deployment()  # deleted is the operator's word too
        StartupDeployment(h.controller, "deployment.yaml", changed, window=600).begin()
        await _a_few_polls()
        assert h.controller.deployment is None
    finally:
        await h.stop()
