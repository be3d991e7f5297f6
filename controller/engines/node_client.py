"""How the controller talks to node managers: an interface (faked in unit tests) and the gRPC
implementation with retries for StartEngine and StopEngine (motor/retry.with_retries: no reference
cycles left behind by the tens of thousands of calls a big fleet makes)."""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable

import grpc

from motor.contract import pbtime, start_refusals
from motor.security.channels import ReloadingChannel
from motor.service.grpc_server import TlsFiles
from motor.service.retry import with_retries
from motor.v1 import controller_pb2, node_manager_pb2, node_manager_pb2_grpc, types_pb2

logger = logging.getLogger(__name__)

# Transport trouble, not an answer about the engine: retried, then left to the node monitor.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
# A node manager's connection is closed after this long without a call (gRPC's default: 30 min),
# and made again by the next call: 10,000 nodes would otherwise keep 10,000 (TLS) connections
# open in the controller (~50 KiB each) long after a wave of starts.
IDLE_TIMEOUT = 60.0


class NodeCallError(Exception):
    """A node-manager call failed; `code` is the gRPC status code name (e.g. 'UNAVAILABLE')."""

    def __init__(self, code: str, message: str, abandoned: bool = False):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.abandoned = abandoned  # ended by NodeClient.abandon(): its node was declared lost or set aside

    @property
    def unreachable(self) -> bool:
        return self.code in {code.name for code in RETRYABLE}

    @property
    def refusal(self) -> start_refusals.Refusal | None:
        """A StartEngine refusal the controller waits out or works around (motor/contract/start_refusals.py)."""
        return start_refusals.kind(self.code, self.message)

    @property
    def waits(self) -> bool:
        """Worth trying again after a backoff, not an engine failure: the node is unreachable, or
        what the engine needs is still held by another engine there (an old copy stopping)."""
        return self.unreachable or self.refusal is start_refusals.Refusal.HELD


class Abandonments:
    """Per node id: how many times its calls were abandoned, and the last reason. A call notes the
    count when it is asked for and is not made if the count changed meanwhile (it waited for a
    slot, a retry, or an etcd flush). Kept per node id, not address: a node set aside because its
    address answers as another node must not cut that other node's calls."""

    def __init__(self) -> None:
        self._by_node: dict[str, tuple[int, str]] = {}  # one entry per node id ever abandoned

    def count(self, node_id: str) -> int:
        return self._by_node.get(node_id, (0, ""))[0]

    def add(self, node_id: str, why: str) -> None:
        self._by_node[node_id] = (self.count(node_id) + 1, why)

    def check(self, node_id: str, since: int) -> None:
        """NodeCallError CANCELLED when the node was abandoned after `since` (count() then)."""
        count, why = self._by_node.get(node_id, (0, ""))
        if count != since:
            raise NodeCallError(grpc.StatusCode.CANCELLED.name, why, abandoned=True)


class NodeClient(abc.ABC):
    """The node-manager calls the controller makes."""

    @abc.abstractmethod
    async def start_engine(self, node: controller_pb2.NodeInfo, spec: types_pb2.EngineSpec) -> types_pb2.Engine: ...

    @abc.abstractmethod
    async def stop_engine(
        self, node: controller_pb2.NodeInfo, engine_id: str, generation: int, deadline: float
    ) -> None: ...

    @abc.abstractmethod
    async def list_engines(self, node: controller_pb2.NodeInfo, timeout: float) -> node_manager_pb2.ListEnginesResponse:
        """The node's engines and the node manager process that answered."""

    async def forget(self, address: str) -> None:
        """No node is reached at `address` any more (its node registered from another one): let go
        of what is kept for it."""

    def abandon(self, node_id: str, why: str) -> None:
        """The node was declared lost or set aside: the calls to it running now, or asked for and
        not made yet, end at once with NodeCallError CANCELLED (`why`, abandoned), instead of
        running out their timeouts on a frozen node manager."""

    async def close(self) -> None:
        pass


# Tried again at once (0.1 s, 0.2 s ...): a refused connection or a busy node answers quickly. A
# call that ran out its whole deadline is not: a frozen node manager (SIGSTOP) held a StopEngine
# for 4 x (deadline + 15 s), one of the 64 call slots with it, before anything was told; the
# actuator's own retry (after a backoff, with one RETRYING event) follows at once instead.
RETRIED_AT_ONCE = RETRYABLE - {grpc.StatusCode.DEADLINE_EXCEEDED}
# A StopEngine call may take the stop's deadline (SIGTERM to SIGKILL) and this much more.
STOP_SLACK = 15.0
# Calls to one node manager at once, at most: a call takes this slot before one of the
# max_in_flight (64) shared by every node, so node managers that do not answer (SIGSTOP) hold
# at most this many of those each while their calls run out, not all of them.
NODE_IN_FLIGHT = 16


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRIED_AT_ONCE


