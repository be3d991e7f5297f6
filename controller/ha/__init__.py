"""Several controllers on one etcd: exactly one acts (docs/ha.md).

- `HighAvailability` runs a full `Controller` (reconcile, placement, restarts, node-manager
  calls) only while the election says this process leads; on a standby it keeps a read-only
  view built from the etcd store's followed mirror, which the read RPCs answer from. A new
  leader reads etcd again and starts as a restarted controller does: every known node gets the
  start-up grace to report, so nothing is restarted because of the hand-over.
- `LeaderOnlyNodeClient` sits in front of the node-manager client: a StartEngine/StopEngine
  goes out only while this controller leads, after the store has written everything staged
  before it (a generation is in etcd before a node runs it), and with the epoch on it.
- `LeaderGate` is the gRPC interceptor for mutating RPCs: on a standby they answer UNAVAILABLE
  naming the leader (message and trailing metadata `motor-leader`); on the leader a change is
  in etcd before the call returns.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from controller.config import ControllerConfig
from controller.core import Controller
from controller.events import EventBus
from controller.ha.election import LeaderElection, LeaderInfo, Role
from controller.ha.leader_watch import LeaderDeathWatch
from controller.node_client import Abandonments, GrpcNodeClient, NodeCallError, NodeClient
from controller.store.etcd import EtcdStore, Fenced
from controller.store.etcd_client import UNAVAILABLE_ERRORS, EtcdTarget, connect, parse_etcd_url, unreachable_hint
from motor.errors import ConfigError, Unavailable
from motor.leader import ELECTION_METADATA, LEADER_METADATA
from motor.service.grpc_server import aio_channel
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C = controller_pb2
# ControllerService methods that change state or feed the leader's liveness.
MUTATING_METHODS = frozenset(
    {
        "RegisterNode",
        "Heartbeat",
        "StreamHeartbeats",
        "ReportEngineEvent",
        "ApplyDeployment",
        "DeleteDeployment",
        "PauseRollout",
        "ResumeRollout",
        "UndoRollout",
        "ReportFrontDoor",  # the leader's rollouts and spares read it
    }
)
# Feeds only the leader serves: routers follow WatchEndpoints, and a standby's view knows no
# engine's health, so its (empty) list would take every worker out of a router.
LEADER_ONLY_FEEDS = frozenset({"WatchEndpoints"})
# A standby rebuilds its read-only view at most this often while changes stream in (s).
VIEW_REFRESH = 0.2


class LeaderOnlyNodeClient(NodeClient):
    def __init__(self, inner: NodeClient, election: LeaderElection, store: EtcdStore, flush_timeout: float):
        self.inner, self.election, self.store, self.flush_timeout = inner, election, store, flush_timeout
        self.abandonments = Abandonments()  # a node abandoned while a call waits for the flush: not sent

    async def _admit(self, what: str) -> None:
        if not self.election.is_leader():
            raise NodeCallError("FAILED_PRECONDITION", f"{what} not sent: {self.election.not_leader_message()}")
        try:
            async with asyncio.timeout(self.flush_timeout):
                await self.store.flush()
        except Fenced as exc:
            self.election.lost(f"a write was refused by etcd: {exc}")
            raise NodeCallError("FAILED_PRECONDITION", f"{what} not sent: leadership lost ({exc})") from None
        except TimeoutError:
            raise NodeCallError(
                "UNAVAILABLE", f"{what} not sent: etcd did not commit the state in {self.flush_timeout}s"
            ) from None
        if not self.election.is_leader():  # the flush may have outlasted the leadership
            raise NodeCallError("FAILED_PRECONDITION", f"{what} not sent: {self.election.not_leader_message()}")

    async def start_engine(self, node: C.NodeInfo, spec: types_pb2.EngineSpec) -> types_pb2.Engine:
        since = self.abandonments.count(node.node_id)
        await self._admit(f"StartEngine of {spec.instance_id}/rank{spec.dp_rank}")
        self.abandonments.check(node.node_id, since)
        return await self.inner.start_engine(node, spec)

    async def stop_engine(self, node: C.NodeInfo, engine_id: str, generation: int, deadline: float) -> None:
        since = self.abandonments.count(node.node_id)
        await self._admit(f"StopEngine of {engine_id}")
        self.abandonments.check(node.node_id, since)
        await self.inner.stop_engine(node, engine_id, generation, deadline)

    async def list_engines(self, node: C.NodeInfo, timeout: float) -> list[types_pb2.Engine]:
        return await self.inner.list_engines(node, timeout)

    async def forget(self, address: str) -> None:
        await self.inner.forget(address)

    def abandon(self, node_id: str, why: str) -> None:
        self.abandonments.add(node_id, why)
        self.inner.abandon(node_id, why)

    async def close(self) -> None:
        await self.inner.close()


class HighAvailability:
    """Switches this process between leading (a running Controller) and standing by (a view)."""

    def __init__(
        self,
        election: LeaderElection,
        store: EtcdStore,
        make_controller: Callable[[], Any],
        events: EventBus,
        store_url: str,
        flush_timeout: float = 5.0,
        on_lead: Callable[[Any], None] | None = None,
        death_watch: LeaderDeathWatch | None = None,
    ):
        self.election, self.store, self.events = election, store, events
        self.make_controller = make_controller  # a Controller on this store, not started
        self.store_url, self.flush_timeout = store_url, flush_timeout
        self.on_lead = on_lead  # runs with the new leader's Controller (e.g. --deployment)
        self.death_watch = death_watch  # a standby's fast path when the leader's process is gone
        self.controller: Any = None  # what the servicer reads: the leader's Controller or the view
        self._leading: Any = None
        self._follow: asyncio.Task | None = None
        self._transitions: asyncio.Queue[tuple[Role, LeaderInfo | None, str]] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._view_dirty = asyncio.Event()
        self._viewer: asyncio.Task | None = None

    async def open(self) -> None:
        """Read the shared state and serve it as a standby (before the gRPC server starts)."""
        await self.store.open()
        self._show_view()
        self._follow_changes()
        loop = asyncio.get_running_loop()
        self._viewer = loop.create_task(self._refresh_views(), name="standby-view")
        self._worker = loop.create_task(self._apply_transitions(), name="leadership-transitions")
        self.store.on_change(lambda key: self._view_dirty.set())
        self.election.on_change(lambda role, leader, reason: self._transitions.put_nowait((role, leader, reason)))

    def campaign(self, address: str) -> None:
        """Join the election as `address` (once the gRPC server listens there)."""
        self.election.address = self.election.name = address
        self.election.start()
        if self.death_watch:
            self.death_watch.start()

    def metrics_registry(self) -> Any:
        """A registry whose collection is that of the controller in use now (leader or view)."""
        ha = self

        class _Current:
            def collect(self):
                return ha.controller.metrics.registry.collect()

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Current())
        return registry

    async def resign(self) -> None:
        """Stop acting and give the leadership up (revoke the lease): a standby leads at once.
        Called before the gRPC server stops, so nothing acts while the port already refuses."""
        if self.death_watch:
            await self.death_watch.stop()
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._leading is not None:
            leading, self._leading = self._leading, None
            await leading.stop()
        await self.election.stop()

    async def stop(self) -> None:
        await self.resign()
        for task in (self._viewer, self._follow):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.store.close()

    # --- what the servicer and the gate ask ---------------------------------------------------

    def is_leader(self) -> bool:
        return self._leading is not None and self.election.is_leader()

    def not_leader(self) -> tuple[str, str]:
        """(message, leader address or "") for a refused mutating call."""
        leader = self.election.leader if self.election.role is Role.STANDBY else None
        return self.election.not_leader_message(), leader.address if leader else ""

    def standby_view(self) -> str:
        """What a standby's read answer says of itself (ListNodes, ListInstances, ListEndpoints)."""
        leader = self.election.leader if self.election.role is Role.STANDBY else None
        ask = f"ask the leader {leader.address}" if leader else "no leader is elected now: ask again shortly"
        return (
            f"answered by the standby controller {self.election.address} from the store: node liveness and the "
            f"engines' state and health are known only to the leader; {ask} for the live view"
        )

    @property
    def epoch(self) -> int:
        return self.election.epoch

    async def flush(self) -> None:
        try:
            async with asyncio.timeout(self.flush_timeout):
                await self.store.flush()
        except Fenced as exc:
            self.election.lost(f"a write was refused by etcd: {exc}")
            raise Unavailable(
                f"this controller lost the leadership before the change was stored; retry: {exc}"
            ) from None
        except TimeoutError:
            raise Unavailable(
                f"etcd did not commit the change within {self.flush_timeout}s (no quorum?); retry"
            ) from None

    async def list_controllers(self) -> C.ListControllersResponse:
        members, leader = await self.election.controllers()
        reply = C.ListControllersResponse(
            leader_address=leader.address if leader else "", epoch=leader.epoch if leader else 0, store=self.store_url
        )
        reply.lease_ttl.FromSeconds(self.election.ttl)
        listed = sorted(members, key=lambda m: (not leader or m[0] != leader.address, m[0]))
        for address, name in listed:
            reply.controllers.add(address=address, name=name, leader=bool(leader and address == leader.address))
        return reply

    # --- transitions --------------------------------------------------------------------------

    async def _apply_transitions(self) -> None:
        while True:
            role, leader, reason = await self._transitions.get()
            try:
                if role is Role.LEADER and self._leading is None:
                    await self._lead(reason)
                elif role is not Role.LEADER and self._leading is not None:
                    await self._stand_by(reason)
                if role is Role.STANDBY and leader is not None:
                    self.events.emit(
                        C.EVENT_TYPE_LEADER_CHANGED, f"{leader.address} leads (epoch {leader.epoch}): {reason}"
                    )
            except Exception:
                logger.exception("leadership transition to %s failed", role.value)

    async def _lead(self, reason: str) -> None:
        if self._follow:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
            self._follow = None
        await self.store.reload()  # everything the previous leader wrote is visible
        if not self.election.is_leader():  # lost again while reading
            self._show_view()
            self._follow_changes()
            return
        controller = self.make_controller()
        await controller.start()
        self._leading = self.controller = controller
        if self.on_lead:
            self.on_lead(controller)
        self.events.emit(
            C.EVENT_TYPE_LEADER_CHANGED, f"{self.election.address} leads (epoch {self.election.epoch}): {reason}"
        )

    async def _stand_by(self, reason: str) -> None:
        leading, self._leading = self._leading, None
        self.events.emit(C.EVENT_TYPE_LEADER_CHANGED, f"{self.election.address} stepped down: {reason}")
        await leading.stop()  # its loops end; the gate refused any node call since the deadline
        await self.store.reload()
        self._show_view()
        self._follow_changes()

    def _follow_changes(self) -> None:
        self._follow = asyncio.get_running_loop().create_task(self.store.follow(), name="follow-state")

    def _show_view(self) -> None:
        view = self.make_controller()
        view.load()
        self.controller = view

    async def _refresh_views(self) -> None:
        while True:
            await self._view_dirty.wait()
            await asyncio.sleep(VIEW_REFRESH)  # gather a burst of changes into one rebuild
            self._view_dirty.clear()
            if self._leading is None:
                self._show_view()


