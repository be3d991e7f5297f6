"""What clients see through the router while one engine dies, hangs or fails: no request lost?

Each (settings, fault) gets a fresh `motorctl up` cluster (LocalCluster: a controller, two node
managers with two accelerators each, three simulated union engines, the real vllm-router started
with Motor's failover flags (motorctl/router.py) and kept by motor-router-sync). Open-loop load
(--rate requests/s, each on its own thread, 60 s client timeout), then the fault on one engine,
then --after seconds of load; every request's answer is waited for.

Settings (--settings): `seed`, the seed's default health settings (virtual inference on, a probe
every 2 s with a 5 s timeout, 3 failures, 20 s between probes of a busy engine; the rest at their
defaults), and `tuned` (probes every 0.5 s with 0.5 s timeouts, 2 failures: settings a GPU's long
batches do not allow); `default` (Motor's own defaults: virtual inference off) on request.

Faults: sigkill (the engine server), sigstop (the whole server hangs), hang_inference (completions
hang while /health stays 200: the simulated engine's fault), fail_inference (completions answer 500
while /health stays 200); scale_down (3 -> 2 instances) and host_loss (a node manager and its
engines SIGKILLed) on request.

Printed per row: requests sent, failed, retried by the router (the requests the faulty engine
failed back or dropped: vllm_router_retries_total), answered after over 1 s, the longest wait, and
the time from the fault to the last request the router sent to the faulty engine (its
vllm_router_policy_decisions_total, read every 50 ms until the engine leaves the router).

    .venv/bin/python bench/router_failover.py [--rate 40] [--after 12] [--settings seed,tuned]
        [--faults sigkill,sigstop,hang_inference,fail_inference]
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
from motor.contract.user_config import HealthCheckConfig  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402
from motorctl.router import FAILOVER_FLAGS  # noqa: E402

FAULTS = ("sigkill", "sigstop", "hang_inference", "fail_inference", "scale_down", "host_loss")
DEFAULT_FAULTS = FAULTS[:4]
SETTINGS = {
    "seed": {
        "enable_virtual_inference": True,
        "probe_interval": 2.0,
        "probe_timeout": 5.0,
        "max_failure_count": 3,
        "busy_probe_interval": 20.0,
    },
    "tuned": {
        "enable_virtual_inference": True,
        "probe_interval": 0.5,
        "busy_probe_interval": 0.5,
        "probe_timeout": 0.5,
        "max_failure_count": 2,
        "utilization_window": 0.5,
        "utilization_sample_period": 0.1,
    },
    "default": {},  # Motor's own defaults (HealthCheckConfig): virtual inference off
}
STALLED = 1.0


def deployment(count: int, health: dict) -> C.Deployment:
    return deployment_from_dict(
        {
            "name": "bench",
            "model": "sim-tiny",
            "instance_groups": [{"name": "union", "role": "union", "count": count, "accelerators_per_engine": 1}],
            "engine_config": {
                "motor_engine_union_config": {
                    "engine_type": "sim",
                    "engine_args": {"model": "sim-tiny", "latency_ms": 20},
                    "health_check_config": health,
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
        status, _ = post(self.url + "/v1/completions", {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}, 60)
        self.results.append((sent, status, time.monotonic()))


class RouterMetrics:
    """The router's Prometheus counters, and when it last sent a request to one worker."""

    def __init__(self, cluster: LocalCluster):
        argv = list(cluster.process("router").process.args)
        self.url = f"http://127.0.0.1:{argv[argv.index('--prometheus-port') + 1]}/metrics"
        self.router_url = cluster.router_url

    def total(self, name: str, label: str = "") -> float:
        status, text = post(self.url, None, 5, method="GET")
        return sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if status == 200 and line.startswith(name) and label in line
        )

    def follow(self, worker: str, stop: threading.Event, changes: list[float]) -> None:
        """Append the time of each increase of `worker`'s routing decisions until it leaves the
        router's list (a replacement on the same address is another engine) or `stop`."""
        seen = self.total("vllm_router_policy_decisions_total", f'worker="{worker}"')
        while not stop.wait(0.05):
            status, text = post(self.router_url + "/list_workers", None, 5, method="GET")
            if status == 200 and worker not in json.loads(text)["urls"]:
                return
            now, decisions = time.monotonic(), self.total("vllm_router_policy_decisions_total", f'worker="{worker}"')
            if decisions != seen:
                seen = decisions
                changes.append(now)


