from __future__ import annotations

import asyncio
import contextlib
import os

import grpc
import pytest

from controller.api.controllers import SingleController
from controller.api.servicer import ControllerServicer
from controller.config import ControllerConfig
from controller.core import Controller
from controller.store.sqlite import SqliteStore
from motor.contract.deployment_file import deployment_from_dict, load_deployment
from motor.service.grpc_server import MotorServer, service_name
from motor.v1 import controller_pb2, controller_pb2_grpc
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


@pytest.fixture
async def harness(tmp_path):
    h = Harness(tmp_path)
    yield h
    await h.stop()


@pytest.fixture
async def served(harness):
    """The harness's controller behind a real gRPC server; yields a stub on a real channel."""
    await harness.start()
    server = MotorServer("127.0.0.1:0")
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        ControllerServicer(SingleController(harness.controller)),
        service_name(controller_pb2, "ControllerService"),
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield controller_pb2_grpc.ControllerServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=0)


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
