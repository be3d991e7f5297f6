"""Fakes for the node manager's seams: process operations, the clock, an engine's management plane.

They let tests drive the kill decision, adoption and restarts step by step in milliseconds; the
real-process tests beside them check the real operations."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from motor.contract import pbtime
from motor.processes import ExitStatus, TreeId
from motor.v1 import controller_pb2, engine_pb2, types_pb2
from node_manager.config import NodeManagerConfig
from node_manager.controller_link import ControllerLink
from node_manager.engine import EngineRecord
from node_manager.engine_client import NoAnswer
from node_manager.manager import NodeManager


class FakeClock:
    """Time moves only when someone sleeps on it (or a test advances it)."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_800_000_000.0, 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)


@dataclass
class FakeProcess:
    pid: int
    started: float
    token: str
    pgid: int
    parent: int = 0
    alive: bool = True
    obeys_sigterm: bool = True


@dataclass
class FakeWatch:
    pid: int
    on_exit: Callable[[ExitStatus], None]
    child: bool  # our own child: the exit code is known
    status: ExitStatus | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    noticed_at: float | None = None
    closed: bool = False

    def fire(self, status: ExitStatus) -> None:
        if self.status is not None or self.closed:
            return
        self.status = status if self.child else ExitStatus()
        self.exited.set()
        self.on_exit(self.status)

    def close(self) -> None:
        self.closed = True


class FakeProcessOps:
    """A process table in memory. Exits are delivered from the event loop, as pidfd readiness is."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.procs: dict[int, FakeProcess] = {}
        self.watches: dict[int, FakeWatch] = {}
        self.launched: list[list[str]] = []
        self.kills: list[TreeId] = []  # trees SIGKILLed, in order
        self.terminated: list[TreeId] = []  # trees sent SIGTERM
        self.hold_terminate = asyncio.Event()  # clear it to keep a stop waiting
        self.hold_terminate.set()
        self.hold_find = asyncio.Event()  # clear it to keep a search of a tree waiting (a slow /proc scan)
        self.hold_find.set()
        self._pids = itertools.count(4000)

    # Test controls --------------------------------------------------------------------------

    def spawn_child(self, parent: int, escape_group: bool = False, keep_token: bool = True) -> FakeProcess:
        """A process started by `parent` (an engine core); it may leave the group or drop the token."""
        leader = self.procs[parent]
        pid = next(self._pids)
        proc = FakeProcess(
            pid,
            self.clock.time(),
            leader.token if keep_token else "",
            pid if escape_group else leader.pgid,
            parent=parent,
        )
        self.procs[pid] = proc
        return proc

    def exit(self, pid: int, status: ExitStatus) -> None:
        """The process ends by itself (or is killed by someone else)."""
        self.procs[pid].alive = False
        watch = self.watches.get(pid)
        if watch is not None:
            asyncio.get_running_loop().call_soon(watch.fire, status)

    def alive(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.alive]

    # ProcessOps -----------------------------------------------------------------------------

    def launch(self, argv: list[str], log_path: str, env: dict[str, str], token: str, cwd: str) -> FakeProcess:
        self.launched.append(argv)
        pid = next(self._pids)
        proc = FakeProcess(pid, self.clock.time(), token, pid)
        self.procs[pid] = proc
        return proc

    def create_time(self, pid: int) -> float | None:
        proc = self.procs.get(pid)
        return proc.started if proc is not None and proc.alive else None

    def same_process(self, pid: int, started: float | None) -> bool:
        proc = self.procs.get(pid)
        return proc is not None and proc.alive and (started is None or proc.started == started)

    def descendants(self, pid: int) -> list[tuple[int, float]]:
        found, frontier = [], [pid]
        while frontier:
            parent = frontier.pop()
            for proc in self.procs.values():
                if proc.parent == parent and proc.alive:
                    found.append((proc.pid, proc.started))
                    frontier.append(proc.pid)
        return found

    def watch_exit(
        self, pid: int, on_exit: Callable[[ExitStatus], None], child: object | None, started: float | None
    ) -> FakeWatch:
        watch = FakeWatch(pid, on_exit, child=child is not None)
        self.watches[pid] = watch
        if not self.same_process(pid, started):
            asyncio.get_running_loop().call_soon(watch.fire, ExitStatus())
        return watch

    def _tree(self, tree: TreeId, remembered) -> list[FakeProcess]:
        remembered = set(remembered)
        found = [
            p
            for p in self.procs.values()
            if p.alive
            and (
                (tree.pgid and p.pgid == tree.pgid)
                or (tree.token and p.token == tree.token)
                or (p.pid, p.started) in remembered
            )
        ]
        for proc in list(found):
            found += [self.procs[pid] for pid, _ in self.descendants(proc.pid) if self.procs[pid] not in found]
        return found

    async def find_tree(self, tree: TreeId, remembered=()) -> list[int]:
        await self.hold_find.wait()
        return [p.pid for p in self._tree(tree, remembered)]

    async def kill_tree_confirmed(self, tree: TreeId, remembered=()) -> list[int]:
        self.kills.append(tree)
        for proc in self._tree(tree, remembered):
            self.exit(proc.pid, ExitStatus(signal=9))
        return []

    async def terminate_tree(
        self, tree: TreeId, exited: asyncio.Event, deadline: float, remembered=()
    ) -> tuple[bool, list[int]]:
        self.terminated.append(tree)
        await self.hold_terminate.wait()
        leader = self.procs[tree.pid]
        if leader.obeys_sigterm and leader.alive:
            self.exit(leader.pid, ExitStatus(exit_code=0))
            await exited.wait()
            if not self._tree(tree, remembered):
                return True, []
        await self.kill_tree_confirmed(tree, remembered)
        return False, []


class FakeEngine:
    """One engine's management plane, answered by the test one heartbeat at a time."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.answers: asyncio.Queue[types_pb2.EngineStatus | str] = asyncio.Queue()
        self.stream: asyncio.Queue[engine_pb2.WatchProbesResponse | None] = asyncio.Queue()
        self.calls = 0  # GetStatus calls made
        self.waiting = False  # a GetStatus call waits for its answer
        self.clients_open = 0

    async def get_status(self, timeout: float) -> types_pb2.EngineStatus:
        self.calls += 1
        self.waiting = True
        try:
            answer = await self.answers.get()
        finally:
            self.waiting = False
        if isinstance(answer, str):
            self.clock.advance(timeout)  # a call that gets no answer lasts its whole deadline
            raise NoAnswer(answer)
        return answer

    async def watch_probes(self) -> AsyncIterator[engine_pb2.WatchProbesResponse]:
        while True:
            message = await self.stream.get()
            if message is None:
                raise NoAnswer("UNAVAILABLE")
            yield message


