"""The node manager's side of the controller: RegisterNode, heartbeats, ReportEngineEvent.

Heartbeats go on one StreamHeartbeats stream with deltas (node_manager/heartbeat_sender.py), or
as unary Heartbeat calls to a controller without the stream.

Every call retries with exponential backoff and jitter (tenacity). While the controller is
unreachable nothing else changes: engines keep running and supervision goes on. A heartbeat
refused with FAILED_PRECONDITION (stale generation) or NOT_FOUND (controller forgot the node)
leads to a new registration; the registration's assignments fence engines the controller no
longer wants here. A registration refused with INVALID_ARGUMENT (e.g. a node id the controller
rejects) cannot succeed by retrying: `run` raises RegistrationRefused and the node manager stops.

A registration refused with FAILED_PRECONDITION means another node manager process holds the
node id and is alive: this one says so (one line, then every tenth refusal), stops whatever
engines it runs (it has no say over them any more), starts nothing, and asks again every
heartbeat interval: it takes the node id over once the holder is gone. A registration that took
the node id over from a process on this host kills what that process left running first.
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from motor.clock import Clock
from motor.contract import pbtime
from motor.contract.heartbeats import MAX_BACKOFF
from motor.contract.names import ID_RULE, excerpt
from motor.contract.node_process import describe
from motor.errors import ConfigError
from motor.leader import FOLLOW_RETRY_BASE, FOLLOW_RETRY_CAP, ControllerAddresses, backoff_delay, parse_addresses
from motor.security.channels import ReloadingChannel
from motor.service.grpc_server import TlsFiles
from motor.service.retry import RepeatedFailure, worth_reporting
from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from node_manager.controller_epoch import ControllerEpoch
from node_manager.heartbeat_deltas import next_on_grid
from node_manager.heartbeat_sender import HeartbeatSender
from node_manager.manager import NodeManager

logger = logging.getLogger(__name__)

# Codes after which the node must register again instead of retrying the same call.
REREGISTER = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)


class ReRegister(Exception):
    """The controller refused the node's generation: register again."""


class RegistrationRefused(ConfigError):
    """The controller refused the node's registration for good (INVALID_ARGUMENT): stop."""


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in REREGISTER


def _registration_retryable(exc: BaseException) -> bool:
    # Every other error is retried: a node manager waits for its controller, however long.
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.INVALID_ARGUMENT


