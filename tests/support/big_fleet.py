"""A big deployment against a real controller process, for tests/controller/test_big_deployment.py
and bench/big_deployment.py: a few simulated nodes with many accelerators each, heartbeating from a
thread (full heartbeats listing no engine: what the controller keeps per node stays small), whose
node manager is one fake gRPC server in a child process (it answers StartEngine at
once with a RUNNING, NORMAL engine, and StopEngine), and the controller's event-loop lag
histogram read from its /metrics.

    python -m tests.support.big_fleet PORT_FILE COUNTS_FILE     # the fake node manager
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc

from motor.ports import free_port
from motor.v1 import controller_pb2 as C
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc
from motor.v1 import types_pb2 as T

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def deployment(instances: int, dp: int, model: str = "sim-tiny") -> C.Deployment:
    """`instances` instances of `dp` ranks; a different `model` replaces every instance, all at once
    (strategy recreate: the fleet has no room for a surge, and the whole replacement is what is measured)."""
    d = C.Deployment(name="big", model=model)
    d.strategy.type = C.UPDATE_STRATEGY_TYPE_RECREATE
    d.engine_config.update({"motor_engine_union_config": {"engine_type": "sim"}})
    d.instance_groups.add(
        name="u", role=T.ROLE_UNION, count=instances, data_parallel_size=dp, accelerators_per_engine=1
    )
    return d


# ------------------------------------------------------------------ the fake node manager (child process)


class _FakeNodeManager(node_manager_pb2_grpc.NodeManagerServiceServicer):
    def __init__(self):
        self.starts = self.stops = 0
        self.port = 20000

    async def StartEngine(self, request, context):
        self.starts += 1
        self.port = 20000 + (self.port - 19998) % 40000
        spec = T.EngineSpec()
        spec.CopyFrom(request.spec)
        spec.port, spec.mgmt_port = self.port, self.port + 1
        engine = T.Engine(
            engine_id=f"{spec.instance_id}/rank{spec.dp_rank}",
            spec=spec,
            state=T.ENGINE_STATE_RUNNING,
            health=T.HEALTH_STATUS_NORMAL,
            pid=1,
        )
        return node_manager_pb2.StartEngineResponse(engine=engine)

    async def StopEngine(self, request, context):
        self.stops += 1
        return node_manager_pb2.StopEngineResponse()

    async def ListEngines(self, request, context):
        return node_manager_pb2.ListEnginesResponse()


async def _serve(port_file: str, counts_file: str) -> None:
    servicer = _FakeNodeManager()
    server = grpc.aio.server()
    node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(port_file + ".tmp", "w") as handle:
        handle.write(str(port))
    os.rename(port_file + ".tmp", port_file)
    while True:
        with open(counts_file + ".tmp", "w") as handle:
            json.dump({"starts": servicer.starts, "stops": servicer.stops}, handle)
        os.rename(counts_file + ".tmp", counts_file)
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------ the test's side


@dataclass
class Beats:
    """What the heartbeating nodes saw."""

    sent: int = 0
    failed: list[str] = field(default_factory=list)
    slowest: float = 0.0


class BigFleet:
    """A controller process, the fake node manager process and `nodes` heartbeating nodes."""

    def __init__(
        self,
        nodes: int = 100,
        accelerators: int = 400,
        heartbeat: float = 0.5,
        grace: float = 2.5,
        store_args: list[str] | None = None,
        work: str | None = None,
    ):
        self.work = work or tempfile.mkdtemp(prefix="motor-big-")
        self.nodes, self.accelerators, self.heartbeat, self.grace = nodes, accelerators, heartbeat, grace
        self.store_args = store_args or ["--db", os.path.join(self.work, "controller.db")]
        self.beats = Beats()
        self.generations: dict[str, int] = {}
        self._stop = threading.Event()
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self.work, f"{name}.log"), "wb")
        self._logs.append(log)
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=REPO)
        self._procs.append(proc)
        return proc

    def start(self) -> None:
        port_file, self.counts_file = os.path.join(self.work, "fake.port"), os.path.join(self.work, "fake.counts")
        self._spawn([sys.executable, "-m", "tests.support.big_fleet", port_file, self.counts_file], "fake-node-manager")
        self.port, self.metrics_port = free_port(), free_port()
        controller = os.path.join(os.path.dirname(sys.executable), "motor-controller")
        self.controller = self._spawn(
            [
                controller,
                "--listen",
                f"127.0.0.1:{self.port}",
                *self.store_args,
                "--heartbeat-interval",
                str(self.heartbeat),
                "--node-grace",
                str(self.grace),
                "--recheck-timeout",
                "1",
                "--metrics-port",
                str(self.metrics_port),
                "--log-level",
                "WARNING",
            ],
            "controller",
        )
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if time.monotonic() > deadline:
                raise TimeoutError("the fake node manager did not start")
            time.sleep(0.05)
        fake_address = f"127.0.0.1:{open(port_file).read()}"
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.max_receive_message_length", 256 << 20)]
        )
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        for n in range(self.nodes):
            info = C.NodeInfo(
                node_id=f"node-{n:04d}",
                address=fake_address,
                host=f"10.1.{n // 250}.{n % 250 + 1}",
                accelerator_ids=list(range(self.accelerators)),
                accelerator_type="sim",
            )
            reply = self.stub.RegisterNode(C.RegisterNodeRequest(node=info), timeout=30)
            self.generations[info.node_id] = reply.generation
        self._beater = threading.Thread(target=self._beat, name="heartbeats", daemon=True)
        self._beater.start()

    def _beat(self) -> None:
        sequence = 0
        while not self._stop.is_set():
            began = time.monotonic()
            sequence += 1
            calls = [
                (
                    node_id,
                    time.monotonic(),
                    self.stub.Heartbeat.future(
                        C.HeartbeatRequest(node_id=node_id, generation=generation, sequence=sequence), timeout=10
                    ),
                )
                for node_id, generation in self.generations.items()
            ]
            for node_id, sent, call in calls:
                self.beats.sent += 1
                try:
                    call.result()
                    self.beats.slowest = max(self.beats.slowest, time.monotonic() - sent)
                except grpc.RpcError as exc:
                    self.beats.failed.append(f"{node_id}: {exc.code().name} {exc.details()}")
            self._stop.wait(max(0.0, self.heartbeat - (time.monotonic() - began)))

    def counts(self) -> dict[str, int]:
        with open(self.counts_file) as handle:
            return json.load(handle)

    def lag_buckets(self, which: str = "lag") -> dict[float, float]:
        """The controller's motor_event_loop_{lag,blocked}_seconds buckets (cumulative counts by upper bound)."""
        return self.buckets(f"motor_event_loop_{which}_seconds")

    def buckets(self, histogram: str, labels: str = "") -> dict[float, float]:
        """A histogram of the controller's (`labels`: ',walk="complete"' as rendered after le)."""
        name = f"{histogram}_bucket"
        # Only that series: the full /metrics renders every instance and engine on the controller's loop.
        url = f"http://127.0.0.1:{self.metrics_port}/metrics?name[]={name}"
        text = urllib.request.urlopen(url, timeout=60).read().decode()
        return {
            float("inf") if le == "+Inf" else float(le): float(value)
            for le, value in re.findall(re.escape(name) + r'\{le="([^"]+)"' + re.escape(labels) + r"\} (\S+)", text)
        }

    def node_reasons(self) -> dict[str, tuple[str, str]]:
        """node id -> (state, reason) as ListNodes shows them."""
        reply = self.stub.ListNodes(C.ListNodesRequest(), timeout=60)
        return {n.info.node_id: (C.NodeState.Name(n.state), n.state_reason) for n in reply.nodes}

    def stop(self) -> None:
        self._stop.set()
        if hasattr(self, "_beater"):
            self._beater.join(15)
        if hasattr(self, "channel"):
            self.channel.close()
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in self._logs:
            log.close()


def lag_stalls(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    """Observations between two scrapes by bucket upper bound (non-cumulative)."""
    bounds = sorted(after)
    out, below = {}, 0.0
    for le in bounds:
        total = after[le] - before.get(le, 0.0)
        out[le] = total - below
        below = total
    return out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(_serve(sys.argv[1], sys.argv[2]))
