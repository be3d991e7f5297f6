"""How many nodes can one controller process keep up with?

Starts a real `motor-controller` process, then simulates node managers as lightweight asyncio
clients in this process (not processes): each registers, gets one 8-rank instance placed on it
(StartEngine is answered by one in-process NodeManagerService that stands for every simulated
node, routed by the engine's host), and heartbeats at 1 Hz carrying its 8 engines, RUNNING and
NORMAL. The fleet grows step by step; at each step the script measures, over a window:

  - Heartbeat latency as the node sees it (RPC round trip: p50, p99), and the rate achieved
    against the rate asked for (nodes x 1/s);
  - the controller's own handling time (its motor_controller_heartbeat_ingest_seconds histogram);
  - the controller process's CPU (percent of one core) and resident memory.

A step is sustained when the client-side p99 is under --p99-ms, at least 95% of the expected
heartbeats were answered and none failed. Every step runs (unless the rate collapses below half);
the script prints one line per step and the largest fleet sustained.
Both sides share this machine's cores: client-side latency includes the simulated fleet's own
queueing, so it is an upper bound on what a node would see from a controller on its own host.

    .venv/bin/python bench/controller_scale.py                       # 250 .. 4000 nodes
    .venv/bin/python bench/controller_scale.py --steps 100,200 --window 10
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from motor.grpc_server import MotorServer, aio_channel, service_name  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc  # noqa: E402
from motor.v1 import types_pb2 as T  # noqa: E402

ENGINES_PER_NODE = 8


class SimNode:
    def __init__(self, index: int, address: str):
        self.node_id = f"sim-{index:05d}"
        self.host = f"10.{index // 65536}.{(index // 256) % 256}.{index % 256}"
        self.info = C.NodeInfo(
            node_id=self.node_id, address=address, host=self.host, accelerator_ids=list(range(ENGINES_PER_NODE)),
            accelerator_type="sim", port_range_start=20000, port_range_end=29999,
        )
        self.generation = 0
        self.engines: dict[str, T.Engine] = {}
        self._request: C.HeartbeatRequest | None = None

    def heartbeat_request(self) -> C.HeartbeatRequest:
        if self._request is None:
            self._request = C.HeartbeatRequest(
                node_id=self.node_id, generation=self.generation, engines=[self.engines[k] for k in sorted(self.engines)]
            )
        return self._request

    def add_engine(self, engine: T.Engine) -> None:
        self.engines[engine.engine_id] = engine
        self._request = None


class FleetNodeManager(node_manager_pb2_grpc.NodeManagerServiceServicer):
    """One NodeManagerService standing for every simulated node (routed by spec.host)."""

    def __init__(self):
        self.by_host: dict[str, SimNode] = {}
        self.starts = 0
        self._ports = 20000

    async def StartEngine(self, request, context):
        node = self.by_host[request.spec.host]
        spec = T.EngineSpec()
        spec.CopyFrom(request.spec)
        self._ports += 2
        spec.port, spec.mgmt_port = self._ports, self._ports + 1
        engine = T.Engine(
            engine_id=f"{spec.instance_id}/rank{spec.dp_rank}", spec=spec, state=T.ENGINE_STATE_RUNNING,
            health=T.HEALTH_STATUS_NORMAL, health_reason="sim", pid=100000 + self.starts, node_id=node.node_id,
        )
        node.add_engine(engine)
        self.starts += 1
        return node_manager_pb2.StartEngineResponse(engine=engine)

    async def StopEngine(self, request, context):
        return node_manager_pb2.StopEngineResponse()

    async def ListEngines(self, request, context):
        return node_manager_pb2.ListEnginesResponse()


def deployment(instances: int) -> C.Deployment:
    d = C.Deployment(name="scale", model="sim-tiny")
    d.engine_config.update({"motor_engine_union_config": {"engine_type": "sim"}})
    d.instance_groups.add(name="u", role=T.ROLE_UNION, count=instances, data_parallel_size=ENGINES_PER_NODE,
                          accelerators_per_engine=1)
    return d


def scrape_histogram(metrics_port: int) -> dict[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    buckets = {}
    for le, value in re.findall(r'motor_controller_heartbeat_ingest_seconds_bucket\{le="([^"]+)"\} (\S+)', text):
        buckets[float("inf") if le == "+Inf" else float(le)] = float(value)
    return buckets


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    deltas = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = deltas[-1][1] if deltas else 0
    if total <= 0:
        return float("nan")
    for le, count in deltas:
        if count >= q * total:
            return le
    return float("inf")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args) -> int:
    started_at = time.monotonic()
    work = tempfile.mkdtemp(prefix="motor-scale-")
    fleet_nm = FleetNodeManager()
    nm_server = MotorServer("127.0.0.1:0")
    nm_server.add(node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server, fleet_nm,
                  service_name(node_manager_pb2, "NodeManagerService"))
    nm_port = await nm_server.start()
    nm_address = f"127.0.0.1:{nm_port}"

    port, metrics_port = free_port(), free_port()
    command = [
        os.path.join(os.path.dirname(sys.executable), "motor-controller"), "--listen", f"127.0.0.1:{port}",
        "--db", os.path.join(work, "controller.db"), "--heartbeat-interval", "1", "--node-grace", str(args.node_grace),
        "--metrics-port", str(metrics_port), "--log-level", "WARNING",
    ]
    print("controller:", " ".join(command[1:]))
    log = open(os.path.join(work, "controller.log"), "wb")
    controller = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc = psutil.Process(controller.pid)
    channels = [aio_channel(f"127.0.0.1:{port}") for _ in range(args.channels)]
    stubs = [controller_pb2_grpc.ControllerServiceStub(c) for c in channels]
    await channels[0].channel_ready()
    for _ in range(100):
        try:
            await stubs[0].ListNodes(C.ListNodesRequest(), timeout=2)
            break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.1)

    nodes: list[SimNode] = []
    latencies: list[float] = []
    answered = {"ok": 0, "errors": 0}
    measuring = False
    stopping = False

    async def heartbeat_loop(node: SimNode, stub) -> None:
        await asyncio.sleep(random.random())
        next_tick = time.monotonic()
        while not stopping:
            next_tick += 1.0
            started = time.perf_counter()
            try:
                await stub.Heartbeat(node.heartbeat_request(), timeout=10)
                if measuring:
                    latencies.append(time.perf_counter() - started)
                    answered["ok"] += 1
            except grpc.aio.AioRpcError as exc:
                if measuring:
                    answered["errors"] += 1
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    reply = await stub.RegisterNode(C.RegisterNodeRequest(node=node.info, engines=list(node.engines.values())), timeout=30)
                    node.generation = reply.generation
                    node._request = None
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))

    tasks: list[asyncio.Task] = []
    rows = []
    best = 0
    try:
        for size in args.steps:
            try:
                # Grow the fleet: register, place one 8-rank instance per node, wait for every start.
                began = time.monotonic()
                new = [SimNode(i, nm_address) for i in range(len(nodes), size)]
                for node in new:
                    fleet_nm.by_host[node.host] = node
                for chunk in range(0, len(new), 100):
                    replies = await asyncio.gather(*(
                        stubs[i % len(stubs)].RegisterNode(C.RegisterNodeRequest(node=n.info), timeout=60)
                        for i, n in enumerate(new[chunk:chunk + 100])
                    ))
                    for node, reply in zip(new[chunk:chunk + 100], replies):
                        node.generation = reply.generation
                nodes += new
                await stubs[0].ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(size)), timeout=120)
                for node in new:
                    tasks.append(asyncio.create_task(heartbeat_loop(node, stubs[int(node.node_id[4:]) % len(stubs)])))
                deadline = time.monotonic() + 300
                deadline = time.monotonic() + args.setup_timeout
                while fleet_nm.starts < size * ENGINES_PER_NODE and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                setup = time.monotonic() - began
                # The simulated fleet's own objects are long-lived: keep the collector from
                # pausing this process (its pauses would show up as heartbeat latency).
                gc.collect()
                gc.freeze()
                await asyncio.sleep(args.warmup)
                # Measure.
                latencies.clear()
                answered.update(ok=0, errors=0)
                before = await asyncio.to_thread(scrape_histogram, metrics_port)
                proc.cpu_percent(None)
                measuring = True
                await asyncio.sleep(args.window)
                measuring = False
                cpu = proc.cpu_percent(None)
                rss = proc.memory_info().rss / 2**20
                after = await asyncio.to_thread(scrape_histogram, metrics_port)
                listed = await stubs[0].ListNodes(C.ListNodesRequest(), timeout=60)
                ready = sum(1 for n in listed.nodes if n.state == C.NODE_STATE_READY)
                rate = answered["ok"] / args.window
                p50, p99 = quantile(latencies, 0.5) * 1e3, quantile(latencies, 0.99) * 1e3
                server_p99 = histogram_quantile(before, after, 0.99) * 1e3
                ok = p99 < args.p99_ms and rate >= 0.95 * size and answered["errors"] == 0
                rows.append((size, size * ENGINES_PER_NODE, fleet_nm.starts, setup, rate, size, p50, p99, server_p99, cpu, rss, ready, ok))
                print(
                    f"{size:>6} nodes {size * ENGINES_PER_NODE:>6} engines | setup {setup:5.1f}s | heartbeats {rate:7.1f}/s of {size}/s"
                    f" | client p50 {p50:6.2f} ms p99 {p99:7.2f} ms | controller handling p99 <= {server_p99:g} ms"
                    f" | controller CPU {cpu:5.1f}% RSS {rss:6.1f} MiB | READY {ready}/{size} | load {os.getloadavg()[0]:.1f}"
                    f" | {'sustained' if ok else 'NOT sustained'}",
                    flush=True,
                )
                if ok:
                    best = size
                elif rate < 0.5 * size:
                    break  # collapsed: larger fleets cannot do better
            except grpc.aio.AioRpcError as exc:
                state = "alive" if controller.poll() is None else f"exited with {controller.returncode}"
                print(f"{size:>6} nodes: a controller call failed ({exc.code().name}: {exc.details()}); controller {state}",
                      flush=True)
                break
    finally:
        stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
        os.killpg(controller.pid, signal.SIGTERM)  # before the fleet's server: no call left in flight
        try:
            await asyncio.to_thread(controller.wait, 30)
        except subprocess.TimeoutExpired:
            os.killpg(controller.pid, signal.SIGKILL)
        await nm_server.stop(0)
        log.close()
        if args.keep:
            print(f"controller log and database kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"largest fleet sustained with heartbeat p99 < {args.p99_ms:g} ms: {best} nodes x {ENGINES_PER_NODE} engines "
          f"({best} heartbeats/s carrying {best * ENGINES_PER_NODE} engine statuses); goal 2000 x 8")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (the fleet runs on the same cores)")
    print(f"run time {time.monotonic() - started_at:.0f}s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="250,500,1000,2000,3000,4000", help="fleet sizes to try, in order")
    parser.add_argument("--window", type=float, default=15.0, help="seconds measured per step")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds between a step's set-up and its window")
    parser.add_argument("--p99-ms", type=float, default=50.0, help="heartbeat p99 a sustained step stays under")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels the simulated fleet spreads over")
    parser.add_argument("--setup-timeout", type=float, default=120.0, help="seconds a step may take to start its engines")
    parser.add_argument("--keep", action="store_true", help="keep the controller's log and database")
    parser.add_argument("--node-grace", type=float, default=5.0, help="controller --node-grace")
    args = parser.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
