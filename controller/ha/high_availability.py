"""Switching one controller process between leading and standing by (docs/ha.md).

`HighAvailability` runs a full `Controller` (reconcile, placement, restarts, node-manager calls)
only while the election says this process leads; on a standby it keeps a read-only view built
from the etcd store's followed mirror, which the read RPCs answer from. A new leader reads etcd
again and starts as a restarted controller does: every known node gets the start-up grace to
report, so nothing is restarted because of the hand-over."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from controller.core import Controller
from controller.ha.election import LeaderElection, LeaderInfo, Role
from controller.ha.fenced_node_client import flush_while_leading
from controller.ha.leader_gate import LeaderGate
from controller.ha.leader_watch import LeaderDeathWatch
from controller.model.events import EventBus
from controller.store.etcd import EtcdStore, Fenced
from motor.errors import Unavailable
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)

C = controller_pb2
# A standby rebuilds its read-only view at most this often while changes stream in (s).
VIEW_REFRESH = 0.2


class HighAvailability:
    """Switches this process between leading (a running Controller) and standing by (a view)."""

    def __init__(
        self,
        election: LeaderElection,
        store: EtcdStore,
        make_controller: Callable[[], Controller],
        events: EventBus,
        store_url: str,
        flush_timeout: float = 5.0,
        on_lead: Callable[[Controller], None] | None = None,
        death_watch: LeaderDeathWatch | None = None,
    ):
        self.election, self.store, self.events = election, store, events
        self.make_controller = make_controller  # a Controller on this store, not started
        self.store_url, self.flush_timeout = store_url, flush_timeout
        self.on_lead = on_lead  # runs with the new leader's Controller (e.g. --deployment)
        self.death_watch = death_watch  # a standby's fast path when the leader's process is gone
        self.controller: Controller | None = None  # what the servicer reads: the leader's Controller or the view
        self._leading: Controller | None = None
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

    def metrics_registry(self) -> CollectorRegistry:
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

    def gate(self) -> LeaderGate:
        return LeaderGate(self)

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
            await flush_while_leading(self.store, self.election, self.flush_timeout)
        except Fenced as exc:
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
