"""The controller on a temporary SQLite store with a fake node-manager client (`Harness`), the node
reports and deployments its tests build, and the example deployment run to READY."""

from __future__ import annotations

import asyncio
import contextlib
import os

from prometheus_client.parser import text_string_to_metric_families

from controller.config import ControllerConfig
from controller.core import Controller
from controller.fleet.series import FleetSeries
from controller.model.nodes import NODE_READY, NodeRuntime
from controller.store.sqlite import SqliteStore
from motor.contract.deployment_file import deployment_from_dict, load_deployment
from motor.v1 import controller_pb2, types_pb2
from motor.v1 import controller_pb2 as C
from tests.support import REPO_ROOT, async_wait_for
from tests.support.controller_fakes import FakeNodeClient

EXAMPLE = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


def node_info(node_id: str, accelerators: int = 4, port_range: tuple[int, int] = (0, 0)) -> controller_pb2.NodeInfo:
    return controller_pb2.NodeInfo(
        node_id=node_id,
        address=f"127.0.0.1:{1000 + ord(node_id[-1])}",
        host=f"10.0.0.{ord(node_id[-1]) - 96}",
        accelerator_ids=list(range(accelerators)),
        accelerator_type="sim",
        port_range_start=port_range[0],
        port_range_end=port_range[1],
    )


def example_deployment(**policy) -> controller_pb2.Deployment:
    deployment = load_deployment(EXAMPLE)
    for key, value in policy.items():
        if key in ("max_failures",):
            setattr(deployment.restart_policy, key, value)
        elif key == "scope":
            deployment.restart_policy.scope = value
        else:
            getattr(deployment.restart_policy, key).FromNanoseconds(int(value * 1e9))
    return deployment


def small_deployment(groups: list[dict], **extra) -> controller_pb2.Deployment:
    sections = {f"motor_engine_{r}_config": {"engine_type": "sim"} for r in ("prefill", "decode", "union")}
    return deployment_from_dict(
        {"name": "t", "model": "sim-tiny", "engine_config": sections, "instance_groups": groups, **extra}
    )


class Harness:
    """A controller on a temporary SQLite file with a fake node-manager client; short intervals."""

    def __init__(self, tmp_path, clock=None, **overrides):
        self.clock = clock  # a ManualClock drives the controller's monotonic time; None: the system clock
        self.db = str(tmp_path / "controller.db")
        settings = dict(db=self.db, heartbeat_interval=0.1, node_grace=0.6, recheck_timeout=0.2, startup_grace=1.0)
        settings.update(overrides)
        self.config = ControllerConfig(**settings)
        self.client = FakeNodeClient()
        self.controller: Controller | None = None
        self.generations: dict[str, int] = {}

    async def start(self, client: FakeNodeClient | None = None) -> Controller:
        if client is not None:
            self.client = client
        self.store = SqliteStore(self.db)
        clocks = {"clock": self.clock} if self.clock is not None else {}
        self.controller = Controller(self.config, self.store, self.client, **clocks)
        await self.controller.start()
        return self.controller

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
            self.store.close()
            self.controller = None

    async def register(self, node_id: str, **kw):
        reply = await self.controller.register_node(node_info(node_id, **kw), self.client.report(node_id))
        self.generations[node_id] = reply.generation
        return reply.generation, list(reply.assignments)

    def beat(self, *node_ids: str) -> None:
        for node_id in node_ids:
            self.controller.heartbeat(node_id, self.generations[node_id], self.client.report(node_id))

    @contextlib.asynccontextmanager
    async def beating(self, *node_ids: str, every: float = 0.1):
        """These nodes heartbeat every `every` seconds while the block runs (the others fall silent)."""

        async def beat_forever() -> None:
            while True:
                self.beat(*node_ids)
                await asyncio.sleep(every)

        beater = asyncio.create_task(beat_forever())
        try:
            yield
        finally:
            beater.cancel()

    def instance(self, instance_id: str):
        return self.controller.instances[instance_id]


async def running_example(h: Harness, nodes=("node-a", "node-b"), accelerators=4, **policy):
    await h.start()
    for node in nodes:
        await h.register(node, accelerators=accelerators)
    h.controller.apply_deployment(example_deployment(**policy))
    await async_wait_for(lambda: len(h.client.starts()) == 3, timeout=5, what="3 StartEngine calls")
    for node in nodes:
        h.client.set_health(node)
    h.beat(*nodes)
    await async_wait_for(
        lambda: all(i.state == controller_pb2.INSTANCE_STATE_READY for i in h.controller.instances.values()), timeout=5
    )


async def scrape(series: FleetSeries) -> dict[tuple, float]:
    text = b"".join([piece async for piece in series.render()]).decode()
    samples = {}
    for family in text_string_to_metric_families(text):  # parses only well-formed exposition text
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


NODES = ("node-a", "node-b")


async def _lose_the_store(h: Harness) -> dict[tuple[str, str], tuple[int, int]]:
    """Stop the controller, move its database away, start it on an empty one; the fake nodes
    keep their engines. Returns (node, engine) -> (pid, generation) of what they run."""
    running = {(n, e.engine_id): (e.pid, e.spec.generation) for n, es in h.client.engines.items() for e in es.values()}
    await h.stop()
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(h.db + suffix):
            os.rename(h.db + suffix, h.db + suffix + ".lost")
    h.client.calls.clear()
    await h.start()
    return running


async def all_ready(h: Harness, nodes: tuple[str, ...], count: int) -> None:
    await async_wait_for(lambda: len(h.client.starts()) >= count, timeout=5, what=f"{count} StartEngine calls")
    for node in nodes:
        h.client.set_health(node)
    h.beat(*nodes)
    await async_wait_for(
        lambda: all(i.state == C.INSTANCE_STATE_READY for i in h.controller.instances.values()), timeout=5
    )


def listed(h: Harness) -> set[str]:
    return {e.instance_id for e in h.controller.list_endpoints()}


def runtime(node_id: str, state: int = NODE_READY, generation: int = 1) -> NodeRuntime:
    return NodeRuntime(node_info(node_id), generation, state, "test", last_seen=0.0)


def made_up(node_id: str, n: int, start: int = 0) -> list[types_pb2.Engine]:
    """`n` running engines no deployment describes, as a node would report them (zz{start}-0 onwards)."""
    T = types_pb2
    return [
        T.Engine(
            engine_id=f"zz{i}-0/rank0",
            node_id=node_id,
            state=T.ENGINE_STATE_RUNNING,
            spec=T.EngineSpec(instance_id=f"zz{i}-0", dp_rank=0, role=T.ROLE_UNION, generation=1, port=30000),
        )
        for i in range(start, start + n)
    ]