class Bench:
    def __init__(self, args, settings: str, fault: str, base_port: int):
        self.args, self.settings, self.fault = args, settings, fault
        self.health = SETTINGS[settings]
        self.cluster = LocalCluster(
            tempfile.mkdtemp(prefix=f"router-{settings}-{fault}-"),
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
            self.stub(channel).ApplyDeployment(
                C.ApplyDeploymentRequest(deployment=deployment(count, self.health)), timeout=30
            )

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
                120,
                "three engines routed",
            )
            victim = self.endpoints()[0]
            metrics = RouterMetrics(cluster)
            retries_before = metrics.total("vllm_router_retries_total")
            routed: list[float] = []
            following = threading.Event()
            follower = threading.Thread(target=metrics.follow, args=(victim.url, following, routed), daemon=True)
            follower.start()
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
            for thread in load.threads:
                thread.join(timeout=65)
            following.set()
            follower.join()
            if self.fault == "sigstop":
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # killed by its node manager meanwhile
            return self.figures(
                load.results, fault_at, routed, metrics.total("vllm_router_retries_total") - retries_before
            )
        finally:
            cluster.stop()

    def inject(self, victim: C.Endpoint, node_id: str, pid: int) -> None:
        if self.fault == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif self.fault == "sigstop":
            os.kill(pid, signal.SIGSTOP)
        elif self.fault in ("hang_inference", "fail_inference"):
            status, text = post(victim.url + "/sim/faults", {self.fault: True}, 5)
            if status != 200:
                raise RuntimeError(f"the simulated engine refused the {self.fault} fault: {status} {text}")
        elif self.fault == "scale_down":
            self.apply(2)
        elif self.fault == "host_loss":
            pids = [engine_pid for owner, engine_pid in map(self.engine_process, self.endpoints()) if owner == node_id]
            os.killpg(self.cluster.process(node_id).process.pid, signal.SIGKILL)
            for engine_pid in pids:
                os.kill(engine_pid, signal.SIGKILL)

    def figures(self, results, fault_at: float, routed: list[float], retried: float) -> dict:
        after = [r for r in routed if r >= fault_at]
        return {
            "requests": len(results),
            "failed": sum(1 for r in results if r[1] != 200),
            "retried": int(retried),
            "stalled": sum(1 for r in results if r[2] - r[0] > STALLED),
            "longest_s": max((r[2] - r[0] for r in results), default=0.0),
            "last_routed_s": max(after) - fault_at if after else None,
        }


def describe(settings: dict) -> str:
    health = HealthCheckConfig(**settings)
    return (
        f"virtual inference {'on' if health.enable_virtual_inference else 'off'}, "
        f"a probe every {health.probe_interval:g} s, {health.probe_timeout:g} s timeout, "
        f"{health.max_failure_count} failures, {health.busy_probe_interval:g} s busy interval, "
        f"{health.utilization_window:g} s utilization window, "
        f"stall_timeout {health.stall_timeout:g} s, stall_kill_after {health.stall_kill_after:g} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (default 40)")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before the fault (default 5)")
    parser.add_argument("--after", type=float, default=12.0, help="seconds of load after the fault (default 12)")
    parser.add_argument("--settings", default="seed,tuned", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--faults", default=",".join(DEFAULT_FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    settings = [s for s in args.settings.split(",") if s]
    for flag, chosen, known in (("--faults", faults, FAULTS), ("--settings", settings, tuple(SETTINGS))):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    for name in settings:
        print(f"{name}: {describe(SETTINGS[name])}")
    print(f"router: {' '.join(FAILOVER_FLAGS)}")
    print(
        f"{'settings':<8} {'fault':<15} {'requests':>8} {'failed':>7} {'retried':>8} {'>1s':>5} {'longest':>8} "
        f"{'last routed':>12}"
    )
    base = 40000
    for name in settings:
        for fault in faults:
            base += 1000
            row = Bench(args, name, fault, base).run()
            last = "-" if row["last_routed_s"] is None else f"{row['last_routed_s']:.2f}s"
            print(
                f"{name:<8} {fault:<15} {row['requests']:>8} {row['failed']:>7} {row['retried']:>8} "
                f"{row['stalled']:>5} {row['longest_s']:>7.2f}s {last:>12}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