class LeaderGate(grpc.aio.ServerInterceptor):
    """Mutating ControllerService calls: only on the leader, and stored before they return. The
    feeds routers follow: only from the leader, ended when it stops leading."""

    def __init__(self, ha: HighAvailability, service: str = "motor.v1.ControllerService"):
        self.ha, self.service = ha, service
        # method -> (the servicer's handler, its gated one): built once, so that the server's own
        # interceptor (motor/service/server_calls.py) finds the same handler and reuses its wrapper.
        self._gated: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler is None or service != self.service or method not in MUTATING_METHODS | LEADER_ONLY_FEEDS:
            return handler
        cached = self._gated.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = self._gated[details.method] = (handler, self._gate(handler))
        return cached[1]

    def _gate(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        ha = self.ha

        async def refuse_unless_leader(context: grpc.aio.ServicerContext) -> None:
            if not ha.is_leader():
                message, leader = ha.not_leader()
                context.set_trailing_metadata(
                    ((LEADER_METADATA, leader),) if leader else ((ELECTION_METADATA, "under way"),)
                )
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        async def while_leading(
            method: Callable[..., Any], requests: Any, context: grpc.aio.ServicerContext, stamp_epoch: bool = False
        ) -> Any:
            """A streaming call's replies, each only while leading (the call is refused at once
            when this controller stops leading)."""
            await refuse_unless_leader(context)
            async for reply in method(requests, context):
                await refuse_unless_leader(context)
                if stamp_epoch:  # as Heartbeat's answer: nodes learn the epoch
                    reply.heartbeat.controller_epoch = ha.epoch
                yield reply

        if handler.unary_stream is not None:  # WatchEndpoints: every message only while leading
            feed = handler.unary_stream

            async def gated_feed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in while_leading(feed, request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(
                gated_feed,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:  # StreamHeartbeats: every beat only while leading
            stream = handler.stream_stream

            async def gated_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for reply in while_leading(stream, requests, context, stamp_epoch=True):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(
                gated_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        async def gated(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await refuse_unless_leader(context)
            staged = ha.store.staged
            reply = await behavior(request, context)
            if ha.store.staged != staged:
                await ha.flush()
            if hasattr(reply, "controller_epoch"):  # RegisterNode, Heartbeat: nodes learn the epoch
                reply.controller_epoch = ha.epoch
            return reply

        return grpc.unary_unary_rpc_method_handler(
            gated, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


def advertised_address(config: ControllerConfig, port: int) -> str:
    if config.advertise:
        return config.advertise
    host = config.listen.rsplit(":", 1)[0]
    return f"{socket.gethostname() if host in ('0.0.0.0', '::', '[::]') else host}:{port}"


async def open_high_availability(
    config: ControllerConfig, on_lead: Callable[[Any], None] | None = None
) -> HighAvailability:
    """The etcd client, election, store and switcher for `--store etcd://...`, serving as a standby."""
    assert config.store
    endpoints, prefix = parse_etcd_url(config.store)
    target = EtcdTarget(
        endpoints,
        prefix,
        config.etcd_ca,
        config.etcd_cert,
        config.etcd_key,
        config.etcd_timeout,
        config.etcd_server_name,
    )
    client = connect(target)
    election = LeaderElection(client, prefix, address="", ttl=config.lease_ttl, renew_client=lambda: connect(target))
    store = EtcdStore(client, prefix, fence=election.fence)
    events = EventBus()

    def make_controller() -> Controller:
        node_client = GrpcNodeClient(tls=config.client_tls(), epoch=lambda: election.epoch)
        return Controller(
            config,
            store,
            LeaderOnlyNodeClient(node_client, election, store, config.commit_timeout),
            events=events,
            acting=election.is_leader,
        )

    death_watch = LeaderDeathWatch(election, lambda address: aio_channel(address, config.client_tls()))
    ha = HighAvailability(
        election, store, make_controller, events, target.describe(), config.commit_timeout, on_lead, death_watch
    )
    try:

        def waiting(state) -> None:
            logger.warning(
                "etcd at %s not readable yet (%s); %s",
                target.describe(),
                state.outcome.exception(),
                unreachable_hint(target),
            )

        async for attempt in AsyncRetrying(
            stop=stop_after_delay(config.etcd_startup_wait),
            wait=wait_exponential(max=2),
            retry=retry_if_exception_type(UNAVAILABLE_ERRORS),
            reraise=True,
            before_sleep=waiting,
        ):
            with attempt:
                await ha.open()
    except UNAVAILABLE_ERRORS as exc:
        await client.close()
        raise ConfigError(
            f"--store: cannot read the state from {target.describe()} within {config.etcd_startup_wait:g}s "
            f"({exc}); {unreachable_hint(target)}"
        ) from None
    return ha
