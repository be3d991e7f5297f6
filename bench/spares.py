"""Warm spares against none: serving capacity back after a SIGKILL, side by side in one run.

For each setting (`spares: 1`, then `spares: 0`) a fresh `motorctl up` cluster (LocalCluster: a
controller, two node managers with four accelerators each, the real vllm-router kept by
motor-router-sync) runs two serving simulated union engines whose model takes --load-s seconds
to load (engine_args.load_s), under open-loop client load through the router (--rate requests/s,
each on its own thread). Then --kills times: SIGKILL the engine server of the first serving instance
and measure the time until the router has the full number of serving workers again (the killed
one gone, two workers listed), and the requests that failed or waited over 1 s; wait until every
instance is READY again (the new spare loaded, or the restarted engine) before the next kill.

Printed: one row per kill, then per setting the median and p99 (nearest rank) of the recovery
times and the failed requests over the whole run. The restart policy is set so that each kill is
a fresh failure (reset_after 1 s, a large crash-loop budget): with the defaults, an instance
killed again within 10 min would also wait its backoff (1 s, 2 s ...), and the fifth kill in
10 min would leave it FAILED.

    .venv/bin/python bench/spares.py [--load-s 15] [--kills 5] [--rate 40] [--engine vllm]

`--engine vllm`: the real vLLM CPU engine with the tests' tiny model (motorctl/tiny_model.py)
instead of the simulated one; its load time is vLLM's own (about 20 s here), --load-s is unused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.router_failover import Load, post  # noqa: E402
from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402
from motorctl.tiny_model import LEAN_CPU_ARGS, ensure_tiny_model  # noqa: E402
from tests.support.vllm_engines import offline_vllm_env  # noqa: E402

SERVING = 2
STALLED = 1.0


def engine_section(args) -> dict:
    """The union engines' user_config: the simulated engine loading for --load-s, or the real
    vLLM CPU engine with the tests' tiny model, serving it under the name the load asks for."""
    if args.engine == "sim":
        return {"engine_type": "sim", "engine_args": {"model": "sim-tiny", "latency_ms": 20, "load_s": args.load_s}}
    return {
        "engine_type": "vllm",
        "engine_args": {"model": args.model_path, **LEAN_CPU_ARGS, "served_model_name": "sim-tiny"},
        "health_check_config": {"enable_virtual_inference": True},
    }


def deployment(spares: int, args) -> C.Deployment:
    group = {"name": "union", "role": "union", "count": SERVING, "spares": spares, "accelerators_per_engine": 1}
    return deployment_from_dict(
        {
            "name": "bench",
            "model": "sim-tiny",
            "instance_groups": [group],
            "engine_config": {"motor_engine_union_config": engine_section(args)},
            # Each kill is a fresh failure (no backoff, no crash-loop budget spent): what is
            # measured is the model's load against a spare, not the restart policy.
            "restart_policy": {"reset_after": "1s", "max_failures": 1000},
        }
    )


