"""The node manager's behaviour: launching, supervising and stopping engine servers.

No gRPC server code here (the servicer in service.py is a thin translation layer); the only
gRPC used is the client side towards the engines' management planes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Iterable

import grpc

from motor import processes
from motor.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from motor.grpc_server import TlsFiles, aio_channel
from motor.names import ROLE_NAMES, check_instance_id, parse_engine_id, role_name
from motor.names import engine_id as make_engine_id
from motor.ports import PortAllocator, port_is_free
from motor.v1 import engine_pb2, engine_pb2_grpc, types_pb2
from node_manager.config import NodeManagerConfig
from node_manager.engine import (
    FAILED,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPING,
    EngineRecord,
    RecordStore,
    state_name,
)
from node_manager.health import HealthJudge
from node_manager.metrics import Metrics

logger = logging.getLogger(__name__)

# Bounds that catch nonsense in a spec (a rank or port far outside anything real).
MAX_DP_RANK = 4095
# Lines of the engine's log quoted in the reason of an unexpected exit.
LOG_TAIL_LINES = 3

Reporter = Callable[[types_pb2.Engine, str], Awaitable[None]]


class NodeManager:
    """Engines of one host. Call `await start()` once (re-adopts engines from the state dir)."""

    def __init__(self, config: NodeManagerConfig):
        self.config = config
        self.node_id = config.node_id
        self.records: dict[str, EngineRecord] = {}
        self.store = RecordStore(config.engines_dir)
        self.metrics = Metrics(config.node_id)
        start, end = config.port_range_bounds
        self.ports = PortAllocator(start, end, host=config.host)
        self.argv = config.engine_argv()
        # Called with (engine, reason) whenever an engine fails: the controller link reports it.
        self.reporter: Reporter | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task] = set()
        self._closed = False

    # Life of the node manager ---------------------------------------------------------------

    async def start(self) -> None:
        """Load the engine records and re-adopt engines still alive (after a restart)."""
        for record in self.store.load_all():
            self.records[record.engine_id] = record
            record.settled = asyncio.Event()
            if not record.active:
                record.settled.set()
                continue
            for port in record.allocated_ports:
                self.ports.reserve(port)
            if record.pid and processes.same_process(record.pid, record.process_started):
                logger.info("engine %s: re-adopting pid %d (%s)", record.engine_id, record.pid, state_name(record.state))
                self._watch(record, popen=None)
                if record.state == STOPPING:
                    self._begin_stop(record, self.config.stop_deadline, "stop requested before a node-manager restart")
                else:
                    self._monitor(record)
            else:
                record.busy = "exit"
                self._spawn(self._handle_exit(record, processes.ExitStatus(), while_away=True))
        self._publish_counts()

    async def close(self) -> None:
        """Stop supervising (engines keep running: a restarted node manager re-adopts them)."""
        self._closed = True
        for record in self.records.values():
            self._cancel_tasks(record)
            if record.watch is not None:
                record.watch.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    # Queries ----------------------------------------------------------------------------------

    def get(self, engine_id: str) -> EngineRecord:
        parse_engine_id(engine_id)
        record = self.records.get(engine_id)
        if record is None:
            raise NotFound(f"engine {engine_id!r} is not known on node {self.node_id}")
        return record

    def engines(self) -> list[types_pb2.Engine]:
        return [self.records[key].to_proto(self.node_id) for key in sorted(self.records)]

    def active_engines(self) -> list[EngineRecord]:
        return [r for r in self.records.values() if r.active]

    async def watch(self) -> AsyncIterator[tuple[types_pb2.Engine, bool]]:
        """Every engine at once (snapshot=True), then each change, until the caller stops."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=10000)
        self._subscribers.add(queue)
        try:
            for engine in self.engines():
                yield engine, True
            while True:
                engine = await queue.get()
                if engine is None:
                    raise Unavailable("WatchEngines: this watcher fell more than 10000 changes behind; watch again")
                yield engine, False
        finally:
            self._subscribers.discard(queue)

    # StartEngine ------------------------------------------------------------------------------

    async def start_engine(self, spec: types_pb2.EngineSpec) -> EngineRecord:
        requested = types_pb2.EngineSpec()
        requested.CopyFrom(spec)
        self._check_spec(spec)
        engine_id = make_engine_id(spec.instance_id, spec.dp_rank)
        async with self._lock(engine_id):
            existing = self.records.get(engine_id)
            if existing is not None and existing.active:
                if self._same_request(existing, requested):
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
            record, popen = self._launch(spec, requested)
            if existing is not None:
                self.metrics.restarts.labels(self.node_id).inc()
            self.records[engine_id] = record
            self._changed(record, None)
            self._watch(record, popen=popen)
            self._monitor(record)
            return record

    def _check_spec(self, spec: types_pb2.EngineSpec) -> None:
        """Everything that can be checked without touching the running engines' resources."""
        check_instance_id(spec.instance_id, "spec.instance_id")
        if spec.role not in ROLE_NAMES:
            raise InvalidArgument(f"spec.role {spec.role} is not a role: use ROLE_PREFILL, ROLE_DECODE or ROLE_UNION")
        if spec.dp_rank > MAX_DP_RANK:
            raise InvalidArgument(f"spec.dp_rank {spec.dp_rank} is out of range (0-{MAX_DP_RANK})")
        for name in ("port", "mgmt_port", "kv_port", "dp_rpc_port"):
            if getattr(spec, name) > 65535:
                raise InvalidArgument(f"spec.{name} {getattr(spec, name)} is not a TCP port (1-65535, or 0 to allocate)")
        if not spec.single_container and (spec.kv_port or spec.dp_rpc_port):
            raise InvalidArgument("spec.kv_port and spec.dp_rpc_port are only used with spec.single_container")
        given = [p for p in self._port_fields(spec) if getattr(spec, p)]
        if len({getattr(spec, p) for p in given}) != len(given):
            raise InvalidArgument(f"spec ports must differ: {', '.join(f'{p}={getattr(spec, p)}' for p in given)}")
        if bool(spec.config_path) == bool(spec.config_json):
            raise InvalidArgument("spec: set exactly one of config_path (a file on the node) and config_json")
        if spec.config_json:
            try:
                if not isinstance(json.loads(spec.config_json), dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                raise InvalidArgument(f"spec.config_json is not a JSON object: {exc}") from None
        elif not os.path.isfile(spec.config_path):
            raise FailedPrecondition(f"spec.config_path {spec.config_path!r}: no such file on node {self.node_id}")
        ids = list(spec.accelerator_ids)
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"spec.accelerator_ids {ids} lists an accelerator twice")
        missing = sorted(set(ids) - set(self.config.accelerators))
        if missing:
            raise FailedPrecondition(
                f"spec.accelerator_ids: accelerator(s) {missing} are not on node {self.node_id} "
                f"(it has {self.config.accelerators or 'none'})"
            )

    @staticmethod
    def _port_fields(spec: types_pb2.EngineSpec) -> list[str]:
        return ["port", "mgmt_port"] + (["kv_port", "dp_rpc_port"] if spec.single_container else [])

    def _same_request(self, record: EngineRecord, requested: types_pb2.EngineSpec) -> bool:
        """A repeated StartEngine asks for the running engine: unset ports, host and config match."""
        wanted = types_pb2.EngineSpec()
        wanted.CopyFrom(requested)
        for name in ("port", "mgmt_port", "kv_port", "dp_rpc_port", "host", "master_dp_ip"):
            if not getattr(wanted, name):
                setattr(wanted, name, getattr(record.spec, name))
        if wanted.config_json and not wanted.config_path:
            wanted.config_path = record.spec.config_path
        elif wanted.config_path:
            wanted.config_path = os.path.abspath(wanted.config_path)
        return wanted == record.spec

    def _launch(self, spec: types_pb2.EngineSpec, requested: types_pb2.EngineSpec) -> tuple[EngineRecord, subprocess.Popen]:
        """Allocate accelerators and ports, write the config, exec the engine server."""
        engine_id = make_engine_id(spec.instance_id, spec.dp_rank)
        busy = {a: r.engine_id for r in self.active_engines() for a in r.spec.accelerator_ids}
        taken = sorted(a for a in spec.accelerator_ids if a in busy)
        if taken:
            raise FailedPrecondition(
                f"spec.accelerator_ids: accelerator(s) {taken} are in use by {sorted({busy[a] for a in taken})}"
            )
        spec = types_pb2.EngineSpec()
        spec.CopyFrom(requested)
        spec.host = spec.host or self.config.host
        spec.master_dp_ip = spec.master_dp_ip or spec.host
        reserved: list[int] = []  # every port of the engine, released when it ends
        try:
            used = {p: r.engine_id for r in self.active_engines() for p in self._ports_of(r.spec)}
            for name in self._port_fields(spec):
                port = getattr(spec, name)
                if port:
                    if port in used:
                        raise FailedPrecondition(f"spec.{name} {port} is in use by engine {used[port]}")
                    if not port_is_free(port, spec.host):
                        raise FailedPrecondition(f"spec.{name} {port} is already in use on {spec.host}")
                    self.ports.reserve(port)
                else:
                    try:
                        port = self.ports.allocate()
                    except RuntimeError as exc:
                        raise FailedPrecondition(f"spec.{name}: {exc} on node {self.node_id}") from None
                    setattr(spec, name, port)
                reserved.append(port)
            engine_dir = os.path.abspath(self.store.engine_dir(spec))
            if spec.config_json:
                spec.config_path = os.path.join(engine_dir, "user_config.json")
                with open(spec.config_path, "w", encoding="utf-8") as handle:
                    handle.write(spec.config_json)
            else:
                spec.config_path = os.path.abspath(spec.config_path)
            log_path = os.path.abspath(
                os.path.join(self.config.logs_dir, "engines", f"{spec.instance_id}_rank{spec.dp_rank}.log")
            )
            argv = self._engine_argv(spec)
            env = dict(os.environ)
            visible = ",".join(str(a) for a in spec.accelerator_ids)
            env["CUDA_VISIBLE_DEVICES"] = visible
            env["ASCEND_RT_VISIBLE_DEVICES"] = visible
            token = uuid.uuid4().hex
            try:
                # Run in the engine's own directory: files it writes relative to its working
                # directory (engine_server_log/, core dumps) stay with the engine's state.
                popen = processes.launch(argv, log_path, env=env, token=token, cwd=engine_dir)
            except OSError as exc:
                raise FailedPrecondition(
                    f"cannot launch the engine command {argv[0]!r} (--engine-command): {exc.strerror or exc}"
                ) from None
        except BaseException:
            for port in reserved:
                self.ports.release(port)
            raise
        record = EngineRecord(
            spec=spec,
            requested=requested,
            log_path=log_path,
            token=token,
            state=STARTING,
            state_reason=f"launched pid {popen.pid}",
            pid=popen.pid,
            pgid=popen.pid,
            process_started=processes.create_time(popen.pid),
            allocated_ports=reserved,
        )
        record.settled = asyncio.Event()
        logger.info("engine %s: launched pid %d: %s (log %s)", engine_id, popen.pid, " ".join(argv), log_path)
        return record, popen

    @staticmethod
    def _ports_of(spec: types_pb2.EngineSpec) -> list[int]:
        return [p for p in (spec.port, spec.mgmt_port, spec.kv_port, spec.dp_rpc_port) if p]

    def _engine_argv(self, spec: types_pb2.EngineSpec) -> list[str]:
        argv = [
            *self.argv,
            "--dp-rank", str(spec.dp_rank),
            "--instance-id", spec.instance_id,
            "--role", role_name(spec.role),
            "--host", spec.host,
            "--port", str(spec.port),
            "--mgmt-port", str(spec.mgmt_port),
            "--master-dp-ip", spec.master_dp_ip,
            "--config-path", spec.config_path,
        ]
        if spec.single_container:
            argv += ["--kv-port", str(spec.kv_port), "--dp-rpc-port", str(spec.dp_rpc_port)]
        return argv

    # StopEngine -------------------------------------------------------------------------------

    async def stop_engine(self, engine_id: str, deadline: float | None = None, generation: int = 0,
                          why: str = "stop requested") -> EngineRecord:
        record = self.get(engine_id)
        if generation and record.generation > generation:
            logger.info("engine %s: not stopping generation %d for a request about generation %d",
                        engine_id, record.generation, generation)
            return record
        deadline = self.config.stop_deadline if deadline is None else deadline
        self._begin_stop(record, deadline, why)
        await record.settled.wait()
        # Idempotent clean-up: nothing of an ended engine may be left running (found by its token:
        # its pid and process group may belong to someone else by now).
        token_tree = record.token_tree
        if await asyncio.to_thread(processes.find_tree, token_tree):
            self.metrics.kill("orphans")
            await processes.kill_tree_confirmed(token_tree)
        return record

    def _begin_stop(self, record: EngineRecord, deadline: float, why: str) -> None:
        if record.active and not record.busy:
            record.busy = "stop"
            self._spawn(self._stop(record, deadline, why))

    async def _stop(self, record: EngineRecord, deadline: float, why: str) -> None:
        self._cancel_tasks(record)
        if record.state != STOPPING:
            record.transition(STOPPING, f"{why}: SIGTERM, {deadline:g}s deadline", self._changed)
        began = time.monotonic()
        graceful, left = await processes.terminate_tree(
            record.tree, record.watch.exited, deadline, record.remembered
        )
        if not graceful:
            self.metrics.kill("stop_deadline")
        await self._wait_exit(record)
        status = record.watch.status or processes.ExitStatus()
        record.record_exit(status)
        if left:
            self._end(record, FAILED, f"{why}: processes {[p.pid for p in left]} survived SIGKILL")
            return
        how = (f"{status.describe()} {time.monotonic() - began:.2f}s after SIGTERM" if graceful
               else f"SIGKILL after the {deadline:g}s deadline")
        self._end(record, STOPPED, f"{why}: {how}")

    async def _wait_exit(self, record: EngineRecord, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(record.watch.exited.wait(), timeout)
        except asyncio.TimeoutError:
            logger.error("engine %s: pid %d exit not confirmed %gs after its tree was killed", record.engine_id, record.pid, timeout)

    # Exits and kills --------------------------------------------------------------------------

    def _watch(self, record: EngineRecord, popen) -> None:
        watch = processes.ExitWatch(
            record.pid, lambda status: self._on_exit(record, status), popen=popen, started=record.process_started
        )
        record.watch = watch
        watch.start()

    def _on_exit(self, record: EngineRecord, status: processes.ExitStatus) -> None:
        logger.info("engine %s: pid %d %s", record.engine_id, record.pid, status.describe())
        if record.busy or self._closed:
            return  # the stop or kill under way records it
        record.busy = "exit"  # at once: a StopEngine arriving now waits for this instead
        self._spawn(self._handle_exit(record, status))

    async def _handle_exit(self, record: EngineRecord, status: processes.ExitStatus, while_away: bool = False) -> None:
        """An exit nobody asked for (exit code 0 included) is a failure."""
        self._cancel_tasks(record)
        # Children may outlive the engine server (an orphaned engine core holds accelerator memory).
        # After a restart the process group id may have been reused: use the token only then.
        tree = record.token_tree if while_away else record.tree
        left = await asyncio.to_thread(processes.find_tree, tree, record.remembered)
        if left:
            logger.warning("engine %s: killing %d leftover process(es) of its tree: %s",
                           record.engine_id, len(left), [p.pid for p in left])
            self.metrics.kill("orphans")
            await processes.kill_tree_confirmed(tree, record.remembered)
        was = state_name(record.state)
        record.record_exit(status)
        if while_away:
            reason = "exited while the node manager was not running (exit code unknown)"
        else:
            reason = f"{status.describe()} without being asked to stop (while {was})"
        tail = self._log_tail(record)
        if tail:
            reason += f"; log: {tail}"
        self._end(record, FAILED, reason)
        await self._report(record, reason)

    async def _kill_abnormal(self, record: EngineRecord, reason: str) -> None:
        if record.busy or record.watch.status is not None:
            return
        record.busy = "kill"
        self._cancel_tasks(record, keep=asyncio.current_task())
        logger.warning("engine %s: %s", record.engine_id, reason)
        self.metrics.kill("abnormal")
        await processes.kill_tree_confirmed(record.tree, record.remembered)
        await self._wait_exit(record)
        record.record_exit(record.watch.status or processes.ExitStatus(signal=9))
        self._end(record, FAILED, reason)
        await self._report(record, reason)

    def _end(self, record: EngineRecord, state: int, reason: str) -> None:
        for port in record.allocated_ports:
            self.ports.release(port)
        record.transition(state, reason, self._changed)
        if state == FAILED:
            self.metrics.failures.labels(self.node_id).inc()
        record.settled.set()

    async def _report(self, record: EngineRecord, reason: str) -> None:
        if self.reporter is not None and not self._closed:
            try:
                await self.reporter(record.to_proto(self.node_id), reason)
            except Exception:  # the next heartbeat carries the failure anyway
                logger.exception("engine %s: reporting the failure failed", record.engine_id)

    def _log_tail(self, record: EngineRecord) -> str:
        try:
            with open(record.log_path, "rb") as handle:
                handle.seek(max(0, os.path.getsize(record.log_path) - 4096))
                lines = [l.strip() for l in handle.read().decode(errors="replace").splitlines() if l.strip()]
        except OSError:
            return ""
        lines = [l for l in lines if not l.startswith("--- ")]
        tail = " | ".join(lines[-LOG_TAIL_LINES:])
        return tail if len(tail) <= 600 else "..." + tail[-600:]

    # Health monitoring ------------------------------------------------------------------------

    def _monitor(self, record: EngineRecord) -> None:
        record.tasks.append(self._spawn(self._poll_status(record)))
        record.tasks.append(self._spawn(self._follow_probes(record)))

    def _engine_channel(self, record: EngineRecord) -> grpc.aio.Channel:
        host = record.spec.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        target = f"{host}:{record.spec.mgmt_port}"
        # Reconnect quickly: a starting engine binds its port within a second or so, and the
        # default 1 s (growing) reconnect backoff would delay noticing that it is up.
        fast_reconnect = {"grpc.initial_reconnect_backoff_ms": 50, "grpc.min_reconnect_backoff_ms": 50,
                          "grpc.max_reconnect_backoff_ms": 1000}
        return aio_channel(target, engine_tls(record.spec, self.config), options=fast_reconnect)

    async def _poll_status(self, record: EngineRecord) -> None:
        """Every heartbeat interval: GetStatus with a deadline, judged by HealthJudge."""
        interval, timeout = self.config.heartbeat_interval, self.config.status_timeout
        judge = HealthJudge(self.config.abnormal_threshold, self.config.startup_grace)
        channel = self._engine_channel(record)
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        try:
            next_tick = time.monotonic()
            while record.active and not record.busy:
                status, error = None, ""
                began = time.monotonic()
                try:
                    # wait_for_ready: within the deadline, wait for the engine's port instead of
                    # failing at once on the channel's reconnect backoff from when it was starting.
                    reply = await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout, wait_for_ready=True)
                    status = reply.status
                    self.metrics.status_latency.labels(self.node_id).observe(time.monotonic() - began)
                except grpc.aio.AioRpcError as exc:
                    error = (f"GetStatus timed out after {timeout:g}s" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                             else f"GetStatus failed: {exc.code().name}: {exc.details()}")
                if record.busy or not record.active:
                    return
                # A failed call that began before the engine answered on its probe stream (it was
                # still binding its port) is older news than that answer: it is not judged.
                stale = status is None and record.stream_heard_at > began
                if not stale and await self._judge_heartbeat(record, judge, status, error):
                    return
                next_tick += interval
                await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
                next_tick = max(next_tick, time.monotonic() - interval)
        finally:
            await channel.close()

    async def _judge_heartbeat(self, record: EngineRecord, judge: HealthJudge,
                               status: types_pb2.EngineStatus | None, error: str) -> bool:
        """Judge one GetStatus answer (or its absence); True when the engine was killed for it."""
        # An answer on the probe stream counts as the engine having answered too.
        judge.ever_answered |= record.ever_answered or record.state == RUNNING
        verdict = judge.judge(status, error, time.time() - record.started_at)
        self._remember_descendants(record)
        changed = (record.health, record.health_reason, record.consecutive_abnormal) != (
            verdict.health, verdict.reason, judge.consecutive)
        record.health, record.health_reason = verdict.health, verdict.reason
        record.consecutive_abnormal = judge.consecutive
        record.ever_answered = judge.ever_answered
        if verdict.counted:
            logger.warning("engine %s: abnormal heartbeat %d/%d: %s", record.engine_id,
                           judge.consecutive, judge.threshold, verdict.reason)
        if verdict.kill:
            self._publish(record)
            await self._kill_abnormal(record, judge.kill_reason())
            return True
        if record.state == STARTING and verdict.health == types_pb2.HEALTH_STATUS_NORMAL:
            record.transition(RUNNING, "engine server reported NORMAL", self._changed)
        elif changed:
            self._publish(record)
        return False

    def _remember_descendants(self, record: EngineRecord) -> None:
        """Children re-parented to init after their parent died can still be found and killed."""
        known = {pid for pid, _ in record.remembered}
        for item in processes.descendants(record.pid):
            if item[0] not in known:
                record.remembered.append(item)
        if len(record.remembered) > 256:
            record.remembered = [item for item in record.remembered if processes.same_process(*item)]

    async def _follow_probes(self, record: EngineRecord) -> None:
        """Keep last_probe / recent_probes from the engine's WatchProbes stream (reconnecting).

        The stream also sends every status change at once: a starting engine is RUNNING as soon
        as it reports NORMAL, without waiting for the next heartbeat. Counting abnormal
        heartbeats stays with the periodic GetStatus (a stream can stall silently)."""
        channel = self._engine_channel(record)
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        try:
            while record.active and not record.busy:
                try:
                    call = stub.WatchProbes(engine_pb2.WatchProbesRequest(), wait_for_ready=True)
                    async for message in call:
                        if record.busy or not record.active:
                            return
                        record.ever_answered = True
                        record.stream_heard_at = time.monotonic()
                        if message.HasField("probe"):
                            record.add_probe(message.probe)
                        if record.state == STARTING and message.status.status == types_pb2.HEALTH_STATUS_NORMAL:
                            record.health, record.health_reason = message.status.status, message.status.reason
                            record.transition(RUNNING, "engine server reported NORMAL", self._changed)
                        elif message.HasField("probe"):
                            self._publish(record)
                except grpc.aio.AioRpcError as exc:
                    logger.debug("engine %s: probe stream ended: %s", record.engine_id, exc.code().name)
                await asyncio.sleep(self.config.heartbeat_interval)
        finally:
            await channel.close()

    # Fencing by the controller ----------------------------------------------------------------

    def reconcile(self, assignments: Iterable[tuple[str, int]], reported: set[tuple[str, int]] | None = None) -> list[str]:
        """Stop every active engine the controller does not assign (or assigns another generation).

        `reported`: the (engine id, generation) pairs the controller was shown; others are left alone."""
        wanted = dict(assignments)
        stopped = []
        for record in self.active_engines():
            if reported is not None and (record.engine_id, record.generation) not in reported:
                continue
            generation = wanted.get(record.engine_id)
            if generation is None or (generation and generation != record.generation):
                why = ("not assigned to this node by the controller" if generation is None
                       else f"the controller assigns generation {generation}, this copy is generation {record.generation}")
                self.metrics.kill("unassigned")
                stopped.append(record.engine_id)
                self._spawn(self.stop_engine(record.engine_id, why=f"fenced: {why}"))
        return stopped

    # Plumbing ---------------------------------------------------------------------------------

    def _changed(self, record: EngineRecord, old_state: int | None) -> None:
        self.store.save(record)
        self._publish(record)
        self._publish_counts()

    def _publish(self, record: EngineRecord) -> None:
        engine = record.to_proto(self.node_id)
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(engine)
            except asyncio.QueueFull:
                # End that stream (the watcher re-watches and gets a fresh snapshot) rather than
                # let it silently miss changes.
                logger.warning("ending a WatchEngines stream that does not keep up")
                self._subscribers.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)

    def _publish_counts(self) -> None:
        counts: dict[str, int] = {}
        for record in self.records.values():
            name = state_name(record.state).lower()
            counts[name] = counts.get(name, 0) + 1
        self.metrics.set_states(counts)

    def _lock(self, engine_id: str) -> asyncio.Lock:
        return self._locks.setdefault(engine_id, asyncio.Lock())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("node manager task failed", exc_info=task.exception())

    def _cancel_tasks(self, record: EngineRecord, keep: asyncio.Task | None = None) -> None:
        for task in record.tasks:
            if task is not keep:
                task.cancel()
        record.tasks = []


