"""StreamHeartbeats with deltas and the paged List RPCs behave exactly like unary Heartbeat and
unpaged lists: one scenario (engines start, turn NORMAL, go ABNORMAL, fail and restart, vanish,
a node falls silent and is lost, a stale beat is refused) is played over real gRPC through each
transport against its own controller on a manual clock, and both end in the same states after
the same events."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controller.api.controllers import SingleController
from controller.api.servicer import ControllerServicer
from controller.model import reported
from controller.routing import endpoints
from motor.errors import InvalidArgument
from motor.service.grpc_server import MotorServer, aio_channel, service_name
from motor.v1 import controller_pb2 as C
from motor.v1 import controller_pb2_grpc
from motor.v1 import types_pb2 as T
from motorctl import pages
from node_manager.heartbeat_deltas import HeartbeatDeltas
from node_manager.heartbeat_sender import HeartbeatSender
from tests.support import async_wait_for
from tests.support.controller_fakes import ManualClock
from tests.support.controller_harness import Harness, example_deployment, node_info

NODES = ("node-a", "node-b", "node-c")


class Unary:
    """Full engine lists over unary Heartbeat."""

    def __init__(self, stub):
        self.stub = stub

    async def beat(self, node_id: str, generation: int, engines: list[T.Engine]) -> None:
        await self.stub.Heartbeat(
            C.HeartbeatRequest(node_id=node_id, generation=generation, engines=engines), timeout=10
        )

    async def close(self) -> None:
        pass


class Streams:
    """One StreamHeartbeats stream per node, deltas with a full list every 4 beats."""

    def __init__(self, stub):
        self.stub = stub
        self.calls: dict[str, grpc.aio.StreamStreamCall] = {}
        self.deltas = {n: HeartbeatDeltas(n, full_every=4) for n in NODES}
        self.sent: list[C.HeartbeatRequest] = []

    async def beat(self, node_id: str, generation: int, engines: list[T.Engine]) -> None:
        call = self.calls.get(node_id)
        if call is None:
            call = self.calls[node_id] = self.stub.StreamHeartbeats()
            self.deltas[node_id].restart()
        request = self.deltas[node_id].next(generation, engines)
        self.sent.append(request)
        await call.write(C.StreamHeartbeatsRequest(heartbeat=request))
        reply = await call.read()
        if reply is grpc.aio.EOF:
            del self.calls[node_id]
            await call  # raises the stream's status
        assert reply.heartbeat.sequence == request.sequence

    async def close(self) -> None:
        for call in self.calls.values():
            call.cancel()


class NodeManagerSender:
    """The node manager's own sender (node_manager/heartbeat_sender.py): one stream per node,
    deltas with a full list every 4 beats."""

    def __init__(self, stub):
        self.stub = stub
        self.senders = {n: HeartbeatSender(n, timeout=10, full_every=4) for n in NODES}
        self.sent: list[C.HeartbeatRequest] = []
        for sender in self.senders.values():
            sender.deltas.next = self._recorded(sender.deltas.next)

    def _recorded(self, make):
        def next_request(*args):
            request = make(*args)
            self.sent.append(request)
            return request

        return next_request

    async def beat(self, node_id: str, generation: int, engines: list[T.Engine]) -> None:
        reply = await self.senders[node_id].send(self.stub, generation, engines)
        assert reply.sequence == self.sent[-1].sequence

    async def close(self) -> None:
        for sender in self.senders.values():
            sender.close()


async def play(tmp_path, make_transport) -> dict:
    clock = ManualClock()
    h = Harness(tmp_path, clock=clock)  # heartbeat 0.1 s, grace 0.6 s
    ctl = await h.start()
    server = MotorServer("127.0.0.1:0")
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerServicer(SingleController(ctl)),
        service_name(C, "ControllerService"),
    )
    port = await server.start()
    channel = aio_channel(f"127.0.0.1:{port}")
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    transport = make_transport(stub)
    client = h.client

    trace = []  # what the controller holds after every round of beats

    async def beat(*nodes: str) -> None:
        clock.advance(h.config.heartbeat_interval)  # at the pace they were told (faster is refused)
        for node in nodes:
            await transport.beat(node, h.generations[node], client.report(node))
        ctl.endpoints.refresh()  # the feed re-reads only what changed: it must agree with a full pass
        assert {k: endpoints.message(v) for k, v in ctl.endpoints.current.items()} == {
            e.engine_id: e for e in endpoints.endpoints(ctl.state)
        }
        held = {
            n: sorted(
                e.SerializeToString(deterministic=True) for e in map(reported.message, ctl.nodes[n].engines.values())
            )
            for n in NODES
        }
        trace.append((held, sorted((s.engine_id, s.state, s.health) for s in ctl.slots.values())))

    try:
        for node in NODES:
            reply = await stub.RegisterNode(C.RegisterNodeRequest(node=node_info(node)), timeout=10)
            h.generations[node] = reply.generation
        ctl.apply_deployment(example_deployment())
        await async_wait_for(lambda: len(client.starts()) == 3, timeout=5, what="3 StartEngine calls")
        await beat(*NODES)  # STARTING, INIT
        await beat(*NODES)  # unchanged: empty deltas
        for node in NODES:
            client.set_health(node)
        await beat(*NODES)
        await async_wait_for(lambda: all(i.state == C.INSTANCE_STATE_READY for i in ctl.instances.values()), timeout=5)
        # One engine turns ABNORMAL, then fails and is restarted.
        victim = ctl.slots["prefill-0/rank1"]
        engine = client.engines[victim.node_id]["prefill-0/rank1"]
        engine.health, engine.health_reason = T.HEALTH_STATUS_ABNORMAL, "probe timed out"
        await beat(*NODES)
        engine.state, engine.exit_code = T.ENGINE_STATE_FAILED, 3
        await beat(*NODES)
        await async_wait_for(lambda: len(client.starts()) == 5, timeout=5, what="the restart of the group (both ranks)")
        client.set_health(victim.node_id)
        await beat(*NODES)
        # An engine the node no longer reports.
        decode_node = ctl.slots["decode-0/rank0"].node_id
        del client.engines[decode_node]["decode-0/rank0"]
        await beat(*NODES)
        # The last node falls silent and its re-check fails: lost.
        silent = NODES[-1]
        client.unreachable.add(silent)
        for _ in range(2):  # in steps under the grace: the controller's own node check may run at any moment
            clock.advance(h.config.node_grace / 2 + 0.05)
            await beat(*NODES[:-1])
        ctl.check_nodes()
        await async_wait_for(lambda: ctl.nodes[silent].recheck_failed_at is not None, timeout=5, what="re-check failed")
        clock.advance(2 * h.config.heartbeat_interval)
        await beat(*NODES[:-1])
        ctl.check_nodes()
        assert ctl.nodes[silent].state == C.NODE_STATE_LOST
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await beat(silent)
        await asyncio.sleep(0.2)  # let moves settle
        ctl.reconcile_once()
        return {
            "refused": (refused.value.code(), refused.value.details().removeprefix("heartbeat.")),  # a stream's field
            "events": sorted((e.type, e.node_id, e.instance_id, e.engine_id, e.message) for e in ctl.events.recent),
            "nodes": await all_pages(stub.ListNodes, C.ListNodesRequest, "nodes"),
            "instances": await all_pages(stub.ListInstances, C.ListInstancesRequest, "instances"),
            "endpoints": await all_pages(stub.ListEndpoints, C.ListEndpointsRequest, "endpoints"),
            "trace": trace,
            "sent": getattr(transport, "sent", []),
        }
    finally:
        await transport.close()
        await channel.close()
        await server.stop(0)
        await h.stop()


async def all_pages(method, request_type, field: str, **request) -> dict:
    """Every item read one page at a time (page_size 1) and in one answer, which must agree."""
    whole = getattr(await method(request_type(**request), timeout=10), field)
    paged, token, pages = [], "", 0
    while True:
        reply = await method(request_type(page_size=1, page_token=token, **request), timeout=10)
        paged.extend(getattr(reply, field))
        pages += 1
        token = reply.next_page_token
        if not token:
            break
    assert list(paged) == list(whole) and pages == max(1, len(whole))
    out = []
    for item in whole:
        if field == "nodes":
            item.ClearField("last_heartbeat")  # wall-clock time of arrival
        out.append(item.SerializeToString(deterministic=True))
    return {"items": out}


@pytest.mark.parametrize("streams", [Streams, NodeManagerSender])
async def test_stream_deltas_and_paging_match_unary(tmp_path, streams):
    unary = await play(tmp_path / "unary", Unary)
    streamed = await play(tmp_path / "stream", streams)
    # The stream really sent deltas: empty ones for unchanged beats, removals, full lists every 4.
    sent = streamed.pop("sent")
    unary.pop("sent")
    assert any(r.delta and not r.engines for r in sent)
    assert any(r.delta and r.removed_engine_ids == ["decode-0/rank0"] for r in sent)
    assert any(not r.delta for r in sent[len(NODES) :])
    assert unary["refused"][0] == streamed["refused"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert unary == streamed
    states = {C.Node.FromString(n).info.node_id: C.Node.FromString(n).state for n in unary["nodes"]["items"]}
    assert states == {"node-a": C.NODE_STATE_READY, "node-b": C.NODE_STATE_READY, "node-c": C.NODE_STATE_LOST}
    kinds = {e[0] for e in unary["events"]}
    assert {C.EVENT_TYPE_ENGINE_FAILED, C.EVENT_TYPE_NODE_SUSPECT, C.EVENT_TYPE_NODE_LOST} <= kinds


async def test_list_filter_and_bad_paging_arguments(tmp_path, monkeypatch):
    h = Harness(tmp_path)
    ctl = await h.start()
    try:
        for node in NODES:
            await h.register(node)
        ctl.apply_deployment(example_deployment())
        await async_wait_for(lambda: len(h.client.starts()) == 3, timeout=5)
        for node in NODES:
            h.client.set_health(node)
        h.beat(*NODES)
        first = ctl.page_nodes(C.ListNodesRequest(page_size=2, filter="state=ready node_id=node-*"))
        assert [n.info.node_id for n in first.nodes] == ["node-a", "node-b"] and first.next_page_token
        rest = ctl.page_nodes(
            C.ListNodesRequest(page_size=2, filter="state=ready node_id=node-*", page_token=first.next_page_token)
        )
        assert [n.info.node_id for n in rest.nodes] == ["node-c"] and not rest.next_page_token
        assert [i.instance_id for i in ctl.page_instances(C.ListInstancesRequest(filter="group=decode")).instances] == [
            "decode-0"
        ]
        # motorctl reads page after page: the same as one unpaged answer.
        monkeypatch.setattr(pages, "PAGE_SIZE", 1)
        merged = pages.all_pages(lambda request, timeout: ctl.page_nodes(request), C.ListNodesRequest(), "nodes", 10)
        assert merged == ctl.page_nodes(C.ListNodesRequest()) and len(merged.nodes) == 3
        prefill = ctl.page_endpoints(C.ListEndpointsRequest(filter="role=PREFILL"))
        assert [e.engine_id for e in prefill.endpoints] == ["prefill-0/rank0", "prefill-0/rank1"]
        for bad, words in [
            (C.ListNodesRequest(filter="colour=red"), "filter: unknown field 'colour'"),
            (C.ListNodesRequest(filter="state"), "filter: 'state' is not a field=value term"),
            (C.ListNodesRequest(page_size=-1), "page_size: -1 is negative"),
            (C.ListNodesRequest(page_token="garbage!"), "page_token: not a token this controller issued"),
            (C.ListNodesRequest(page_size=2, page_token=first.next_page_token), "page_token: issued for filter"),
        ]:
            with pytest.raises(InvalidArgument, match=words):
                ctl.page_nodes(bad)
    finally:
        await h.stop()


async def test_the_node_managers_sender_falls_back_to_unary_for_a_controller_without_the_stream():
    beats: list[C.HeartbeatRequest] = []

    async def heartbeat(request, context):
        beats.append(request)
        return C.HeartbeatResponse()

    only_unary = grpc.method_handlers_generic_handler(
        "motor.v1.ControllerService",
        {
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                heartbeat,
                request_deserializer=C.HeartbeatRequest.FromString,
                response_serializer=C.HeartbeatResponse.SerializeToString,
            )
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((only_unary,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio_channel(f"127.0.0.1:{port}")
    try:
        sender = HeartbeatSender("node-a", timeout=10)
        engines = [T.Engine(engine_id="u-0/rank0", state=T.ENGINE_STATE_RUNNING)]
        for _ in range(2):
            await sender.send(controller_pb2_grpc.ControllerServiceStub(channel), 3, engines)
        assert not sender.stream  # UNIMPLEMENTED once, then unary calls for good
        assert [(b.node_id, b.generation, b.delta, list(b.engines)) for b in beats] == [
            ("node-a", 3, False, engines)
        ] * 2
    finally:
        await channel.close()
        await server.stop(0)