class FakeEngineClient:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        engine.clients_open += 1

    async def get_status(self, timeout: float) -> types_pb2.EngineStatus:
        return await self.engine.get_status(timeout)

    def watch_probes(self) -> AsyncIterator[engine_pb2.WatchProbesResponse]:
        return self.engine.watch_probes()

    async def close(self) -> None:
        self.engine.clients_open -= 1


NORMAL = types_pb2.EngineStatus(status=types_pb2.HEALTH_STATUS_NORMAL, reason="ok")
INIT = types_pb2.EngineStatus(status=types_pb2.HEALTH_STATUS_INIT, reason="loading")
ABNORMAL = types_pb2.EngineStatus(status=types_pb2.HEALTH_STATUS_ABNORMAL, reason="probe failed")
TIMED_OUT = "GetStatus timed out after 0.5s"


class FakeNode:
    """A NodeManager on fakes, with one FakeEngine per engine id (kept across node-manager restarts)."""

    def __init__(self, state_dir: str, **overrides):
        values = dict(
            node_id="node-f",
            state_dir=state_dir,
            host="127.0.0.1",
            accelerators=[0, 1],
            port_range="47000-47099",
            # Its own: fake engines bind nothing, and tests that never close their managers
            # would otherwise hold the shared range's ports for the whole run.
            port_lock_dir=os.path.join(state_dir, "port-locks"),
            heartbeat_interval=0.5,
            status_timeout=0.5,
            abnormal_threshold=3,
            startup_grace=60,
            stop_deadline=5,
        )
        values.update(overrides)
        self.config = NodeManagerConfig(**values)
        self.clock = FakeClock()
        self.ops = FakeProcessOps(self.clock)
        self.engines: dict[str, FakeEngine] = {}
        self.reports: list[tuple[types_pb2.Engine, str]] = []
        self.manager = self.new_manager()

    def new_manager(self) -> NodeManager:
        manager = NodeManager(self.config, ops=self.ops, clock=self.clock, engine_clients=self._client)
        manager.reporter = self._report
        return manager

    def _client(self, spec: types_pb2.EngineSpec) -> FakeEngineClient:
        engine_id = f"{spec.instance_id}/rank{spec.dp_rank}"
        return FakeEngineClient(self.engines.setdefault(engine_id, FakeEngine(self.clock)))

    async def _report(self, engine: types_pb2.Engine, reason: str) -> None:
        self.reports.append((engine, reason))

    def engine(self, engine_id: str = "prefill-0/rank0") -> FakeEngine:
        return self.engines.setdefault(engine_id, FakeEngine(self.clock))

    async def answer(self, answer: types_pb2.EngineStatus | str, engine_id: str = "prefill-0/rank0") -> None:
        """Answer the pending GetStatus, then wait until the monitor has judged it (it asks again,
        or stops watching)."""
        engine = self.engine(engine_id)
        await settle(lambda: engine.waiting)
        calls = engine.calls
        engine.answers.put_nowait(answer)
        record = self.manager.records[engine_id]
        await settle(lambda: engine.calls > calls or not record.active or record.being_ended)


