"""The node manager's behaviour: launching, supervising and stopping engine servers.

No gRPC server code here (the servicer in service.py is a thin translation layer). The parts:
- specs.py checks a StartEngine request and builds the engine's command line; launch.py starts it;
- monitor.py watches each engine's health and reports verdicts here: this class alone decides
  to kill an engine (and handles exits, stops and re-adoption after a restart);
- every process operation and reading of time goes through `ProcessOps` and `Clock`
  (process_ops.py), so that tests can drive the decisions on fakes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any

from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.names import engine_id as make_engine_id
from motor.contract.names import excerpt, parse_engine_id
from motor.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from motor.ports import PortAllocator
from motor.processes import ExitStatus, TreeId
from motor.service.fanout import FanOut
from motor.service.tasks import TaskSet, set_within
from motor.v1 import engine_pb2, types_pb2
from node_manager import specs
from node_manager.config import NodeManagerConfig
from node_manager.engine import (
    FAILED,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    Ending,
    EngineRecord,
    RecordStore,
    state_name,
)
from node_manager.engine_client import EngineClient, EngineClientFactory, GrpcEngineClient
from node_manager.engine_exits import EngineExits
from node_manager.health import Verdict
from node_manager.launch import launch_engine
from node_manager.metrics import Metrics
from node_manager.monitor import EngineMonitor
from node_manager.port_locks import PortLocks
from node_manager.process_ops import Launched, ProcessOps, RealProcessOps
from node_manager.record_saver import RecordSaver
from node_manager.spec_refusals import SpecRefusals

logger = logging.getLogger(__name__)

# WatchEngines changes queued for one client before its stream is cut (RESOURCE_EXHAUSTED).
WATCH_QUEUE_LIMIT = 10000
# How long a StartEngine waits for a registration under way to be answered.
CLAIM_WAIT_S = 5.0

Reporter = Callable[[types_pb2.Engine, str], Awaitable[None]]


class NodeManager(EngineExits):
    """Engines of one host. Call `await start()` once (re-adopts engines from the state dir).

    `ops`, `clock` and `engine_clients` default to the real ones; tests pass fakes."""

    def __init__(
        self,
        config: NodeManagerConfig,
        ops: ProcessOps | None = None,
        clock: Clock | None = None,
        engine_clients: EngineClientFactory | None = None,
    ):
        self.config = config
        self.node_id = config.node_id
        self.ops: ProcessOps = ops or RealProcessOps()
        self.clock: Clock = clock or SYSTEM_CLOCK
        self.engine_clients: EngineClientFactory = engine_clients or self._grpc_client
        self.records: dict[str, EngineRecord] = {}
        # Specs an engine server refused as such (exit 2, config_error): not launched again at once.
        self.refusals = SpecRefusals(self.clock)
        self.store = RecordStore(config.engines_dir)
        self.metrics = Metrics(config.node_id)
        self.metrics.watch_engines(lambda: list(self.records.values()))
        self.saver = RecordSaver(self.store, self._spawn, self.metrics.store_write_failures.labels(self.node_id).inc)
        start, end = config.port_range_bounds
        # Held host-wide: node managers sharing a host never hand out the same port (issue 61 #2).
        self.host_ports = PortLocks(config.port_lock_dir)
        self.ports = PortAllocator(start, end, host=config.host, host_ports=self.host_ports)
        self.argv = config.engine_argv()
        # Called with (engine, reason) whenever an engine fails: the controller link reports it.
        self.reporter: Reporter | None = None
        # Under a controller (set by the link): engines start only while this process holds the
        # node id; `claim_refused` says why not when another node manager process holds it.
        self.claim_held: asyncio.Event | None = None
        self.claim_refused = ""
        self._monitors: dict[str, EngineMonitor] = {}
        # The health last reported at once of each running engine (see on_verdict).
        self._health_told: dict[str, int] = {}
        self._watchers: FanOut[types_pb2.Engine] = FanOut("WatchEngines", WATCH_QUEUE_LIMIT)
        self._locks: dict[str, asyncio.Lock] = {}
        self._background = TaskSet("node manager")
        self._closed = False

    def _grpc_client(self, spec: types_pb2.EngineSpec) -> EngineClient:
        return GrpcEngineClient(spec, self.config)

    # Life of the node manager ---------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine records and re-adopt engines still alive (after a restart)."""
        for record in self.store.load_all():
            self.records[record.engine_id] = record
            self.metrics.launched(record.spec.instance_id, record.engine_id, again=False)
            if not record.active:
                record.settled.set()
                continue
            for port in record.allocated_ports:
                if not self.ports.reserve(port):  # taken by another node manager while none held it
                    logger.warning("engine %s: port %d is held by another process of this host", record.engine_id, port)
                    self.ports.reserved.add(port)
            if record.pid and self.ops.same_process(record.pid, record.process_started):
                logger.info(
                    "engine %s: re-adopting pid %d (%s)", record.engine_id, record.pid, state_name(record.state)
                )
                self._watch(record, child=None)
                if record.state == STOPPING:
                    self._begin_stop(record, self.config.stop_deadline, "stop requested before a node-manager restart")
                else:
                    self._monitor(record)
            else:
                record.claim_ending(Ending.EXIT)
                self._spawn(self._handle_exit(record, ExitStatus(), while_away=True))
        self._publish_counts()

    async def close(self) -> None:
        """Stop supervising (engines keep running: a restarted node manager re-adopts them)."""
        self._closed = True
        self.host_ports.close()  # as the process's exit would: a node manager restarted takes them again
        for record in self.records.values():
            self._stop_monitor(record)
            if record.watch is not None:
                record.watch.close()
        await self._background.cancel_all()

    # Queries ----------------------------------------------------------------------------------

    def get(self, engine_id: str) -> EngineRecord:
        parse_engine_id(engine_id)
        record = self.records.get(engine_id)
        if record is None:
            raise NotFound(f"engine_id {excerpt(engine_id)} is not known on node {self.node_id}")
        return record

    def engines(self) -> list[types_pb2.Engine]:
        return [self.records[key].to_proto(self.node_id) for key in sorted(self.records)]

    def active_engines(self) -> list[EngineRecord]:
        return [r for r in self.records.values() if r.active]

    async def watch(self) -> AsyncIterator[tuple[types_pb2.Engine, bool]]:
        """Every engine at once (snapshot=True), then each change, until the caller stops."""
        changes = self._watchers.subscribe()
        try:
            for engine in self.engines():
                yield engine, True
            async for engine in changes:
                yield engine, False
        finally:
            changes.close()

    # StartEngine ------------------------------------------------------------------------------

    async def start_engine(self, spec: types_pb2.EngineSpec) -> EngineRecord:
        requested = types_pb2.EngineSpec()
        requested.CopyFrom(spec)
        specs.check_spec(spec, self.config)
        await self.wait_for_claim()
        engine_id = make_engine_id(spec.instance_id, spec.dp_rank)
        async with self._lock(engine_id):
            existing = self.records.get(engine_id)
            if existing is not None and existing.active:
                if specs.same_request(existing.spec, requested):
                    return existing
                raise AlreadyExists(
                    f"engine {engine_id} already runs on node {self.node_id} with another spec "
                    f"(generation {existing.generation}, state {state_name(existing.state)}); stop it first"
                )
            if existing is not None and spec.generation < existing.generation:
                raise FailedPrecondition(
                    f"engine {engine_id}: generation {spec.generation} is older than generation "
                    f"{existing.generation} that already ran here (stale request)"
                )
            self.refusals.check(requested)  # INVALID_ARGUMENT: the controller marks it FAILED at once
            self.saver.require_writable(requested)  # on a full disk: UNAVAILABLE, nothing started
            record, child = self._launch(requested)
            self.metrics.launched(spec.instance_id, engine_id, again=existing is not None)
            self.records[engine_id] = record
            self._changed(record, None)
            self._watch(record, child=child)
            self._monitor(record)
            return record

    async def wait_for_claim(self) -> None:
        held = self.claim_held
        if held is None or held.is_set():
            return
        if self.claim_refused:
            raise FailedPrecondition(f"node {self.node_id}: not starting anything: {self.claim_refused}")
        # Registering (again): a StartEngine may arrive before the registration's answer.
        if not await set_within(held, CLAIM_WAIT_S):
            raise Unavailable(f"node {self.node_id} is not registered with the controller yet; retry") from None

    def _launch(self, requested: types_pb2.EngineSpec) -> tuple[EngineRecord, Launched]:
        return launch_engine(
            requested, self.active_engines(), self.config, self.argv, self.ports, self.store, self.ops, self.clock
        )

    # StopEngine -------------------------------------------------------------------------------

    async def stop_engine(
        self, engine_id: str, deadline: float | None = None, generation: int = 0, why: str = "stop requested"
    ) -> EngineRecord:
        record = self.get(engine_id)
        if generation and record.generation > generation:
            logger.info(
                "engine %s: not stopping generation %d for a request about generation %d",
                engine_id,
                record.generation,
                generation,
            )
            return record
        deadline = self.config.stop_deadline if deadline is None else deadline
        if record.stop_grace > deadline:
            # The engine said how long its stop takes (drain_timeout + shutdown): a shorter
            # deadline would cut its drain short and end every stop in SIGKILL.
            logger.info(
                "engine %s: stop deadline %gs raised to the engine's stop grace %gs",
                engine_id,
                deadline,
                record.stop_grace,
            )
            deadline = record.stop_grace
        self._begin_stop(record, deadline, why)
        await record.settled.wait()
        # Idempotent clean-up: nothing of an ended engine may be left running (found by its token:
        # its pid and process group may belong to someone else by now).
        await self._end_leftovers(record, record.token_tree, remembered=())
        return record

    def _begin_stop(self, record: EngineRecord, deadline: float, why: str) -> None:
        if record.claim_ending(Ending.STOP):
            self._spawn(self._stop(record, deadline, why))

    async def _stop(self, record: EngineRecord, deadline: float, why: str) -> None:
        self._stop_monitor(record)
        if record.state != STOPPING:
            record.transition(STOPPING, f"{why}: SIGTERM, {deadline:g}s deadline", self._changed)
        watch = self._watcher(record)
        began = self.clock.monotonic()
        graceful, left = await self.ops.terminate_tree(record.tree, watch.exited, deadline, record.remembered)
        if not graceful:
            self.metrics.kill("stop_deadline")
        await self._wait_exit(record)
        status = watch.status or ExitStatus()
        record.record_exit(status)
        if left:
            self._end(record, FAILED, f"{why}: processes {left} survived SIGKILL")
            return
        how = (
            f"{status.describe()} {self.clock.monotonic() - began:.2f}s after SIGTERM"
            if graceful
            else f"SIGKILL after the {deadline:g}s deadline"
        )
        self._end(record, STOPPED, f"{why}: {how}")

    async def _wait_exit(self, record: EngineRecord, timeout: float = 10.0) -> None:
        if not await set_within(self._watcher(record).exited, timeout):
            logger.error(
                "engine %s: pid %d exit not confirmed %gs after its tree was killed",
                record.engine_id,
                record.pid,
                timeout,
            )

    # Health: the monitor reports, the manager decides ----------------------------------------

    def _monitor(self, record: EngineRecord) -> None:
        monitor = EngineMonitor(
            record,
            self.config,
            self.engine_clients,
            self.clock,
            self,
            self.metrics.status_latency.labels(self.node_id).observe,
        )
        self._monitors[record.engine_id] = monitor
        monitor.start(self._spawn)

    def _stop_monitor(self, record: EngineRecord) -> None:
        monitor = self._monitors.pop(record.engine_id, None)
        self._health_told.pop(record.engine_id, None)
        if monitor is not None:
            monitor.stop()

    def on_verdict(self, record: EngineRecord, verdict: Verdict, changed: bool) -> None:
        """The kill decision: an engine whose verdict says the threshold was reached is killed
        (unless it is already being stopped, or its exit is already known)."""
        record.remember(self.ops.descendants(record.pid), self.ops.same_process)
        if verdict.kill:
            self._publish(record)
            self._begin_kill(record, verdict.kill_reason)
        elif record.state == STARTING and verdict.health == types_pb2.HEALTH_STATUS_NORMAL:
            record.transition(RUNNING, "engine server reported NORMAL", self._changed)
        elif changed:
            self._publish(record)
            self._tell_health(record, verdict)

    def _tell_health(self, record: EngineRecord, verdict: Verdict) -> None:
        """A running engine whose health changed (a GetStatus missed or ABNORMAL, or NORMAL again)
        is reported to the controller now, not at the next heartbeat: routers follow the
        controller's endpoints, and a hung engine must leave them long before the kill."""
        told = self._health_told.get(record.engine_id, types_pb2.HEALTH_STATUS_NORMAL)
        if record.state != RUNNING or verdict.health == told:
            return
        self._health_told[record.engine_id] = verdict.health
        serving = verdict.health == types_pb2.HEALTH_STATUS_NORMAL
        self._spawn(self._report(record, "serving again" if serving else f"not serving: {verdict.reason}"))

    def on_stream_message(self, record: EngineRecord, message: engine_pb2.WatchProbesResponse) -> None:
        if record.observe_status(message.status) and record.state == RUNNING:
            # Draining, sleeping or not serving (stalled): tell the controller now, not at the
            # next heartbeat, so that routers stop sending to the engine at once.
            self._publish(record)
            self._spawn(self._report(record, record.serving_words))
        if record.state == STARTING and message.status.status == types_pb2.HEALTH_STATUS_NORMAL:
            record.health, record.health_reason = message.status.status, message.status.reason
            record.transition(RUNNING, "engine server reported NORMAL", self._changed)
        elif message.HasField("probe"):
            self._publish(record)

    def _begin_kill(self, record: EngineRecord, reason: str) -> None:
        if self._watcher(record).status is not None or not record.claim_ending(Ending.KILL):
            return
        self._stop_monitor(record)
        self._spawn(self._kill_abnormal(record, reason))

    async def _kill_abnormal(self, record: EngineRecord, reason: str) -> None:
        logger.warning("engine %s: %s", record.engine_id, reason)
        notice = self._not_serving(record, reason)
        self.metrics.kill("abnormal")
        await self.ops.kill_tree_confirmed(record.tree, record.remembered)
        await self._wait_exit(record)
        record.record_exit(self._watcher(record).status or ExitStatus(signal=9))
        self._end(record, FAILED, reason)
        await self._report(record, reason, after=notice)

    # Fencing by the controller ----------------------------------------------------------------

    def reconcile(
        self, assignments: Iterable[tuple[str, int]], reported: set[tuple[str, int]] | None = None
    ) -> list[str]:
        """Stop every active engine the controller does not assign (or assigns another generation).

        `reported`: the (engine id, generation) pairs the controller was shown; others are left alone."""
        wanted = dict(assignments)
        stopped = []
        for record in self.active_engines():
            if reported is not None and (record.engine_id, record.generation) not in reported:
                continue
            generation = wanted.get(record.engine_id)
            if generation is None or (generation and generation != record.generation):
                why = (
                    "not assigned to this node by the controller"
                    if generation is None
                    else f"the controller assigns generation {generation}, this copy is generation {record.generation}"
                )
                stopped.append(self._fence(record, why))
        return stopped

    def fence_all(self, why: str) -> list[str]:
        """Stop every engine: this process no longer holds the node id (another one does)."""
        return [self._fence(record, why) for record in self.active_engines()]

    def _fence(self, record: EngineRecord, why: str) -> str:
        self.metrics.kill("unassigned")
        self._spawn(self.stop_engine(record.engine_id, why=f"fenced: {why}"))
        return record.engine_id

    async def stop_leftovers(self, holder: str) -> int:
        """Kill every engine on this host launched for this node id by another node manager process
        (the holder this one took over from): none of them is supervised any more. Returns how many."""
        ours = {record.token for record in self.records.values()}
        tokens = await self.ops.node_tokens(self.node_id, holder) - ours
        for token in sorted(tokens):
            self.metrics.kill("leftover")
            await self.ops.kill_tree_confirmed(TreeId(pid=0, pgid=0, token=token))
        return len(tokens)

    # Plumbing ---------------------------------------------------------------------------------

    def _changed(self, record: EngineRecord, old_state: int | None) -> None:
        self.saver.save(record)
        self._publish(record)
        self._publish_counts()

    def _publish(self, record: EngineRecord) -> None:
        self._watchers.publish(record.to_proto(self.node_id))

    def _publish_counts(self) -> None:
        self.metrics.set_states(collections.Counter(state_name(r.state).lower() for r in self.records.values()))

    def _lock(self, engine_id: str) -> asyncio.Lock:
        return self._locks.setdefault(engine_id, asyncio.Lock())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        return self._background.spawn(coro)