def engine_tls(spec: types_pb2.EngineSpec, config: NodeManagerConfig) -> TlsFiles | None:
    """TLS files for calling an engine's management plane, from its user_config's mgmt_tls_config.

    The CA (--engine-tls-ca, else the section's ca_file) verifies the engine's certificate. When
    the engine verifies clients (ca_file set) the node manager presents --engine-tls-cert/key,
    else the section's cert_file/key_file (a certificate that must then allow client auth). An
    unreadable config means plaintext: the engine server itself refuses to start with it (and
    that failure is reported)."""
    from engine_server.config import UserConfig, section_name_for

    try:
        if spec.config_json:
            data = json.loads(spec.config_json)
        else:
            with open(spec.config_path, encoding="utf-8") as handle:
                data = json.load(handle)
        user_config = UserConfig.model_validate(data)
        section = getattr(user_config, section_name_for(role_name(spec.role), user_config))
    except Exception:
        return None
    tls = section.mgmt_tls_config if section is not None else None
    if tls is None or not tls.enable_tls:
        return None
    ca = config.engine_tls_ca or tls.ca_file
    if not tls.ca_file:
        return TlsFiles(ca=ca)
    if config.engine_tls_cert:
        return TlsFiles(cert=config.engine_tls_cert, key=config.engine_tls_key, ca=ca)
    return TlsFiles(cert=tls.cert_file, key=tls.key_file, ca=ca)
