"""A spec change of N instances under client load through the router: rolling (the default)
against recreate (every instance replaced at once), side by side in one run.

Each strategy gets a fresh `motorctl up` cluster (LocalCluster: a controller, two node managers,
N simulated union engines behind the real vllm-router kept by motor-router-sync). Open-loop load
(--rate requests/s, each on its own thread, 30 s client timeout) for --before seconds, then the
change (the engines' latency_ms 20 -> 30), until every instance runs the new revision, is READY
and in the router (rolling: and the rollout says COMPLETE), then --after seconds more.

Printed per strategy: the time from the change to that point, requests failed, the served rate
before the change and the lowest served rate (completions answered 200 per second) in any 2 s
window from the change to the end.

    .venv/bin/python bench/rollout.py [--instances 3] [--rate 40] [--before 5] [--after 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from router_failover import Load, post  # noqa: E402  (bench/: the same open-loop load)

from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402

WINDOW = 2.0


def deployment(count: int, strategy: str, latency_ms: float) -> C.Deployment:
    return deployment_from_dict(
        {
            "name": "bench",
            "model": "sim-tiny",
            "instance_groups": [{"name": "union", "role": "union", "count": count, "accelerators_per_engine": 1}],
            "engine_config": {
                "motor_engine_union_config": {
                    "engine_type": "sim",
                    "engine_args": {"model": "sim-tiny", "latency_ms": latency_ms},
                }
            },
            "strategy": {"type": strategy},
        }
    )


class Run:
    def __init__(self, args, strategy: str, base_port: int):
        self.args, self.strategy = args, strategy
        self.cluster = LocalCluster(
            tempfile.mkdtemp(prefix=f"rollout-{strategy}-"),
            nodes=2,
            heartbeat_interval=1.0,
            accelerators_per_node=args.instances // 2 + 2,  # room for the surge instance
            engine_port_base=base_port,
            router_port=0,
            metrics_port=0,
        )

    def call(self, method: str, request):
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            return getattr(controller_pb2_grpc.ControllerServiceStub(channel), method)(request, timeout=30)

    def apply(self, latency_ms: float) -> int:
        request = C.ApplyDeploymentRequest(deployment=deployment(self.args.instances, self.strategy, latency_ms))
        return self.call("ApplyDeployment", request).revision

    def settled(self, revision: int) -> bool:
        summary = self.call("ListDeployments", C.ListDeploymentsRequest()).deployments[0]
        instances = self.call("ListInstances", C.ListInstancesRequest()).instances
        status, text = post(self.cluster.router_url + "/list_workers", None, 5, method="GET")
        return (
            summary.rollout_state == C.ROLLOUT_STATE_COMPLETE
            and len(instances) == self.args.instances
            and all(i.revision == revision and i.state == C.INSTANCE_STATE_READY for i in instances)
            and status == 200
            and len(json.loads(text)["urls"]) == self.args.instances
        )

    def wait(self, revision: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.settled(revision):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.strategy}: revision {revision} not settled within {timeout:g}s")
            time.sleep(0.1)

    def run(self) -> dict:
        self.cluster.start(timeout=60)
        try:
            self.wait(self.apply(20), 120)
            load = Load(self.cluster.router_url, self.args.rate)
            sender = threading.Thread(target=load.run, daemon=True)
            sender.start()
            time.sleep(self.args.before)
            changed_at = time.monotonic()
            self.wait(self.apply(30), 600)
            done_at = time.monotonic()
            time.sleep(self.args.after)
            load.stopping.set()
            sender.join()
            for thread in load.threads:
                thread.join(timeout=35)
            return self.figures(load.results, changed_at, done_at)
        finally:
            self.cluster.stop()

    def figures(self, results, changed_at: float, done_at: float) -> dict:
        def served(start: float, end: float) -> float:
            answered_ok = sum(1 for _, status, answered in results if status == 200 and start <= answered < end)
            return answered_ok / (end - start)

        end = done_at + self.args.after
        starts = [changed_at + 0.25 * i for i in range(int((end - changed_at - WINDOW) / 0.25) + 1)]
        return {
            "duration": done_at - changed_at,
            "requests": len(results),
            "failed": sum(1 for r in results if r[1] != 200),
            "rate_before": served(changed_at - self.args.before + 1, changed_at),
            "lowest": min(served(t, t + WINDOW) for t in starts),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=3, help="instances of the deployment (default 3)")
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second (default 40)")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before the change (default 5)")
    parser.add_argument("--after", type=float, default=3.0, help="seconds of load after it settled (default 3)")
    args = parser.parse_args()
    print(
        f"{'strategy':<9} {'instances':>9} {'duration':>9} {'requests':>8} {'failed':>7} {'rate before':>12} "
        f"{'lowest 2 s window':>18}"
    )
    for base, strategy in ((43000, "rolling"), (44000, "recreate")):
        row = Run(args, strategy, base).run()
        print(
            f"{strategy:<9} {args.instances:>9} {row['duration']:>8.1f}s {row['requests']:>8} {row['failed']:>7} "
            f"{row['rate_before']:>10.1f}/s {row['lowest']:>16.1f}/s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
