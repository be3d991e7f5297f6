"""The actuator: what the controller asks of node managers. It builds StartEngine's spec, starts
a copy (stopping an older copy the node still runs), and stops copies, at once or in the
background, asking a node at most once per FENCE_WINDOW for the same copy.

Retries back off and are told once (motor/service/retry.py): a stop that failed is asked again after
1 s, 2 s, 4 s ... FENCE_WINDOW, and its ENGINE_FENCED event counts the tries until it succeeds;
a StartEngine on an unreachable node, or refused because what the engine needs is still held by
another engine there (an old copy draining and stopping), is retried by the reconcile loop after
1 s, 2 s ... RETRY_CAP, with one RETRYING event per engine whose count grows until a start goes
through; neither is an engine failure (the crash-loop budget is for engines that fail).
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterator

from controller.engines.node_client import NodeCallError, NodeClient
from controller.model import reported
from controller.model.events import EventBus
from controller.model.instances import InstanceRecord
from controller.model.nodes import NodeTable
from controller.model.slots import EngineSlot
from motor.clock import Clock
from motor.service.retry import RepeatedFailure
from motor.v1 import controller_pb2, types_pb2

logger = logging.getLogger(__name__)

C, T = controller_pb2, types_pb2
# A copy asked to stop is not asked again within this many seconds (the node manager is on it).
FENCE_WINDOW = 10.0
# Copies named in the one ENGINE_FENCED event of a report that fenced many.
FENCES_NAMED = 5
# The longest wait before a StartEngine that found its node unreachable is tried again (seconds).
RETRY_CAP = 10.0
# Background stops run from one queue by at most this many tasks (the node client runs 64 calls at
# a time anyway): a task per stop held 40,000 waiting tasks when a 10,000 x dp 4 deployment was
# replaced, a transient heap that set off a complete garbage walk (0.5 s).
STOP_WORKERS = 64


def engine_spec(slot: EngineSlot, inst: InstanceRecord, master_dp_ip: str, config_json: str) -> T.EngineSpec:
    ports = list(slot.requested_ports) + [0] * (4 - len(slot.requested_ports))
    return T.EngineSpec(
        instance_id=inst.instance_id,
        dp_rank=slot.dp_rank,
        role=inst.role,
        host=slot.host,
        port=ports[0],
        mgmt_port=ports[1],
        kv_port=ports[2],
        dp_rpc_port=ports[3],
        master_dp_ip=master_dp_ip,
        config_json=config_json,
        single_container=inst.single_container,
        accelerator_ids=slot.accelerator_ids,
        generation=slot.generation,
    )


class Actuator:
    def __init__(
        self,
        client: NodeClient,
        nodes: NodeTable,
        stop_deadline: float,
        spawn: Callable[[Coroutine, str], object],
        events: EventBus,
        clock: Clock,
        deployment_of: Callable[[str], str] = lambda instance_id: "",
        kv_events: bool = False,
    ):
        self.kv_events = kv_events  # every engine publishes its KV cache events (--kv-events)
        self.client, self.nodes, self.stop_deadline = client, nodes, stop_deadline
        self.spawn, self.events, self.mono = spawn, events, clock.monotonic
        self.deployment_of = deployment_of  # an instance id's deployment: its events name it
        # (node id, engine id, generation) -> when its stop was asked, oldest first. An
        # OrderedDict: a dict emptied from its front skips every deleted entry to find the first
        # one left (0.5 s of the loop to forget 40,000 stops; OrderedDict: 10 ms).
        self.fencing: collections.OrderedDict[tuple[str, str, int], float] = collections.OrderedDict()
        # Copies whose stop was announced and has not succeeded yet -> its failed tries: a stop
        # that keeps failing is one ENGINE_FENCED event whose count grows, not one per retry.
        self.unfinished: dict[tuple[str, str, int], RepeatedFailure] = {}
        # Engines whose StartEngine found the node unreachable -> (that node, the failed tries in a row).
        self.start_failures: dict[str, tuple[str, RepeatedFailure]] = {}
        # While a node's report is read (fences_of_one_report): the copies it fences, for one event.
        self._fenced_in_report: list[tuple[tuple[str, str, int], str]] | None = None
        self._stops: collections.deque[tuple[str, str, int, str]] = collections.deque()  # to run, in order
        self._stop_workers = 0

    @contextlib.contextmanager
    def fences_of_one_report(self, node_id: str) -> Iterator[None]:
        """The stale copies fenced while one report of `node_id` is read make one ENGINE_FENCED
        event with their count (a report listing thousands of unknown engines must not flush the
        event history); a single copy keeps its own event, which counts its stop's retries."""
        self._fenced_in_report = fenced = []
        try:
            yield
        finally:
            self._fenced_in_report = None
            if len(fenced) == 1:
                self._announce_fence(*fenced[0])
            elif fenced:
                shown = ", ".join(key[1] for key, _ in fenced[:FENCES_NAMED])
                more = f" and {len(fenced) - FENCES_NAMED} more" if len(fenced) > FENCES_NAMED else ""
                self.events.emit(
                    C.EVENT_TYPE_ENGINE_FENCED,
                    f"{len(fenced)} engines on {node_id} stopped: stale copies ({shown}{more}); the first: "
                    f"{fenced[0][1]}",
                    node_id=node_id,
                    count=len(fenced),
                )

    def _announce_fence(self, key: tuple[str, str, int], why: str) -> None:
        node_id, engine_id, _ = key
        self.events.repeat(
            ("fence", key),
            C.EVENT_TYPE_ENGINE_FENCED,
            f"engine {engine_id} on {node_id} stopped: {why}",
            node_id=node_id,
            engine_id=engine_id,
            instance_id=engine_id.split("/")[0],
            deployment=self.deployment_of(engine_id.split("/")[0]),
        )

    async def start(self, node: C.NodeInfo, engine_id: str, spec: T.EngineSpec) -> T.Engine:
        """StartEngine; raises NodeCallError (one to wait out, NodeCallError.waits: see retry_delay)."""
        spec.kv_events = self.kv_events
        try:
            engine = await self._start(node, engine_id, spec)
        except NodeCallError as exc:
            if exc.waits and not exc.abandoned:  # abandoned: its node is lost, the engine is placed again elsewhere
                tried, failure = self.start_failures.get(engine_id, ("", None))
                if failure is None or tried != node.node_id:  # placed elsewhere since: its own spell and event
                    self.events.settle(("start", engine_id))
                    failure = RepeatedFailure(1.0, RETRY_CAP)
                    self.start_failures[engine_id] = (node.node_id, failure)
                failure.failed(exc)
                self.events.repeat(
                    ("start", engine_id),
                    C.EVENT_TYPE_RETRYING,
                    f"StartEngine of {engine_id} on {node.node_id} failed {failure.count} time(s) in a row, "
                    f"trying again in {failure.delay():g}s: {exc}",
                    node_id=node.node_id,
                    instance_id=spec.instance_id,
                    engine_id=engine_id,
                    deployment=self.deployment_of(spec.instance_id),
                )
            raise
        tried = self.start_failures.pop(engine_id, None)
        if tried is not None:
            if tried[0] == node.node_id:
                count = self.events.settle(("start", engine_id), f"went through after {tried[1].count} failed try(ies)")
                logger.info(
                    "StartEngine of %s on %s went through after %d failed try(ies)", engine_id, node.node_id, count
                )
            else:
                self.events.settle(("start", engine_id), f"started on {node.node_id} instead")
        return engine

    def retry_delay(self, engine_id: str) -> float:
        """How long to wait before starting an engine whose last start was to be waited out (NodeCallError.waits)."""
        tried = self.start_failures.get(engine_id)
        return tried[1].delay() if tried is not None else 0.0

    async def _start(self, node: C.NodeInfo, engine_id: str, spec: T.EngineSpec) -> T.Engine:
        try:
            return await self.client.start_engine(node, spec)
        except NodeCallError as exc:
            if exc.code != "ALREADY_EXISTS":
                raise
        # An older copy still runs there: stop it (fenced by generation), then retry once.
        await self.stop(node, engine_id, spec.generation - 1)
        return await self.client.start_engine(node, spec)

    async def stop(self, node: C.NodeInfo, engine_id: str, generation: int) -> None:
        """StopEngine of copies up to `generation`; raises NodeCallError."""
        await self.client.stop_engine(node, engine_id, generation, self.deadline_for(node.node_id, engine_id))

    def deadline_for(self, node_id: str, engine_id: str) -> float:
        """--stop-deadline, or longer when the engine said its stop takes longer (its
        drain_timeout plus its shutdown: a shorter deadline would end every stop in SIGKILL)."""
        runtime = self.nodes.get(node_id)
        kept = runtime.engines.get(engine_id) if runtime is not None else None
        grace = kept[reported.STOP_GRACE] if kept is not None else None
        return max(self.stop_deadline, grace or 0.0)

    def stop_copy(self, node_id: str, engine_id: str, generation: int, why: str, fence: bool = False) -> None:
        """Stop one copy of an engine in the background (idempotent on the node side)."""
        key = (node_id, engine_id, generation)
        now = self.mono()
        self._forget_old_stops(now)
        if key in self.fencing:
            return  # asked recently; the node manager is on it
        self.fencing[key] = now
        if fence and key not in self.unfinished:
            if self._fenced_in_report is not None:
                self._fenced_in_report.append((key, why))  # announced with the report's others
            else:
                self._announce_fence(key, why)
        self.unfinished.setdefault(key, RepeatedFailure(1.0, FENCE_WINDOW))
        self._stops.append((node_id, engine_id, generation, why))
        if self._stop_workers < STOP_WORKERS:
            self._stop_workers += 1
            self.spawn(self._stop_worker(), "stops")

    async def _stop_worker(self) -> None:
        try:
            while self._stops:
                stop = self._stops.popleft()
                try:
                    await self._stop_in_background(*stop)
                except Exception:  # not one that leaves the queue behind it stalled
                    logger.exception("stopping %s on %s failed", stop[1], stop[0])
        finally:
            self._stop_workers -= 1

    def _forget_old_stops(self, now: float) -> None:
        # Insertion order is time order: the expired entries are at the front.
        while self.fencing:
            key, asked = next(iter(self.fencing.items()))
            if now - asked < FENCE_WINDOW:
                break
            self.fencing.popitem(last=False)

    async def _stop_in_background(self, node_id: str, engine_id: str, generation: int, why: str) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        try:
            await self.stop(node.info, engine_id, generation)
            failure = self.unfinished.pop((node_id, engine_id, generation), None)
            tries = f" after {failure.count} failed try(ies)" if failure is not None and failure.count else ""
            for kind in ("fence", "stop"):  # the event that counted the failed tries says it is over
                self.events.settle((kind, (node_id, engine_id, generation)), f"stopped{tries}")
            logger.info("stopped %s (generation %d) on %s%s: %s", engine_id, generation, node_id, tries, why)
        except NodeCallError as exc:
            # The next ask goes through after a backoff (1 s, 2 s, 4 s ... FENCE_WINDOW), not every heartbeat.
            key = (node_id, engine_id, generation)
            failure = self.unfinished.setdefault(key, RepeatedFailure(1.0, FENCE_WINDOW))
            failure.failed(exc)
            self.fencing.pop(key, None)
            self.fencing[key] = self.mono() - FENCE_WINDOW + failure.delay()
            message = (
                f"engine {engine_id} on {node_id}: its stop failed {failure.count} time(s) in a row, asking "
                f"again in {failure.delay():g}s: {exc} ({why})"
            )
            # A fence: its one event counts the tries. Any other stop (a deployment's engine
            # removed): one RETRYING event that counts them.
            fence = self.events.is_repeating(("fence", key))
            self.events.repeat(
                ("fence" if fence else "stop", key),
                C.EVENT_TYPE_ENGINE_FENCED if fence else C.EVENT_TYPE_RETRYING,
                message,
                node_id=node_id,
                engine_id=engine_id,
                instance_id=engine_id.split("/")[0],
                deployment=self.deployment_of(engine_id.split("/")[0]),
            )
