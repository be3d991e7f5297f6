"""A node-manager client double for the controller's logic tests: it keeps, per node, the
engines it was asked to run, and can be told that a node is unreachable."""

from __future__ import annotations

import asyncio
import itertools
import time

from controller.engines.node_client import NodeCallError, NodeClient
from motor.contract.names import engine_id
from motor.v1 import node_manager_pb2, types_pb2


class FakeNodeClient(NodeClient):
    def __init__(self):
        self.engines: dict[str, dict[str, types_pb2.Engine]] = {}
        self.calls: list[tuple] = []
        self.unreachable: set[str] = set()
        self.start_errors: dict[str, NodeCallError] = {}  # engine id -> error for the next start
        self.processes: dict[str, types_pb2.NodeManagerProcess] = {}  # node id -> the process answering there
        self.frozen: set[str] = (
            set()
        )  # node ids whose StartEngine calls hang until abandon() (a SIGSTOPped node manager)
        self._hanging: dict[str, list[asyncio.Future]] = {}  # node id -> the calls hanging there
        self._ports = itertools.count(30000)
        self._pids = itertools.count(1000)

    def starts(self, engine: str | None = None) -> list[types_pb2.EngineSpec]:
        return [
            c[2]
            for c in self.calls
            if c[0] == "start" and (engine is None or engine_id(c[2].instance_id, c[2].dp_rank) == engine)
        ]

    def stops(self) -> list[tuple[str, str, int]]:
        return [(c[1], c[2], c[3]) for c in self.calls if c[0] == "stop"]

    def _check(self, node) -> None:
        if node.node_id in self.unreachable:
            raise NodeCallError("UNAVAILABLE", f"{node.address}: connection refused")

    async def start_engine(self, node, spec):
        self.calls.append(("start", node.node_id, spec))
        self._check(node)
        if node.node_id in self.frozen:
            hang = asyncio.get_running_loop().create_future()
            self._hanging.setdefault(node.node_id, []).append(hang)
            await hang  # raises what abandon() sets
        eid = engine_id(spec.instance_id, spec.dp_rank)
        if eid in self.start_errors:
            raise self.start_errors.pop(eid)
        filled = types_pb2.EngineSpec()
        filled.CopyFrom(spec)
        filled.port = spec.port or next(self._ports)
        filled.mgmt_port = spec.mgmt_port or next(self._ports)
        if spec.kv_events:  # (a node manager gives the engine a KV-events port too)
            filled.kv_events_port = spec.kv_events_port or next(self._ports)
        engine = types_pb2.Engine(
            engine_id=eid,
            spec=filled,
            state=types_pb2.ENGINE_STATE_STARTING,
            health=types_pb2.HEALTH_STATUS_INIT,
            pid=next(self._pids),
            node_id=node.node_id,
        )
        self.engines.setdefault(node.node_id, {})[eid] = engine
        return engine

    async def stop_engine(self, node, engine_id, generation, deadline):
        self.calls.append(("stop", node.node_id, engine_id, generation, deadline))
        self._check(node)
        engine = self.engines.get(node.node_id, {}).get(engine_id)
        if engine is not None and (generation == 0 or engine.spec.generation <= generation):
            engine.state = types_pb2.ENGINE_STATE_STOPPED

    async def forget(self, address):
        self.calls.append(("forget", address))

    def abandon(self, node_id, why):
        self.calls.append(("abandon", node_id))
        for hang in self._hanging.pop(node_id, []):
            hang.set_exception(NodeCallError("CANCELLED", why, abandoned=True))

    async def list_engines(self, node, timeout):
        self.calls.append(("list", node.node_id))
        self._check(node)
        return node_manager_pb2.ListEnginesResponse(
            engines=self.engines.get(node.node_id, {}).values(), process=self.processes.get(node.node_id)
        )

    # What a node manager would send.
    def report(self, node_id: str) -> list[types_pb2.Engine]:
        return list(self.engines.get(node_id, {}).values())

    def set_health(
        self, node_id: str, health=types_pb2.HEALTH_STATUS_NORMAL, state=types_pb2.ENGINE_STATE_RUNNING
    ) -> None:
        for engine in self.engines.get(node_id, {}).values():
            if engine.state in (types_pb2.ENGINE_STATE_STARTING, types_pb2.ENGINE_STATE_RUNNING):
                engine.state, engine.health = state, health


class ManualClock:
    """A `motor.clock.Clock` whose monotonic time moves only when told (`advance`); calling it
    reads that time too. Wall time and sleeps stay real (dates and restart backoffs)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds
