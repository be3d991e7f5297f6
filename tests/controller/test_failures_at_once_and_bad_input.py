"""Failures that arrive together, big deployments and bad input, each replayed against the controller with a fake
node-manager client."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import async_wait_for
from tests.support.controller_harness import Harness, small_deployment


async def test_ranks_that_died_together_while_the_controller_was_down_count_as_one_failure(tmp_path):
    """dp=5, every rank dead when the controller comes back: 5 ENGINE_FAILED arrive in the same
    registration. Live, the same kill counts once; so must it here (not FAILED with 0 restarts)."""
    h = Harness(tmp_path)
    try:
        await h.start()
        await h.register("node-a", accelerators=5)
        h.controller.apply_deployment(
            small_deployment(
                [{"name": "wide", "role": "union", "data_parallel_size": 5}],
                restart_policy={"max_failures": 3, "scope": "group"},
            )
        )
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
        assert (
            sum(1 for e in ctl.events.recent if e.type == C.EVENT_TYPE_ENGINE_FAILED) == 5
        )  # each rank's cause is told
        await async_wait_for(lambda: len(client.starts()) == 10, timeout=5, what="the group started again once")
        assert h.instance("wide-0").restarts == 1
        await asyncio.sleep(0.2)
        assert len(client.starts()) == 10
    finally:
        await h.stop()


async def call_code(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


async def test_a_1mb_node_id_is_refused_with_a_short_message(served):
    huge = "n" * (1 << 20)
    for call in (
        served.Heartbeat(C.HeartbeatRequest(node_id=huge, generation=1)),
        served.RegisterNode(C.RegisterNodeRequest(node=C.NodeInfo(node_id=huge, address="127.0.0.1:1"))),
    ):
        code, details = await call_code(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])  # the id rule before the lookup
        assert details.startswith(("node_id ", "node.node_id ")) and len(details) < 2000 and "characters" in details


async def test_a_nul_byte_in_a_node_host_is_invalid_argument(served):
    info = C.NodeInfo(node_id="node-a", address="127.0.0.1:1", host="10.0.0.1\x00evil")
    code, details = await call_code(served.RegisterNode(C.RegisterNodeRequest(node=info)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node.host" in details


async def test_list_endpoints_of_an_unknown_role_is_invalid_argument(served):
    code, details = await call_code(served.ListEndpoints(C.ListEndpointsRequest(role=99)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "role" in details and "99" in details


async def test_a_fence_that_keeps_failing_is_retried_with_backoff_and_told_once():
    """A copy whose stop kept failing was fenced again every second (31
    ENGINE_FENCED events in 31 s, flushing the event history). Now: one event whose count grows
    with each failed try, retries after a doubling backoff capped at FENCE_WINDOW."""
    from controller.engines.actuator import FENCE_WINDOW, Actuator
    from controller.model.events import EventBus
    from controller.model.nodes import NodeTable
    from tests.support.controller_fakes import FakeNodeClient, ManualClock
    from tests.support.controller_harness import runtime

    client, clock, events = FakeNodeClient(), ManualClock(), EventBus()
    client.unreachable.add("node-a")  # every StopEngine fails
    nodes = NodeTable()
    nodes.put(runtime("node-a"))
    tasks: list[asyncio.Task] = []
    actuator = Actuator(client, nodes, 5.0, lambda coro, name: tasks.append(asyncio.create_task(coro)), events, clock)
    counts = []
    for _ in range(31):  # a heartbeat a second shows the stale copy again
        actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy", fence=True)
        await asyncio.gather(*tasks)
        counts.append(events.recent[-1].count)
        clock.advance(1.0)
    assert [e.type for e in events.recent] == [C.EVENT_TYPE_ENGINE_FENCED]
    # Asked at 0 s, then after 1, 2, 4, 8 s and every FENCE_WINDOW (10 s): 0, 1, 3, 7, 15, 25.
    asked = [t for t, (c0, c1) in enumerate(zip([1] + counts, counts)) if c1 > c0]
    assert FENCE_WINDOW == 10.0 and len(client.stops()) == 6 and asked == [0, 1, 3, 7, 15, 25]
    event = events.recent[-1]
    assert event.count == 7 and "its stop failed 6 time(s) in a row, asking again in 10s" in event.message
    assert event.HasField("last_time")
    from motorctl.render import render_event

    assert render_event(event).endswith("(x7)")  # motorctl events shows the count
    client.unreachable.clear()  # the node answers again: the copy stops, the spell ends
    clock.advance(FENCE_WINDOW)
    actuator.stop_copy("node-a", "u-0/rank0", 3, "stale copy", fence=True)
    await asyncio.gather(*tasks)
    assert not actuator.unfinished and not events.is_repeating(("fence", ("node-a", "u-0/rank0", 3)))
    assert len(events.recent) == 1


async def test_a_start_on_an_unreachable_node_backs_off_to_its_cap_with_one_counting_event(tmp_path):
    """The reconcile loop retried StartEngine on an unreachable node every heartbeat interval with
    a warning per try; now after 1, 2, 4, 8, 10, 10 s, told by one RETRYING event that counts."""
    from controller.engines.actuator import RETRY_CAP
    from tests.support.controller_fakes import ManualClock
    from tests.support.controller_harness import Harness, example_deployment

    clock = ManualClock()
    h = Harness(tmp_path, clock=clock, node_grace=1000.0)
    await h.start()
    await h.register("node-a", accelerators=8)
    h.client.unreachable.add("node-a")
    h.controller.apply_deployment(example_deployment())
    slot = h.controller.state.slots["decode-0/rank0"]
    waits = []
    for _ in range(7):
        tries = len(h.client.starts("decode-0/rank0"))
        h.controller.reconcile_once()
        await async_wait_for(lambda: len(h.client.starts("decode-0/rank0")) == tries + 1 and not slot.busy, timeout=5)
        waits.append(slot.retry_at - clock())
        clock.advance(waits[-1])
        h.beat("node-a")
    assert waits == [1.0, 2.0, 4.0, 8.0, RETRY_CAP, RETRY_CAP, RETRY_CAP]
    retrying = [
        e for e in h.controller.events.recent if e.type == C.EVENT_TYPE_RETRYING and e.engine_id == "decode-0/rank0"
    ]
    assert len(retrying) == 1 and retrying[0].count == 7
    assert (
        "StartEngine of decode-0/rank0 on node-a failed 7 time(s) in a row, trying again in 10s" in retrying[0].message
    )
    h.client.unreachable.clear()
    h.controller.reconcile_once()
    await async_wait_for(lambda: slot.launched, timeout=5, what="started once the node answers")
    assert not h.controller.actuator.start_failures and not h.controller.events.is_repeating(
        ("start", "decode-0/rank0")
    )
    await h.stop()


async def test_a_start_retried_on_another_node_is_a_new_retrying_event_naming_that_node(tmp_path):
    """An engine re-placed while its starts kept failing: the one RETRYING event kept the first
    node in its node_id, and the backoff went on from where it was (found by a hostile tester)."""
    from controller.engines.node_client import NodeCallError
    from motor.v1 import types_pb2 as T
    from tests.support.controller_harness import Harness

    h = Harness(tmp_path, node_grace=1000.0)
    await h.start()
    try:
        for node_id in ("node-a", "node-b"):
            await h.register(node_id, accelerators=8)
        h.client.unreachable.update({"node-a", "node-b"})
        actuator, spec = h.controller.actuator, T.EngineSpec(instance_id="decode-0", generation=1)
        for node_id, tries in (("node-a", 3), ("node-b", 1)):
            for _ in range(tries):
                with pytest.raises(NodeCallError):
                    await actuator.start(h.controller.nodes[node_id].info, "decode-0/rank0", spec)
        retrying = [e for e in h.controller.events.recent if e.type == C.EVENT_TYPE_RETRYING]
        assert [(e.node_id, e.count) for e in retrying] == [("node-a", 3), ("node-b", 1)]
        assert "on node-b failed 1 time(s)" in retrying[1].message
        assert actuator.retry_delay("decode-0/rank0") == 1.0  # a fresh backoff on the new node
        h.client.unreachable.clear()
        await actuator.start(h.controller.nodes["node-a"].info, "decode-0/rank0", spec)  # placed back: it goes through
        events = [e for e in h.controller.events.recent if e.type == C.EVENT_TYPE_RETRYING]
        assert events[1].message.endswith("-> started on node-a instead")
    finally:
        await h.stop()


async def test_a_stop_that_keeps_failing_is_one_retrying_event_that_counts(tmp_path):
    """A removed engine's StopEngine to a node that does not answer (SIGSTOPped) was only a log
    line: nothing told the operator that the copy still ran (found by a hostile tester)."""
    from tests.support.controller_harness import Harness

    h = Harness(tmp_path, node_grace=1000.0)
    await h.start()
    try:
        await h.register("node-a", accelerators=8)
        h.client.unreachable.add("node-a")
        actuator, key = h.controller.actuator, ("node-a", "gone-0/rank0", 3)
        actuator.stop_copy(*key, "deleted with the deployment")

        def retrying():
            return [
                e
                for e in h.controller.events.recent
                if e.type == C.EVENT_TYPE_RETRYING and e.engine_id == "gone-0/rank0"
            ]

        await async_wait_for(lambda: retrying(), timeout=5, what="a RETRYING event")
        event = retrying()[0]
        assert event.node_id == "node-a" and event.count == 1
        assert "engine gone-0/rank0 on node-a: its stop failed 1 time(s) in a row" in event.message
        assert "(deleted with the deployment)" in event.message
        h.client.unreachable.clear()
        await asyncio.sleep(actuator.unfinished[key].delay())
        actuator.stop_copy(*key, "deleted with the deployment")  # asked again once its backoff is over
        await async_wait_for(lambda: not h.controller.events.is_repeating(("stop", key)), timeout=5, what="settled")
        assert len(retrying()) == 1 and not actuator.unfinished
        assert retrying()[0].message.endswith("-> stopped after 1 failed try(ies)")  # not "asking again in 1s"
    finally:
        await h.stop()


async def test_background_stops_run_from_one_queue_by_a_few_tasks(tmp_path, monkeypatch):
    """A task per stop held 40,000 waiting tasks when a 10,000 x dp 4 deployment was replaced."""
    from controller.engines import actuator as actuator_module
    from tests.support.controller_fakes import FakeNodeClient
    from tests.support.controller_harness import Harness

    class Gated(FakeNodeClient):
        def __init__(self):
            super().__init__()
            self.gate, self.open, self.most = asyncio.Event(), 0, 0

        async def stop_engine(self, node, engine_id, generation, deadline):
            self.open += 1
            self.most = max(self.most, self.open)
            try:
                await self.gate.wait()
                return await super().stop_engine(node, engine_id, generation, deadline)
            finally:
                self.open -= 1

    monkeypatch.setattr(actuator_module, "STOP_WORKERS", 2)
    h = Harness(tmp_path, node_grace=1000.0)
    client = Gated()
    await h.start(client)
    try:
        await h.register("node-a", accelerators=8)
        actuator = h.controller.actuator
        for i in range(5):
            actuator.stop_copy("node-a", f"gone-{i}/rank0", 1, "deleted with the deployment")
        await async_wait_for(lambda: client.open == 2, timeout=5, what="two stops in flight")
        assert actuator._stop_workers == 2 and len(actuator._stops) == 3
        client.gate.set()
        await async_wait_for(lambda: len(client.stops()) == 5, timeout=5, what="every stop")
        assert sorted(s[1] for s in client.stops()) == [f"gone-{i}/rank0" for i in range(5)] and client.most == 2
        await async_wait_for(lambda: actuator._stop_workers == 0, timeout=5, what="the workers gone")
    finally:
        await h.stop()