class ControllerLink:
    """`clock` (default: the manager's) times heartbeats and backoffs; tests pass a fake one."""

    def __init__(
        self,
        manager: NodeManager,
        controller: str,
        node: controller_pb2.NodeInfo,
        interval: float,
        call_timeout: float = 5.0,
        max_backoff: float = MAX_BACKOFF,
        clock: Clock | None = None,
        tls: TlsFiles | None = None,
        epoch: ControllerEpoch | None = None,
        stream_heartbeats: bool = True,
        max_interval: float = 30.0,
        phase: float | None = None,
    ):
        self.manager = manager
        self.beats = HeartbeatSender(node.node_id, call_timeout, stream=stream_heartbeats)
        self.clock: Clock = clock or manager.clock
        self.node = node
        # Heartbeats follow the interval the controller announces (its rate budget: longer at a
        # large fleet), at most max_interval; the configured one paces the refused-registration asks.
        self.configured_interval, self.max_interval = interval, max(interval, max_interval)
        self.interval = interval
        # Beats fall on a grid of the interval at this node's own phase (a fraction of it), random
        # unless a test fixes it: nodes started at once beat spread over the interval, not in a burst.
        self.phase = random.random() if phase is None else phase
        self.call_timeout = call_timeout
        self.max_backoff = max_backoff
        # One address, or every HA controller's: calls follow the leader (motor/leader.py).
        self.tls = tls
        self.controllers = ControllerAddresses(parse_addresses(controller, "--controller"))
        self.channels: dict[str, ReloadingChannel] = {}
        self._use(self.controllers.current)
        self.epoch = epoch or ControllerEpoch()
        self.generation = 0
        self.registered = asyncio.Event()
        self.refusals = 0  # registrations refused in a row because another process holds the node id
        manager.reporter = self.report
        manager.claim_held = self.registered

    def _use(self, address: str) -> None:
        if address not in self.channels:
            self.channels[address] = ReloadingChannel(address, self.tls)
        self.beats.close()  # a stream is to one controller
        self.address = address

    @property
    def stub(self) -> controller_pb2_grpc.ControllerServiceStub:
        """The current controller's stub; a new one (and so a new heartbeat stream) once the TLS
        files changed (motor/security/channels.py)."""
        return self.channels[self.address].stub(controller_pb2_grpc.ControllerServiceStub)

    def _move_on(self, exc: grpc.aio.AioRpcError) -> bool:
        """After a failed call: to the leader a standby named, or the next controller; True if moved."""
        moved = self.controllers.after_failure(exc)
        if moved:
            self._use(self.controllers.current)
        return moved

    def _retrying(self, retry=retry_if_exception(_transient), **kwargs) -> AsyncRetrying:
        if self.controllers.several:  # a failover may be under way: find the new leader promptly
            backoff = wait_random_exponential(multiplier=FOLLOW_RETRY_BASE, max=min(self.interval, FOLLOW_RETRY_CAP))
        else:
            backoff = wait_random_exponential(multiplier=min(self.interval, 1.0) / 2, max=self.max_backoff)

        def wait(state) -> float:
            # Refused because another process holds the node id: ask every interval, so that this
            # one takes over within an interval of the holder being judged gone (before the node
            # is declared lost and its engines moved elsewhere). One small call per interval.
            exc = state.outcome.exception() if state.outcome is not None else None
            if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return self.configured_interval
            return backoff(state)

        return AsyncRetrying(
            wait=wait,
            retry=retry,
            reraise=True,
            sleep=self.clock.sleep,
            **kwargs,
        )

    async def run(self) -> None:
        """Register, then heartbeat every interval; register again when refused. Runs until cancelled."""
        try:
            while True:
                await self.register()
                try:
                    await self._heartbeats()
                except ReRegister as exc:
                    logger.warning("controller refused heartbeat (%s): registering again", exc)
                    self.registered.clear()
                    self.beats.close()
        finally:
            self.beats.close()
            for channel in self.channels.values():
                await channel.close()

    async def register(self) -> None:
        attempt_no = 0
        try:
            async for attempt in self._retrying(retry=retry_if_exception(_registration_retryable)):
                with attempt:
                    attempt_no += 1
                    request = controller_pb2.RegisterNodeRequest(
                        node=self.node,
                        engines=[e for e in self.manager.engines() if e.state != types_pb2.ENGINE_STATE_STOPPED],
                        # A controller on a new store (its database lost) issues generations above it.
                        highest_generation=max((r.generation for r in self.manager.records.values()), default=0),
                    )
                    # Only engines the controller was told about are judged by its answer (one
                    # started while the call was in flight is not fenced by a reply that predates it).
                    reported = {(e.engine_id, e.spec.generation) for e in request.engines}
                    try:
                        reply = await self.stub.RegisterNode(request, timeout=self.call_timeout)
                    except grpc.aio.AioRpcError as exc:
                        self._move_on(exc)
                        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                            self._refused(exc.details() or "")
                        elif worth_reporting(attempt_no):
                            logger.warning(
                                "cannot register with the controller (attempt %d): %s: %s",
                                attempt_no,
                                exc.code().name,
                                exc.details(),
                            )
                        raise
        except grpc.aio.AioRpcError as exc:  # INVALID_ARGUMENT: retrying cannot help
            details = exc.details() or ""
            rule = "" if ID_RULE in details else f" (node ids {ID_RULE})"
            raise RegistrationRefused(
                f"the controller refused to register node {excerpt(self.node.node_id)}: {details}{rule}; "
                "not retrying: fix the node's settings"
            ) from None
        if attempt_no > 1:
            logger.info("registered after %d failed attempt(s)", attempt_no - 1)
        if self.refusals:
            logger.warning("node id %s is ours now, after %d refused registration(s)", self.node.node_id, self.refusals)
        self.refusals, self.manager.claim_refused = 0, ""
        if reply.HasField("replaced") and reply.replaced.boot_id == self.node.process.boot_id:
            killed = await self.manager.stop_leftovers(reply.replaced.state_dir_id)
            logger.warning(
                "took node id %s over from %s; killed %d engine(s) it left running on this host",
                self.node.node_id,
                describe(reply.replaced),
                killed,
            )
        self.generation = reply.generation
        self.epoch.observe(reply.controller_epoch, reply.generation_limit)
        self._follow(reply)
        if reply.keep_unassigned:  # a new store: its first deployment adopts what it describes
            kept = f", keeping the {len(reported)} engine(s) it does not know until a deployment is applied"
        else:
            fenced = self.manager.reconcile(((a.engine_id, a.generation) for a in reply.assignments), reported)
            kept = f", stopping unassigned {fenced}" if fenced else ""
        logger.info(
            "registered with the controller as %s (generation %d, heartbeat every %gs); %d engine(s) assigned%s",
            self.node.node_id,
            self.generation,
            self.interval,
            len(reply.assignments),
            kept,
        )
        self.registered.set()

    def _follow(self, reply: controller_pb2.RegisterNodeResponse | controller_pb2.HeartbeatResponse) -> None:
        """Heartbeat at the interval the controller announced (capped at max_interval)."""
        if not reply.HasField("heartbeat_interval"):
            return  # an older controller announces it at registration only
        announced = pbtime.seconds(reply.heartbeat_interval)
        if announced <= 0:
            return
        interval = min(announced, self.max_interval)
        if interval != self.interval:
            # It steps with the fleet's size: a line each time only at DEBUG, but a cap is worth saying.
            capped = f" (announced {announced:g}s, capped by --max-heartbeat-interval)" if announced > interval else ""
            logger.log(
                logging.WARNING if capped else logging.DEBUG,
                "heartbeat interval %gs -> %gs as the controller announced%s",
                self.interval,
                interval,
                capped,
            )
            self.interval = interval

    def _refused(self, details: str) -> None:
        """Another node manager process holds the node id: say so, stop our engines, start nothing."""
        self.refusals += 1
        self.manager.claim_refused = details
        fenced = self.manager.fence_all(f"node id {self.node.node_id} is held by another node manager process")
        if worth_reporting(self.refusals) or fenced:
            logger.error(
                "node id %s is held by another live node manager; starting nothing%s, asking again "
                "every %gs (refusal %d, FAILED_PRECONDITION): %s",
                self.node.node_id,
                f", stopping {fenced}" if fenced else "",
                self.configured_interval,
                self.refusals,
                details,
            )

    async def _heartbeats(self) -> None:
        # Capped exponential backoff with full jitter while the controller is unreachable; one
        # line at the first failure (then the 10th, 100th...) and one when heartbeats resume.
        failures, switched = RepeatedFailure(self.interval / 2, self.max_backoff, jitter=True), False
        clock = self.clock
        wake = next_on_grid(clock.monotonic(), self.interval, self.phase)
        while True:
            await clock.sleep(max(0.0, wake - clock.monotonic()))
            began = clock.monotonic()
            try:
                reply = await self.beats.send(
                    self.stub, self.generation, self.manager.engines(), self.manager.saver.for_heartbeat()
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in REREGISTER:
                    raise ReRegister(f"{exc.code().name}: {exc.details()}") from None
                if failures.failed(exc.code().name):
                    logger.warning(
                        "heartbeat to the controller failed %d time(s): %s: %s (engines keep running)",
                        failures.count,
                        exc.code().name,
                        exc.details(),
                    )
                # Back off (with jitter) while the controller is unreachable.
                if self._move_on(exc) and not switched:
                    switched = True  # another controller: try it now, once per tick
                    wake = clock.monotonic()
                    continue
                switched = False
                if self.controllers.several:  # a failover is under way: find the new leader promptly
                    delay = backoff_delay(failures.count, FOLLOW_RETRY_BASE, min(self.interval, FOLLOW_RETRY_CAP))
                else:
                    delay = failures.delay()
                wake = clock.monotonic() + delay
                continue
            self.epoch.observe(reply.controller_epoch, reply.generation_limit)
            self._follow(reply)
            switched = False
            self.manager.metrics.heartbeat_latency.labels(self.node.node_id).observe(clock.monotonic() - began)
            wake = next_on_grid(clock.monotonic(), self.interval, self.phase)  # back on the grid after a retry too
            failed = failures.recovered()
            if failed:
                logger.info("heartbeats to the controller resumed after %d failure(s)", failed)

    async def report(self, engine: types_pb2.Engine, reason: str) -> None:
        """ReportEngineEvent at once (a few quick retries; the next heartbeat carries it anyway)."""
        if not self.registered.is_set():
            return
        request = controller_pb2.ReportEngineEventRequest(
            node_id=self.node.node_id, generation=self.generation, engine=engine, reason=reason
        )
        try:
            async for attempt in self._retrying(stop=stop_after_attempt(3)):
                with attempt:
                    try:
                        await self.stub.ReportEngineEvent(request, timeout=self.call_timeout)
                    except grpc.aio.AioRpcError as exc:
                        self._move_on(exc)
                        raise
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "could not report engine %s to the controller (%s); the next heartbeat carries it",
                engine.engine_id,
                exc.code().name,
            )