async def ended(record: EngineRecord, timeout: float = 10.0) -> None:
    """Wait until the record reached a final state (the timeout only catches a hang)."""
    await asyncio.wait_for(record.settled.wait(), timeout)


async def settle(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Let the event loop run until `condition` holds (no wall-clock time involved)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached after {turns} event-loop turns: {condition}")


def sim_spec(instance_id: str = "prefill-0", generation: int = 0, **fields) -> types_pb2.EngineSpec:
    return types_pb2.EngineSpec(
        instance_id=instance_id,
        role=types_pb2.ROLE_PREFILL,
        generation=generation,
        config_json='{"motor_engine_prefill_config": {"engine_type": "sim"}}',
        **fields,
    )


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"scripted {code.name}")


class ScriptedController:
    """Stands in for the link's stub: each call is timed on the fake clock and answered from a
    script of status codes (an empty script answers OK)."""

    def __init__(self, clock):
        self.clock = clock
        self.calls: list[tuple[str, float, object]] = []
        self.errors: dict[str, list[grpc.StatusCode]] = {"RegisterNode": [], "Heartbeat": [], "ReportEngineEvent": []}
        self.generation = 0
        self.announce: float | None = None  # the heartbeat interval its answers announce (None: none)

    def times(self, method: str) -> list[float]:
        return [at for name, at, _ in self.calls if name == method]

    def requests(self, method: str) -> list:
        return [request for name, _, request in self.calls if name == method]

    def _answer(self, method: str, request) -> None:
        self.calls.append((method, self.clock.monotonic(), request))
        if self.errors[method]:
            raise rpc_error(self.errors[method].pop(0))

    async def RegisterNode(self, request, timeout):
        self._answer("RegisterNode", request)
        self.generation += 1
        reply = controller_pb2.RegisterNodeResponse(generation=self.generation)
        if self.announce is not None:
            reply.heartbeat_interval.CopyFrom(pbtime.duration(self.announce))
        return reply

    async def Heartbeat(self, request, timeout):
        self._answer("Heartbeat", request)
        reply = controller_pb2.HeartbeatResponse()
        if self.announce is not None:
            reply.heartbeat_interval.CopyFrom(pbtime.duration(self.announce))
        return reply

    async def ReportEngineEvent(self, request, timeout):
        self._answer("ReportEngineEvent", request)
        return controller_pb2.ReportEngineEventResponse()


class ScriptedChannel:
    """Stands in for the link's ReloadingChannel: every stub is the scripted controller."""

    def __init__(self, controller: ScriptedController):
        self.controller = controller

    def stub(self, stub_class) -> ScriptedController:
        return self.controller

    async def close(self) -> None:
        pass


INTERVAL, MAX_BACKOFF = 1.0, 8.0  # the link's heartbeat interval and its longest backoff


@pytest.fixture
async def link(tmp_path):
    node = FakeNode(str(tmp_path / "node"))
    await node.manager.start()
    link = ControllerLink(
        node.manager,
        "127.0.0.1:1",
        controller_pb2.NodeInfo(node_id="node-f"),
        interval=INTERVAL,
        max_backoff=MAX_BACKOFF,
        clock=node.clock,
        stream_heartbeats=False,
        phase=0.0,
    )
    link.channels[link.address] = ScriptedChannel(ScriptedController(node.clock))
    task = None

    def run() -> None:
        nonlocal task
        task = asyncio.get_running_loop().create_task(link.run())

    link.start = run
    yield link
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    else:
        await link.channels[link.address].close()
    await node.manager.close()
