"""Client load through the router while faults happen: the router alone against the router kept
by Motor (motor-router-sync), side by side in one run.

Each (fault, mode) gets a fresh `motorctl up` cluster (LocalCluster: a controller, two node
managers with two accelerators each, three simulated union engines, the real vllm-router with `--policy round_robin` and
its health checks at their defaults). Mode `static`: the router's workers are set once from
ListEndpoints and the sync is stopped (a router in front of Motor without Motor's help). Mode
`motor`: motor-router-sync keeps them. Open-loop load (--rate requests/s, each on its own
thread, 30 s client timeout), then the fault on one engine, then --after seconds of load.

Faults: sigkill (the engine server), sigstop (a hang of the whole server), hang_inference
(completions hang while /health stays 200: the simulated engine's fault knob, skipped when the
engine has no such knob), scale_down (3 -> 2 instances), host_loss (a node manager and its
engines SIGKILLed together).

Printed per row: requests failed, requests that waited over 5 s, the time from the fault to the
last request sent that stalled (over 1 s) or failed (after it, the faulty engine got no new
request), and completions/s in the 5 s before the fault and from 3 s after it on.

    .venv/bin/python bench/router_failover.py [--rate 40] [--after 12] [--faults sigstop,sigkill]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc  # noqa: E402
from motorctl.up import LocalCluster  # noqa: E402

FAULTS = ("sigkill", "sigstop", "hang_inference", "scale_down", "host_loss")
STALLED, SLOW = 1.0, 5.0


def deployment(count: int) -> C.Deployment:
    return deployment_from_dict(
        {
            "name": "bench",
            "model": "sim-tiny",
            "instance_groups": [{"name": "union", "role": "union", "count": count, "accelerators_per_engine": 1}],
            "engine_config": {
                "motor_engine_union_config": {
                    "engine_type": "sim",
                    "engine_args": {"model": "sim-tiny", "latency_ms": 20},
                    # Probes every 0.5 s: a hang that only inference shows (/health still 200) is
                    # seen after two failed probes (each round samples utilization for 0.5 s). MindIE's
                    # defaults (off; 5 s apart, 3 s windows) would take half a minute.
                    "health_check_config": {
                        "enable_virtual_inference": True,
                        "probe_interval": 0.5,
                        "busy_probe_interval": 0.5,
                        "probe_timeout": 0.5,
                        "max_failure_count": 2,
                        "utilization_window": 0.5,
                        "utilization_sample_period": 0.1,
                    },
                }
            },
        }
    )


def post(url: str, body: dict | None, timeout: float, method: str = "POST") -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


class Load:
    """Open-loop completions: one request every 1/rate s, each on its own thread."""

    def __init__(self, url: str, rate: float):
        self.url, self.period = url, 1.0 / rate
        self.results: list[tuple[float, int, float]] = []  # (sent, status, answered)
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            thread = threading.Thread(target=self.one, daemon=True)
            thread.start()
            self.threads.append(thread)
            next_at += self.period
            time.sleep(max(0.0, next_at - time.monotonic()))

    def one(self) -> None:
        sent = time.monotonic()
        status, _ = post(self.url + "/v1/completions", {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}, 30)
        self.results.append((sent, status, time.monotonic()))


class Bench:
    def __init__(self, args, fault: str, mode: str, base_port: int):
        self.args, self.fault, self.mode = args, fault, mode
        self.cluster = LocalCluster(
            tempfile.mkdtemp(prefix=f"router-{fault}-{mode}-"),
            nodes=2,
            heartbeat_interval=1.0,
            accelerators_per_node=2,
            engine_port_base=base_port,
            router_port=0,
            metrics_port=0,
        )

    def stub(self, channel):
        return controller_pb2_grpc.ControllerServiceStub(channel)

    def endpoints(self) -> list[C.Endpoint]:
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            return list(self.stub(channel).ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints)

    def workers(self) -> set[str]:
        status, text = post(self.cluster.router_url + "/list_workers", None, 5, method="GET")
        return set(json.loads(text)["urls"]) if status == 200 else set()

    def apply(self, count: int) -> None:
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            self.stub(channel).ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(count)), timeout=30)

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.2)

    def engine_process(self, engine: C.Endpoint) -> tuple[str, int]:
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            instances = self.stub(channel).ListInstances(C.ListInstancesRequest(), timeout=5).instances
        node_id = next(e.node_id for i in instances for e in i.engines if e.engine_id == engine.engine_id)
        with grpc.insecure_channel(f"127.0.0.1:{self.cluster.node_ports[node_id]}") as channel:
            node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            return node_id, node.GetEngine(
                node_manager_pb2.GetEngineRequest(engine_id=engine.engine_id), timeout=5
            ).engine.pid

    def run(self) -> dict:
        cluster = self.cluster
        cluster.start(timeout=60)
        try:
            self.apply(3)
            self.wait(
                lambda: len(self.endpoints()) == 3 and self.workers() == {e.url for e in self.endpoints()},
                90,
                "three engines routed",
            )
            victim = self.endpoints()[0]
            if self.fault == "hang_inference":
                status, text = post(victim.url + "/sim/faults", None, 5, method="GET")
                if status != 200 or "hang_inference" not in json.loads(text):
                    return {"skipped": "no hang_inference fault"}
            if self.mode == "static":
                sync = cluster.process("router-sync").process
                os.killpg(sync.pid, signal.SIGTERM)
                sync.wait(10)
            load = Load(cluster.router_url, self.args.rate)
            sender = threading.Thread(target=load.run, daemon=True)
            sender.start()
            time.sleep(self.args.before)
            node_id, pid = self.engine_process(victim)
            fault_at = time.monotonic()
            self.inject(victim, node_id, pid)
            time.sleep(self.args.after)
            load.stopping.set()
            sender.join()
            if self.fault == "sigstop":
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # killed by its node manager meanwhile
            for thread in load.threads:
                thread.join(timeout=35)
            return self.figures(load.results, fault_at)
        finally:
            cluster.stop()

    def inject(self, victim: C.Endpoint, node_id: str, pid: int) -> None:
        if self.fault == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif self.fault == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        elif self.fault == "hang_inference":
            post(victim.url + "/sim/faults", {"hang_inference": True}, 5)
        elif self.fault == "scale_down":
            self.apply(2)
        elif self.fault == "host_loss":
            pids = [engine_pid for owner, engine_pid in map(self.engine_process, self.endpoints()) if owner == node_id]
            os.killpg(self.cluster.process(node_id).process.pid, signal.SIGKILL)
            for engine_pid in pids:
                os.kill(engine_pid, signal.SIGKILL)

    def figures(self, results, fault_at: float) -> dict:
        bad = [
            sent - fault_at
            for sent, status, answered in results
            if sent >= fault_at and (status != 200 or answered - sent > STALLED)
        ]
        before = [r for r in results if fault_at - self.args.before + 0.5 <= r[2] < fault_at and r[1] == 200]
        window = (fault_at + 3, fault_at + self.args.after)
        after = [r for r in results if window[0] <= r[2] < window[1] and r[1] == 200]
        return {
            "requests": len(results),
            "failed": sum(1 for r in results if r[1] != 200),
            "over_5s": sum(1 for r in results if r[2] - r[0] > SLOW),
            "last_hit_s": max(bad) if bad else 0.0,
            "rate_before": len(before) / (self.args.before - 0.5),
            "rate_after": len(after) / (window[1] - window[0]),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (default 40)")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before the fault (default 5)")
    parser.add_argument("--after", type=float, default=12.0, help="seconds of load after the fault (default 12)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"--faults: unknown {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    print(
        f"{'fault':<15} {'mode':<7} {'requests':>8} {'failed':>7} {'>5s':>5} {'last hit':>9} {'rate before':>12} "
        f"{'rate after':>11}"
    )
    base = 40000
    for fault in faults:
        for mode in ("static", "motor"):
            base += 1000
            row = Bench(args, fault, mode, base).run()
            if "skipped" in row:
                print(f"{fault:<15} {mode:<7} skipped: {row['skipped']}", flush=True)
                continue
            print(
                f"{fault:<15} {mode:<7} {row['requests']:>8} {row['failed']:>7} {row['over_5s']:>5} "
                f"{row['last_hit_s']:>8.2f}s {row['rate_before']:>10.1f}/s {row['rate_after']:>9.1f}/s",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
