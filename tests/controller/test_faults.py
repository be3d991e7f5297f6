"""Faults found by reproduction (issue 12), each replayed against the controller with a fake
node-manager client: simultaneous failures, big deployments, bad input."""

from __future__ import annotations

import asyncio

from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T

from tests.controller.conftest import Harness, small_deployment
from tests.support import async_wait_for


async def test_ranks_that_died_together_while_the_controller_was_down_count_as_one_failure(tmp_path):
    """dp=5, every rank dead when the controller comes back: 5 ENGINE_FAILED arrive in the same
    registration. Live, the same kill counts once; so must it here (not FAILED with 0 restarts)."""
    h = Harness(tmp_path)
    try:
        await h.start()
        await h.register("node-a", accelerators=5)
        h.controller.apply_deployment(small_deployment(
            [{"name": "wide", "role": "union", "data_parallel_size": 5}],
            restart_policy={"max_failures": 3, "scope": "group"},
        ))
        await async_wait_for(lambda: len(h.client.starts()) == 5, timeout=5, what="5 StartEngine calls")
        h.client.set_health("node-a")
        h.beat("node-a")
        await async_wait_for(lambda: h.instance("wide-0").state == C.INSTANCE_STATE_READY, timeout=5)
        client = h.client
        await h.stop()
        for engine in client.engines["node-a"].values():
            engine.state, engine.exit_signal = T.ENGINE_STATE_FAILED, 9
        ctl = await h.start(client)
        await h.register("node-a", accelerators=5)  # reports the 5 dead ranks at once
        inst = h.instance("wide-0")
        assert inst.state == C.INSTANCE_STATE_RESTARTING, inst.reason
        assert len(inst.failure_times) == 1 and inst.consecutive_failures == 1
        assert sum(1 for e in ctl.events.recent if e.type == C.EVENT_TYPE_ENGINE_FAILED) == 5  # each rank's cause is told
        await async_wait_for(lambda: len(client.starts()) == 10, timeout=5, what="the group started again once")
        assert h.instance("wide-0").restarts == 1
        await asyncio.sleep(0.2)
        assert len(client.starts()) == 10
    finally:
        await h.stop()