class GrpcNodeClient(NodeClient):
    def __init__(
        self,
        attempts: int = 4,
        start_timeout: float = 15.0,
        max_in_flight: int = 64,
        tls: TlsFiles | None = None,
        epoch: Callable[[], int] = lambda: 0,
        idle_timeout: float = IDLE_TIMEOUT,
    ):
        self.channels: dict[str, ReloadingChannel] = {}
        self.options = {"grpc.client_idle_timeout_ms": int(idle_timeout * 1000)}
        self.tls = tls  # the controller's certificate and trust bundle under mutual TLS
        self.epoch = epoch  # the leader's controller epoch, sent on StartEngine/StopEngine (0: no HA)
        self.attempts = attempts
        self.start_timeout = start_timeout
        # Starting thousands of engines at once must not open thousands of calls at once.
        self.max_in_flight = max_in_flight
        self._limit: asyncio.Semaphore | None = None
        self._node_limits: dict[str, asyncio.Semaphore] = {}  # node manager address -> its NODE_IN_FLIGHT slots
        # Node id -> its calls running now -> why abandon() ended it ("": it did not).
        self._in_flight: dict[str, dict[grpc.aio.Call, str]] = {}
        self.abandonments = Abandonments()

    @property
    def limit(self) -> asyncio.Semaphore:
        if self._limit is None:
            self._limit = asyncio.Semaphore(self.max_in_flight)
        return self._limit

    def node_limit(self, node: controller_pb2.NodeInfo) -> asyncio.Semaphore:
        limit = self._node_limits.get(node.address)
        if limit is None:
            limit = self._node_limits[node.address] = asyncio.Semaphore(NODE_IN_FLIGHT)
        return limit

    def _stub(self, node: controller_pb2.NodeInfo) -> node_manager_pb2_grpc.NodeManagerServiceStub:
        channel = self.channels.get(node.address)
        if channel is None:  # made again when the TLS files change (motor/security/channels.py)
            channel = self.channels[node.address] = ReloadingChannel(node.address, self.tls, options=self.options)
        return channel.stub(node_manager_pb2_grpc.NodeManagerServiceStub)

    async def forget(self, address: str) -> None:
        # A node manager that comes back on a new address (a rescheduled pod) would otherwise
        # leave its old channel behind at every move.
        self._node_limits.pop(address, None)
        channel = self.channels.pop(address, None)
        if channel is not None:
            await channel.close()

    def abandon(self, node_id: str, why: str) -> None:
        self.abandonments.add(node_id, why)
        calls = self._in_flight.get(node_id, {})
        for call in list(calls):
            calls[call] = why
            call.cancel()

    async def _run(self, node: controller_pb2.NodeInfo, since: int, make_call: Callable[[], grpc.aio.Call]):
        """`await make_call()`, kept among the node's calls in flight for abandon(); not made when
        the node was abandoned after the caller asked (`since`). A call cancelled under a task
        that is not itself being cancelled (abandon(), or its channel closed by forget()) is a
        NodeCallError: the launch awaiting it must not end as if its task were cancelled."""
        self.abandonments.check(node.node_id, since)
        call = make_call()
        calls = self._in_flight.setdefault(node.node_id, {})
        calls[call] = ""
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the caller's task is being cancelled (shutdown): so be it
            why = calls.get(call)
            if why:
                raise NodeCallError(grpc.StatusCode.CANCELLED.name, why, abandoned=True) from None
            # Its channel was closed: the node registered from another address, or the client closes.
            raise NodeCallError(
                grpc.StatusCode.CANCELLED.name, "the call was cancelled: its channel to the node was closed"
            ) from None
        finally:
            calls.pop(call, None)
            if not calls:
                self._in_flight.pop(node.node_id, None)

    def _retried(self, call):
        """`call()` with up to `attempts` tries, 0.1 s, 0.2 s, ... (at most 2 s) apart, for transport trouble only."""
        return with_retries(call, self.attempts, _is_retryable, base=0.1, cap=2.0)

    async def start_engine(self, node, spec):
        since = self.abandonments.count(node.node_id)

        def call():  # each try carries the epoch of its moment
            request = node_manager_pb2.StartEngineRequest(
                spec=spec, controller_epoch=self.epoch(), node_id=node.node_id
            )
            return self._run(node, since, lambda: self._stub(node).StartEngine(request, timeout=self.start_timeout))

        try:
            async with self.node_limit(node), self.limit:  # around the retries: see stop_engine
                reply = await self._retried(call)
        except grpc.aio.AioRpcError as exc:
            raise NodeCallError(exc.code().name, exc.details() or "") from None
        return reply.engine

    async def stop_engine(self, node, engine_id, generation, deadline):
        request = node_manager_pb2.StopEngineRequest(
            engine_id=engine_id, generation=generation, controller_epoch=self.epoch(), node_id=node.node_id
        )
        request.deadline.CopyFrom(pbtime.duration(deadline))
        since = self.abandonments.count(node.node_id)
        try:
            # The slot is taken before the retries begin: 40,000 calls queued here (a deployment
            # deleted) would otherwise each hold their state for seconds. A backoff between
            # tries keeps the slot.
            async with self.node_limit(node), self.limit:
                await self._retried(
                    lambda: self._run(
                        node, since, lambda: self._stub(node).StopEngine(request, timeout=deadline + STOP_SLACK)
                    )
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return  # never known there: nothing to stop
            raise NodeCallError(exc.code().name, exc.details() or "") from None

    async def list_engines(self, node, timeout):
        try:
            reply = await self._run(
                node,
                self.abandonments.count(node.node_id),
                lambda: self._stub(node).ListEngines(
                    node_manager_pb2.ListEnginesRequest(node_id=node.node_id), timeout=timeout
                ),
            )
        except grpc.aio.AioRpcError as exc:
            raise NodeCallError(exc.code().name, exc.details() or "") from None
        return reply

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()
        self.channels.clear()
