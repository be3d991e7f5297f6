"""How a node manager sends its heartbeats: on one long-lived StreamHeartbeats stream, as deltas
(node_manager/heartbeat_deltas.py: only the engines whose report changed, a full list on every new stream and
every `full_every` beats), one answer per beat; or with unary Heartbeat calls carrying the full
list, for a controller that has no StreamHeartbeats (it answers UNIMPLEMENTED: this sender then
stays on unary calls) or when streams are turned off.

Any failure ends the stream; the next beat opens a new one, which starts with a full list, so a
beat lost with a broken stream is repaired at once. Errors come out as grpc.aio.AioRpcError, as
from a unary call (a beat unanswered within `timeout`: DEADLINE_EXCEEDED), so the caller's
backoff, re-registration and leader-following treat both transports alike.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from motor.v1 import controller_pb2, types_pb2
from node_manager.heartbeat_deltas import HeartbeatDeltas

logger = logging.getLogger(__name__)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class HeartbeatSender:
    def __init__(self, node_id: str, timeout: float, stream: bool = True, full_every: int = 30):
        self.node_id, self.timeout, self.stream = node_id, timeout, stream
        self.deltas = HeartbeatDeltas(node_id, full_every)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._stub = None

    def close(self) -> None:
        """End the stream (a new registration, another controller): the next beat opens a new one."""
        if self._call is not None:
            self._call.cancel()
        self._call = self._stub = None

    async def send(
        self, stub, generation: int, engines: list[types_pb2.Engine], store_failing: str = ""
    ) -> controller_pb2.HeartbeatResponse:
        """One beat; `store_failing`: why engine records cannot be written now (empty: they can)."""
        if not self.stream:
            request = controller_pb2.HeartbeatRequest(
                node_id=self.node_id, generation=generation, engines=engines, store_failing=store_failing
            )
            return await stub.Heartbeat(request, timeout=self.timeout)
        try:
            return await self._beat(stub, generation, engines, store_failing)
        except grpc.aio.AioRpcError as exc:
            self.close()
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        logger.warning("the controller has no StreamHeartbeats (UNIMPLEMENTED): heartbeating with unary calls")
        self.stream = False
        return await self.send(stub, generation, engines, store_failing)

    async def _beat(
        self, stub, generation: int, engines: list[types_pb2.Engine], store_failing: str
    ) -> controller_pb2.HeartbeatResponse:
        if self._call is None or self._stub is not stub:
            self.close()
            self._call, self._stub = stub.StreamHeartbeats(), stub
            self.deltas.restart()
        call = self._call
        request = self.deltas.next(generation, engines)
        request.store_failing = store_failing  # every beat, delta or not: empty says the spell ended
        try:
            async with asyncio.timeout(self.timeout):
                await call.write(controller_pb2.StreamHeartbeatsRequest(heartbeat=request))
            async with asyncio.timeout(self.timeout):
                reply = await call.read()
        except TimeoutError:
            self.close()
            raise _error(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to a heartbeat within {self.timeout:g}s"
            ) from None
        except asyncio.InvalidStateError:  # the stream had ended without an error
            reply = grpc.aio.EOF
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this node manager is stopping
            # close() cancelled the stream under this beat (a report moved to another controller,
            # a new registration): a failed beat like any other, retried on the new stream. Let
            # through, it ended the controller link and with it the node manager.
            self._call = self._stub = None
            raise _error(
                grpc.StatusCode.CANCELLED, "the heartbeat stream was closed to follow another controller"
            ) from None
        if reply is grpc.aio.EOF:  # ended by the controller: its status, with its metadata (a standby names the leader)
            self._call = self._stub = None
            code = await call.code()
            raise grpc.aio.AioRpcError(
                code if code != grpc.StatusCode.OK else grpc.StatusCode.UNAVAILABLE,
                await call.initial_metadata(),
                await call.trailing_metadata(),
                details=await call.details() or "the controller ended the heartbeat stream",
            )
        return reply.heartbeat