def nearest_rank(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


class Run:
    def __init__(self, args, spares: int, base_port: int):
        self.args, self.spares = args, spares
        self.cluster = LocalCluster(
            tempfile.mkdtemp(prefix=f"spares-{spares}-"),
            nodes=2,
            heartbeat_interval=1.0,
            accelerators_per_node=4,
            engine_port_base=base_port,
            router_port=0,
            metrics_port=0,
            extra_node_args=["--model-root", os.path.dirname(args.model_path)] if args.engine == "vllm" else [],
        )
        # vLLM's start: about 20 s alone on 2 cores, minutes beside other vLLM processes.
        self.settle_timeout = args.load_s + 60 if args.engine == "sim" else 900

    def instances(self) -> list[C.Instance]:
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            return list(stub.ListInstances(C.ListInstancesRequest(), timeout=5).instances)

    def workers(self) -> set[str]:
        status, text = post(self.cluster.router_url + "/list_workers", None, 5, method="GET")
        return set(json.loads(text)["urls"]) if status == 200 else set()

    def settled(self) -> bool:
        """Every instance READY and the router's workers exactly the serving ones."""
        listed = self.instances()
        serving = {f"http://{e.host}:{e.port}" for i in listed if not i.spare for e in i.engines}
        return (
            len(listed) == SERVING + self.spares
            and all(i.state == C.INSTANCE_STATE_READY for i in listed)
            and self.workers() == serving
        )

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.2)

    def pid(self, engine: C.InstanceEngine) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{self.cluster.node_ports[engine.node_id]}") as channel:
            node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            return node.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=engine.engine_id), timeout=5).engine.pid

    def recovery(self, victim_url: str, killed: float) -> float:
        """Seconds from the kill until the router lists SERVING workers again, the killed one gone first."""
        gone = False
        while time.monotonic() - killed < self.settle_timeout:
            workers = self.workers()
            gone = gone or victim_url not in workers
            if gone and len(workers) == SERVING:
                return time.monotonic() - killed
            time.sleep(0.01)
        raise TimeoutError(f"serving capacity not back within {self.settle_timeout:g} s")

    def run(self) -> list[dict]:
        cluster, args = self.cluster, self.args
        cluster.start(timeout=60)
        rows = []
        try:
            with grpc.insecure_channel(cluster.controller_address) as channel:
                stub = controller_pb2_grpc.ControllerServiceStub(channel)
                stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(self.spares, args)), timeout=30)
            self.wait(self.settled, self.settle_timeout, "every instance READY and routed")
            load = Load(cluster.router_url, args.rate)
            sender = threading.Thread(target=load.run, daemon=True)
            sender.start()
            time.sleep(3)
            for kill in range(args.kills):
                victim = next(i for i in self.instances() if not i.spare)
                engine = victim.engines[0]
                pid = self.pid(engine)
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                back = self.recovery(f"http://{engine.host}:{engine.port}", killed)
                print(f"spares={self.spares} kill {kill + 1}: serving capacity back in {back:.3f}s", flush=True)
                self.wait(self.settled, self.settle_timeout, "every instance READY again")
                settled = time.monotonic()
                hit = [r for r in load.results if killed <= r[0] < settled]
                rows.append(
                    {
                        "kill": kill + 1,
                        "victim": victim.instance_id,
                        "back_s": back,
                        "requests": len(hit),
                        "failed": sum(1 for r in hit if r[1] != 200),
                        "stalled": sum(1 for r in hit if r[1] == 200 and r[2] - r[0] > STALLED),
                    }
                )
                print(
                    f"spares={self.spares} kill {kill + 1}: {victim.instance_id} SIGKILLed; every instance READY again "
                    f"after {settled - killed:.1f}s; {rows[-1]['failed']} of {len(hit)} requests failed, "
                    f"{rows[-1]['stalled']} over {STALLED:g}s",
                    flush=True,
                )
                time.sleep(2)
            load.stopping.set()
            sender.join()
            for thread in load.threads:
                thread.join(timeout=35)
            return rows
        finally:
            cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-s", type=float, default=15.0, help="the simulated model's load time (default 15)")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs per setting (default 5)")
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (default 40)")
    parser.add_argument(
        "--engine", choices=("sim", "vllm"), default="sim", help="sim (default) or the real vLLM CPU engine"
    )
    args = parser.parse_args()
    if args.engine == "vllm":  # the tests' tiny random-weight model, built once; vLLM offline
        cache = tempfile.mkdtemp(prefix="spares-vllm-")
        args.model_path = ensure_tiny_model(os.path.join(tempfile.gettempdir(), "motor-bench-tiny-llama"))
        os.environ.update(offline_vllm_env(cache))
    if args.kills < 1:
        parser.error("--kills: at least 1")
    results = {}
    for index, spares in enumerate((1, 0)):
        results[spares] = Run(args, spares, 42000 + 2000 * index).run()
    print(f"\nload average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'setting':<10} {'kills':>5} {'median back':>12} {'p99 back':>9} {'failed':>7} {'requests':>9}")
    for spares, rows in results.items():
        backs = [r["back_s"] for r in rows]
        print(
            f"spares: {spares:<2} {len(rows):>5} {statistics.median(backs):>11.3f}s {nearest_rank(backs, 0.99):>8.3f}s "
            f"{sum(r['failed'] for r in rows):>7} {sum(r['requests'] for r in rows):>9}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
