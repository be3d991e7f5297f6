"""The heartbeat stream closed under a beat: during a failover a failed report moves
the link to another controller, which closes the heartbeat stream while the heartbeat loop awaits
its answer. That is a failed beat to retry, never the end of the node manager."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from motor.v1 import controller_pb2, controller_pb2_grpc
from node_manager.heartbeat_sender import HeartbeatSender


class SlowController(controller_pb2_grpc.ControllerServiceServicer):
    """Answers each beat after a while (a loaded or paused controller)."""

    async def StreamHeartbeats(self, requests, context):
        async for request in requests:
            await asyncio.sleep(1.0)
            yield controller_pb2.StreamHeartbeatsResponse(
                heartbeat=controller_pb2.HeartbeatResponse(sequence=request.heartbeat.sequence)
            )


@pytest.fixture
async def slow_controller():
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(SlowController(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield controller_pb2_grpc.ControllerServiceStub(channel)
    await channel.close()
    await server.stop(0)


async def test_a_stream_closed_under_a_beat_is_a_failed_beat_and_the_next_one_is_answered(slow_controller):
    sender = HeartbeatSender("node-a", timeout=5.0, stream=True)
    beat = asyncio.create_task(sender.send(slow_controller, 1, []))
    await asyncio.sleep(0.3)  # the beat is written and waits for its answer
    sender.close()
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await beat
    assert failed.value.code() == grpc.StatusCode.CANCELLED
    assert "closed to follow another controller" in failed.value.details()
    reply = await sender.send(slow_controller, 1, [])  # a new stream
    assert reply.sequence >= 1


async def test_stopping_the_node_manager_still_cancels_a_beat(slow_controller):
    sender = HeartbeatSender("node-a", timeout=5.0, stream=True)
    beat = asyncio.create_task(sender.send(slow_controller, 1, []))
    await asyncio.sleep(0.3)
    beat.cancel()
    with pytest.raises(asyncio.CancelledError):
        await beat
    sender.close()


class AnswerInHand:
    """A stream whose answer the test releases itself, to land it in the same loop turn as a cancel."""

    def __init__(self):
        self.answer = asyncio.get_running_loop().create_future()

    def StreamHeartbeats(self):
        return self

    async def write(self, request):
        pass

    def read(self):
        return self.answer

    def cancel(self):
        self.answer.cancel()


async def test_a_stop_that_meets_the_answer_still_stops_the_beat():
    """CI hang: the node manager's stop cancelled the controller link just as a heartbeat answer
    arrived; Python 3.11's asyncio.wait_for then returned the answer and dropped the cancel, so the
    link went on beating and stop() waited for it forever (600 s, pytest-timeout)."""
    stream = AnswerInHand()
    sender = HeartbeatSender("node-a", timeout=5.0, stream=True)
    beat = asyncio.create_task(sender.send(stream, 1, []))
    for _ in range(5):
        await asyncio.sleep(0)  # the beat is written and waits on read()
    stream.answer.set_result(controller_pb2.StreamHeartbeatsResponse())
    beat.cancel()
    with pytest.raises(asyncio.CancelledError):
        await beat
