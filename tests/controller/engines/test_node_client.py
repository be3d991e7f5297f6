"""The controller's gRPC client of node managers against a real gRPC fake node manager: transport
trouble is retried with the backoff, answers are not, and the calls leave nothing in reference
cycles (the controller freezes what survives a paced collection, controller/gc_tuning.py: cycles of a
call that outlived one, as every StartEngine of a real engine does, stayed until the rare complete
walk; tenacity's retry objects left about 30 objects per call, ~4.5 KB)."""

from __future__ import annotations

import asyncio
import gc

import grpc
import psutil
import pytest

from controller.engines import node_client
from controller.engines.node_client import GrpcNodeClient, NodeCallError
from motor.v1 import controller_pb2, node_manager_pb2, node_manager_pb2_grpc, types_pb2
from tests.support import async_wait_for


class ScriptedNodeManager(node_manager_pb2_grpc.NodeManagerServiceServicer):
    def __init__(self) -> None:
        self.errors: list[grpc.StatusCode] = []
        self.starts: list[node_manager_pb2.StartEngineRequest] = []
        self.stops: list[node_manager_pb2.StopEngineRequest] = []
        self.hang = 0.0  # seconds each call takes (a frozen node manager)

    async def StartEngine(self, request, context):
        self.starts.append(request)
        await asyncio.sleep(self.hang)
        if self.errors:
            await context.abort(self.errors.pop(0), "scripted")
        return node_manager_pb2.StartEngineResponse(
            engine=types_pb2.Engine(engine_id=f"{request.spec.instance_id}/rank0")
        )

    async def StopEngine(self, request, context):
        self.stops.append(request)
        await asyncio.sleep(self.hang)
        return node_manager_pb2.StopEngineResponse()


