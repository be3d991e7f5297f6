"""The node manager's tests' parts: engine specs and sim configs, a node manager in process or as a
process, a fake controller, the engines a state dir holds."""

from __future__ import annotations

import glob
import itertools
import json
import os
import subprocess
import sys

from motor import processes
from motor.errors import FailedPrecondition
from motor.service.grpc_server import MotorServer, TlsFiles, aio_channel, service_name
from motor.v1 import controller_pb2, controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc, types_pb2
from node_manager.server import NodeManagerServer
from tests.support import async_wait_for
from tests.support.node_manager_fakes import ScriptedController, link  # noqa: F401 (fixtures)

ENGINE_SERVER = os.path.join(os.path.dirname(sys.executable), "engine_server")


# Each node manager of the run gets its own slice of ports for its engines.
_port_slices = itertools.count(0)


def sim_config(role: str = "prefill", probe_interval: float = 0.3, max_failure_count: int = 2, **engine_args) -> str:
    """A user_config JSON for the simulated engine with fast probing (short intervals for tests)."""
    section = {
        "engine_type": "sim",
        "engine_args": {"model": "sim-tiny", **engine_args},
        "health_check_config": {
            "enable_virtual_inference": True,
            "probe_interval": probe_interval,
            "busy_probe_interval": probe_interval * 4,
            "utilization_window": 0.1,
            "utilization_sample_period": 0.05,
            "probe_timeout": 1.0,
            "max_failure_count": max_failure_count,
        },
        "drain_timeout": 2.0,
    }
    return json.dumps({f"motor_engine_{role}_config": section})


def spec(
    instance_id: str = "prefill-0",
    dp_rank: int = 0,
    role: int = types_pb2.ROLE_PREFILL,
    config_json: str | None = None,
    **fields,
) -> types_pb2.EngineSpec:
    if config_json is None and "config_path" not in fields:
        config_json = sim_config()
    return types_pb2.EngineSpec(
        instance_id=instance_id, dp_rank=dp_rank, role=role, config_json=config_json or "", **fields
    )


def tokens_in(state_dir: str) -> list[str]:
    tokens = []
    for path in glob.glob(os.path.join(state_dir, "engines", "*", "record.json")):
        try:
            with open(path, encoding="utf-8") as handle:
                tokens.append(json.load(handle)["token"])
        except (OSError, ValueError, KeyError):
            pass
    return tokens


def kill_engines_of(state_dir: str) -> None:
    for token in tokens_in(state_dir):
        processes.kill_tree(processes.TreeId(0, 0, token))


class Node:
    """One in-process node manager and a client stub to it."""

    def __init__(self, server: NodeManagerServer, tls: TlsFiles | None = None):
        self.server = server
        self.manager = server.manager
        self.channel = aio_channel(f"127.0.0.1:{server.port}", tls)
        self.stub = node_manager_pb2_grpc.NodeManagerServiceStub(self.channel)

    async def start(self, **kwargs) -> types_pb2.Engine:
        reply = await self.stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec(**kwargs)))
        return reply.engine

    async def get(self, engine_id: str) -> types_pb2.Engine:
        return (await self.stub.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=engine_id))).engine

    async def stop(self, engine_id: str, **kwargs) -> types_pb2.Engine:
        reply = await self.stub.StopEngine(node_manager_pb2.StopEngineRequest(engine_id=engine_id, **kwargs))
        return reply.engine

    async def wait_state(self, engine_id: str, state: int, timeout: float = 30.0) -> types_pb2.Engine:
        async def reached():
            engine = await self.get(engine_id)
            return engine if engine.state == state else None

        return await async_wait_for(
            reached, timeout=timeout, what=f"{engine_id} in {types_pb2.EngineState.Name(state)}"
        )


async def serve_controller(servicer, address: str = "127.0.0.1:0") -> tuple[MotorServer, str]:
    """`servicer` served as the ControllerService at `address` (a free port by default): the
    started server and the address it listens at."""
    server = MotorServer(address)
    server.add(
        controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        servicer,
        service_name(controller_pb2, "ControllerService"),
    )
    port = await server.start()
    return server, f"127.0.0.1:{port}"


class FakeController(controller_pb2_grpc.ControllerServiceServicer):
    """Records RegisterNode / Heartbeat / ReportEngineEvent; assignments and refusals are settable."""

    def __init__(self):
        self.registrations: list[controller_pb2.RegisterNodeRequest] = []
        self.heartbeats: list[controller_pb2.HeartbeatRequest] = []  # unary, or a streamed delta made whole
        self.streamed: list[controller_pb2.HeartbeatRequest] = []
        self.reports: list[controller_pb2.ReportEngineEventRequest] = []
        self.assignments: list[tuple[str, int]] | None = None  # None: assign whatever the node runs
        self.refuse_heartbeats = 0  # the next N heartbeats get FAILED_PRECONDITION
        self.refuse_registrations = ""  # while set: registrations get FAILED_PRECONDITION with this message
        self.replaced: types_pb2.NodeManagerProcess | None = None  # answered as the process taken over from
        self.generation = 0
        self.address = ""
        self.epoch = 0  # controller_epoch in every reply
        self.generation_limit = 0  # generation_limit in every reply (0: none announced)
        self.keep_unassigned = False

    async def RegisterNode(self, request, context):
        self.registrations.append(request)
        if self.refuse_registrations:
            raise FailedPrecondition(self.refuse_registrations)
        self.generation += 1
        assignments = self.assignments
        if assignments is None:
            assignments = [(e.engine_id, e.spec.generation) for e in request.engines]
        reply = controller_pb2.RegisterNodeResponse(
            generation=self.generation,
            replaced=self.replaced,
            controller_epoch=self.epoch,
            generation_limit=self.generation_limit,
            keep_unassigned=self.keep_unassigned,
        )
        for engine_id, generation in assignments:
            reply.assignments.add(engine_id=engine_id, generation=generation)
        return reply

    async def Heartbeat(self, request, context):
        if self.refuse_heartbeats:
            self.refuse_heartbeats -= 1
            raise FailedPrecondition(f"generation {request.generation} is stale: register again")
        self.heartbeats.append(request)
        return controller_pb2.HeartbeatResponse(controller_epoch=self.epoch, generation_limit=self.generation_limit)

    async def StreamHeartbeats(self, request_iterator, context):
        # Deltas applied as the controller applies them: `heartbeats` records the full list each
        # beat stands for, `streamed` what was sent.
        held: dict[str, types_pb2.Engine] = {}
        async for message in request_iterator:
            beat = message.heartbeat
            self.streamed.append(beat)
            if not beat.delta:
                held = {}
            for engine_id in beat.removed_engine_ids:
                held.pop(engine_id, None)
            held.update((e.engine_id, e) for e in beat.engines)
            full = controller_pb2.HeartbeatRequest(
                node_id=beat.node_id, generation=beat.generation, engines=[held[k] for k in sorted(held)]
            )
            reply = await self.Heartbeat(full, context)
            reply.sequence = beat.sequence
            yield controller_pb2.StreamHeartbeatsResponse(heartbeat=reply)

    async def ReportEngineEvent(self, request, context):
        self.reports.append(request)
        return controller_pb2.ReportEngineEventResponse()


def alive(pid: int) -> bool:
    return processes.same_process(pid, None)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node_manager_process(tmp_path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "node_manager.cli",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "node"),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