async def serve(scripted: ScriptedNodeManager, node_id: str) -> tuple[grpc.aio.Server, controller_pb2.NodeInfo]:
    """`scripted` served on a port of its own: (the server, the node it is)."""
    server = grpc.aio.server()
    node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server(scripted, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, controller_pb2.NodeInfo(node_id=node_id, address=f"127.0.0.1:{port}")


@pytest.fixture
async def node_manager():
    scripted = ScriptedNodeManager()
    server, node = await serve(scripted, "node-a")
    client = GrpcNodeClient(attempts=3, epoch=lambda: 7)
    yield scripted, client, node
    await client.close()
    await server.stop(None)


async def test_start_engine_retries_transport_trouble_then_gives_up_and_never_retries_a_refusal(node_manager):
    scripted, client, node = node_manager
    spec = types_pb2.EngineSpec(instance_id="prefill-0")
    scripted.errors = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    engine = await client.start_engine(node, spec)
    assert engine.engine_id == "prefill-0/rank0" and len(scripted.starts) == 3
    assert {(r.controller_epoch, r.node_id) for r in scripted.starts} == {(7, "node-a")}

    scripted.starts.clear()
    scripted.errors = [grpc.StatusCode.UNAVAILABLE] * 5
    with pytest.raises(NodeCallError) as failed:
        await client.start_engine(node, spec)
    assert failed.value.code == "UNAVAILABLE" and failed.value.unreachable and len(scripted.starts) == 3

    scripted.starts.clear()
    scripted.errors = [grpc.StatusCode.FAILED_PRECONDITION]
    with pytest.raises(NodeCallError) as refused:
        await client.start_engine(node, spec)
    assert refused.value.code == "FAILED_PRECONDITION" and len(scripted.starts) == 1


async def test_calls_that_succeed_leave_no_reference_cycles_of_the_client(node_manager):
    scripted, client, node = node_manager
    spec = types_pb2.EngineSpec(instance_id="prefill-0")
    await client.start_engine(node, spec)  # the channel made, the first call's one-time objects
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(20):
            await client.start_engine(node, spec)
        gc.collect()
        # The fake node manager is a gRPC server in this process: its own per-call objects
        # (grpc's method lookup) are not the client's.
        ours = [
            o
            for o in gc.garbage
            if not type(o).__module__.startswith(("grpc", "_cython"))
            and type(o).__name__ not in ("_Metadatum", "_HandlerCallDetails", "tuple", "cython_function_or_method")
            and "__pyx_scope" not in type(o).__name__
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(scripted.starts) == 21
    assert ours == [], sorted({type(o).__name__ for o in ours})


async def test_a_node_managers_connection_is_let_go_when_idle_and_made_again_on_the_next_call():
    """At 10,000 nodes the controller would otherwise hold 10,000 idle (TLS) connections for the
    half hour of gRPC's default idle timeout after every wave of starts."""
    server = grpc.aio.server()
    scripted = ScriptedNodeManager()
    node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server(scripted, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcNodeClient(idle_timeout=1.0)
    node = controller_pb2.NodeInfo(node_id="node-a", address=f"127.0.0.1:{port}")

    def connected() -> bool:
        return any(
            c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            for c in psutil.Process().net_connections("tcp")
        )

    try:
        await client.start_engine(node, types_pb2.EngineSpec(instance_id="prefill-0"))
        assert connected()
        await async_wait_for(lambda: not connected(), timeout=20, what="the idle connection closed")
        engine = await client.start_engine(node, types_pb2.EngineSpec(instance_id="prefill-1"))
        assert engine.engine_id == "prefill-1/rank0" and connected()
    finally:
        await client.close()
        await server.stop(None)


async def test_a_call_that_ran_out_its_deadline_is_not_tried_again_at_once(node_manager, monkeypatch):
    """A frozen node manager held each StopEngine for 4 x (deadline + 15 s), and one of the 64
    call slots with it, before the controller said anything (found by a hostile tester): the
    actuator's own retry, after a backoff and with an event, follows instead."""
    scripted, client, node = node_manager
    client.start_timeout = 0.3
    monkeypatch.setattr(node_client, "STOP_SLACK", 0.3)
    scripted.hang = 5.0
    with pytest.raises(NodeCallError) as started:
        await client.start_engine(node, types_pb2.EngineSpec(instance_id="prefill-0"))
    with pytest.raises(NodeCallError) as stopped:
        await client.stop_engine(node, "prefill-0/rank0", 1, deadline=0.0)
    assert started.value.code == stopped.value.code == "DEADLINE_EXCEEDED" and started.value.unreachable
    assert len(scripted.starts) == 1 and len(scripted.stops) == 1


async def test_a_node_manager_that_does_not_answer_holds_only_its_own_share_of_the_call_slots(monkeypatch):
    """StartEngine and StopEngine share max_in_flight slots: calls hanging on frozen node
    managers held all of them, and every other node's calls waited (found by a hostile tester)."""
    monkeypatch.setattr(node_client, "NODE_IN_FLIGHT", 2)
    frozen, answering = ScriptedNodeManager(), ScriptedNodeManager()
    frozen.hang = 30.0
    servers, nodes = zip(*[await serve(frozen, "node-f"), await serve(answering, "node-a")])
    client = GrpcNodeClient(max_in_flight=3)
    hanging = [
        asyncio.create_task(client.start_engine(nodes[0], types_pb2.EngineSpec(instance_id=f"f-{i}"))) for i in range(4)
    ]
    try:
        await async_wait_for(lambda: len(frozen.starts) == 2, timeout=5, what="two calls to the frozen node")
        engine = await asyncio.wait_for(client.start_engine(nodes[1], types_pb2.EngineSpec(instance_id="a-0")), 5)
        assert (
            engine.engine_id == "a-0/rank0" and len(frozen.starts) == 2
        )  # the others wait for the frozen node's slots
    finally:
        for task in hanging:
            task.cancel()
        await asyncio.gather(*hanging, return_exceptions=True)
        await client.close()
        for server in servers:
            await server.stop(None)


async def test_calls_to_a_node_declared_lost_end_at_once_and_later_calls_go_through(node_manager):
    """A StartEngine in flight to a frozen node manager held its rank for the call's whole timeout
    (15 s) after the node was declared LOST: abandon() ends the calls there at once, as ones to
    wait out (CANCELLED), not engine failures, and not retried."""
    scripted, client, node = node_manager
    scripted.hang = 30.0
    calls = [
        asyncio.create_task(client.start_engine(node, types_pb2.EngineSpec(instance_id="a-0"))),
        asyncio.create_task(client.stop_engine(node, "a-1/rank0", 1, 5.0)),
    ]
    await async_wait_for(
        lambda: len(scripted.starts) == 1 and len(scripted.stops) == 1, timeout=5, what="both calls in flight"
    )
    client.abandon(node.node_id, "abandoned: lost node node-a")
    for call in calls:
        with pytest.raises(NodeCallError) as cut:
            await asyncio.wait_for(call, 2)
        assert cut.value.code == "CANCELLED" and cut.value.waits and cut.value.abandoned
        assert str(cut.value) == "CANCELLED: abandoned: lost node node-a"
    assert len(scripted.starts) == 1 and len(scripted.stops) == 1 and not client._in_flight
    scripted.hang = 0.0
    engine = await asyncio.wait_for(client.start_engine(node, types_pb2.EngineSpec(instance_id="a-0")), 5)
    assert engine.engine_id == "a-0/rank0"
    client.abandon("node-x", "nothing runs there")  # no call there: nothing to do


async def test_a_call_whose_task_is_cancelled_is_cancelled_not_abandoned(node_manager):
    scripted, client, node = node_manager
    scripted.hang = 30.0
    call = asyncio.create_task(client.start_engine(node, types_pb2.EngineSpec(instance_id="a-0")))
    await async_wait_for(lambda: len(scripted.starts) == 1, timeout=5, what="the call in flight")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not client._in_flight


async def test_calls_waiting_for_a_slot_on_a_node_declared_lost_are_not_made(node_manager, monkeypatch):
    """Calls queued behind a frozen node's slots (NODE_IN_FLIGHT) got a slot as the abandoned
    ones ended, and each then hung on the lost node for its whole timeout."""
    monkeypatch.setattr(node_client, "NODE_IN_FLIGHT", 1)
    scripted, client, node = node_manager
    scripted.hang = 30.0
    calls = [
        asyncio.create_task(client.start_engine(node, types_pb2.EngineSpec(instance_id=f"a-{i}"))) for i in range(3)
    ]
    await async_wait_for(lambda: len(scripted.starts) == 1, timeout=5, what="one call in flight, two waiting")
    client.abandon(node.node_id, "abandoned: lost node node-a")
    for call in calls:
        with pytest.raises(NodeCallError, match="^CANCELLED: abandoned: lost node node-a$"):
            await asyncio.wait_for(call, 2)
    assert len(scripted.starts) == 1


async def test_abandoning_a_node_set_aside_leaves_the_node_really_at_its_address_alone(node_manager):
    """set_aside(A): A's address answers as node B. Abandoning A by its address ended B's calls."""
    scripted, client, node_b = node_manager
    node_a = controller_pb2.NodeInfo(node_id="node-x", address=node_b.address)
    scripted.hang = 30.0
    calls = {
        n.node_id: asyncio.create_task(client.start_engine(n, types_pb2.EngineSpec(instance_id=f"{n.node_id}-0")))
        for n in (node_a, node_b)
    }
    await async_wait_for(lambda: len(scripted.starts) == 2, timeout=5, what="both calls in flight")
    client.abandon("node-x", "abandoned: node node-x, whose address answers as another node")
    with pytest.raises(NodeCallError, match="^CANCELLED: abandoned: node node-x"):
        await asyncio.wait_for(calls["node-x"], 2)
    await asyncio.sleep(0.3)
    assert not calls["node-a"].done()  # node-a's own call runs on
    calls["node-a"].cancel()
    with pytest.raises(asyncio.CancelledError):
        await calls["node-a"]


async def test_a_call_cut_by_forget_is_a_node_call_error_not_a_cancelled_task(node_manager):
    """A node registering from a new address makes the controller forget the old one: closing its
    channel cancelled the StartEngine running there, and the bare CancelledError left the
    launch's rank busy for good."""
    scripted, client, node = node_manager
    scripted.hang = 30.0
    call = asyncio.create_task(client.start_engine(node, types_pb2.EngineSpec(instance_id="a-0")))
    await async_wait_for(lambda: len(scripted.starts) == 1, timeout=5, what="the call in flight")
    await client.forget(node.address)
    with pytest.raises(
        NodeCallError, match="^CANCELLED: the call was cancelled: its channel to the node was closed$"
    ) as cut:
        await asyncio.wait_for(call, 2)
    assert cut.value.waits and not cut.value.abandoned


async def test_a_task_cancelled_in_the_same_turn_as_an_abandon_stays_cancelled(node_manager):
    scripted, client, node = node_manager
    scripted.hang = 30.0
    call = asyncio.create_task(client.start_engine(node, types_pb2.EngineSpec(instance_id="a-0")))
    await async_wait_for(lambda: len(scripted.starts) == 1, timeout=5, what="the call in flight")
    client.abandon(node.node_id, "abandoned: lost node node-a")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


class _Leader:
    def is_leader(self) -> bool:
        return True


class _SlowFlush:
    def __init__(self) -> None:
        self.flushing, self.release = asyncio.Event(), asyncio.Event()

    async def flush(self) -> None:
        self.flushing.set()
        await self.release.wait()


async def test_under_ha_a_node_abandoned_while_a_call_waits_for_the_etcd_flush_is_not_called(node_manager):
    """The leader's client flushes the state to etcd before each call: a node declared lost
    meanwhile still got the call, which hung there with its rank busy."""
    from controller.ha.fenced_node_client import LeaderOnlyNodeClient

    scripted, inner, node = node_manager
    store = _SlowFlush()
    client = LeaderOnlyNodeClient(inner, _Leader(), store, flush_timeout=10)
    calls = [
        asyncio.create_task(client.start_engine(node, types_pb2.EngineSpec(instance_id="a-0"))),
        asyncio.create_task(client.stop_engine(node, "a-1/rank0", 1, 5.0)),
    ]
    await asyncio.wait_for(store.flushing.wait(), 5)
    client.abandon(node.node_id, "abandoned: lost node node-a")
    store.release.set()
    for call in calls:
        with pytest.raises(NodeCallError, match="^CANCELLED: abandoned: lost node node-a$"):
            await asyncio.wait_for(call, 2)
    assert not scripted.starts and not scripted.stops
