"""Autoscaling on a load step: with a warm spare, without one, and a fixed count sized for the peak.

For each setting a fresh `motorctl up` cluster (LocalCluster: a controller, two node managers
with four accelerators each, the real vllm-router kept by motor-router-sync) serves simulated
union engines with a capacity (engine_args.max_num_seqs: requests served at once, the rest wait;
latency_ms each) whose model takes --load-s seconds to load. An open-loop client load through the
router (each request on its own thread, Poisson arrivals) runs --low requests/s for --before s, steps to --high
for --peak s, and back to --low for --after s. Settings:

- autoscaling with `spares: 1`: min 1, max --max, target_in_flight --target,
  scale_down_delay_s --delay;
- the same without a spare;
- fixed: `count` --max, no autoscaling (sized for the peak);
- fixedspare: the same with `spares: 1`, the warm spare an operator keeps for failover whether
  the count is fixed or not (the fair peer of the first setting's engine-seconds).

Printed per setting: seconds from the step to the first decision (the group's count changed) and
to the added capacity serving (the router lists more workers than before the step), the seconds
(by the second requests were sent in) whose TTFT p95 was above --ttft (answers are 2 tokens,
non-streamed: the whole answer's time), engine-seconds (every started instance, spares included,
integrated over the run, and split into before the step, during it and after it; as a share of
the fixed count's, and with a spare also of the fixed count keeping one), failed requests, changes
of direction of the count, and the controller's decisions with their figures.

    .venv/bin/python bench/autoscale.py [--load-s 10] [--low 5] [--high 30] [--max 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.router_failover import post  # noqa: E402
from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402

GROUP = "chat"


def deployment(args, setting: str) -> C.Deployment:
    group: dict = {"name": GROUP, "role": "union", "accelerators_per_engine": 1}
    if setting in ("fixed", "fixedspare"):
        group.update(count=args.max, spares=1 if setting == "fixedspare" else 0)
    else:
        group.update(count=1, spares=1 if setting == "spare" else 0)
        group["autoscaling"] = {
            "min": 1,
            "max": args.max,
            "target_in_flight": args.target,
            "scale_down_delay_s": args.delay,
        }
    engine_args = {"model": "sim-tiny", "latency_ms": args.latency_ms, "max_num_seqs": args.seqs, "load_s": args.load_s}
    return deployment_from_dict(
        {
            "name": "bench",
            "model": "sim-tiny",
            "instance_groups": [group],
            "engine_config": {"motor_engine_union_config": {"engine_type": "sim", "engine_args": engine_args}},
        }
    )


class SteppedLoad:
    """Open-loop completions at a rate that follows `phases` [(seconds, requests/s)], arriving as
    users' requests do: at random (Poisson: exponential gaps, a fixed seed so runs compare). Evenly
    spaced arrivals, one every 200 ms for requests of 200 ms, hold exactly 1 in flight; the node
    managers' once-a-second samples then lock onto one phase of that cycle and read 1 or 2 for
    minutes, a pattern no user's load has."""

    def __init__(self, url: str, phases: list[tuple[float, float]], seed: int = 1):
        self.url, self.phases = url, phases
        self.random = random.Random(seed)
        self.results: list[tuple[float, int, float]] = []  # (sent, status, answered)
        self.threads: list[threading.Thread] = []
        self.started = 0.0

    def run(self) -> None:
        self.started = next_at = time.monotonic()
        end = 0.0
        for seconds, rate in self.phases:
            end += seconds
            while next_at < self.started + end:
                time.sleep(max(0.0, next_at - time.monotonic()))
                thread = threading.Thread(target=self.one, daemon=True)
                thread.start()
                self.threads.append(thread)
                next_at += self.random.expovariate(rate)

    def one(self) -> None:
        sent = time.monotonic()
        status, _ = post(self.url + "/v1/completions", {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}, 60)
        self.results.append((sent, status, time.monotonic()))


class Watch:
    """Samples the controller and the router every 0.25 s while the load runs."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.samples: list[tuple[float, int, int, int]] = []  # (time, count, started instances, workers)
        self.stopping = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            while not self.stopping.is_set():
                try:
                    [summary] = stub.ListDeployments(C.ListDeploymentsRequest(), timeout=5).deployments
                    instances = stub.ListInstances(C.ListInstancesRequest(), timeout=5).instances
                except grpc.RpcError:
                    time.sleep(0.25)
                    continue
                count = summary.deployment.instance_groups[0].count
                started = sum(1 for i in instances if i.state != C.INSTANCE_STATE_PENDING)
                status, text = post(self.cluster.router_url + "/list_workers", None, 5, method="GET")
                workers = len(json.loads(text)["urls"]) if status == 200 else -1
                self.samples.append((time.monotonic(), count, started, workers))
                time.sleep(0.25)


def nearest_rank(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def run_setting(args, setting: str, base_port: int) -> dict:
    home = tempfile.mkdtemp(prefix=f"autoscale-{setting}-")
    cluster = LocalCluster(
        home,
        nodes=2,
        heartbeat_interval=1.0,
        accelerators_per_node=4,
        engine_port_base=base_port,
        router_port=0,
        metrics_port=0,
    )
    cluster.start(timeout=60)
    try:
        with grpc.insecure_channel(cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(args, setting)), timeout=30)
            expected = args.max if setting.startswith("fixed") else 1
            deadline = time.monotonic() + args.load_s + 90
            while True:
                instances = stub.ListInstances(C.ListInstancesRequest(), timeout=5).instances
                status, text = post(cluster.router_url + "/list_workers", None, 5, method="GET")
                workers = len(json.loads(text)["urls"]) if status == 200 else 0
                if all(i.state == C.INSTANCE_STATE_READY for i in instances) and workers == expected:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{setting}: the deployment never became READY and routed")
                time.sleep(0.5)
        phases = [(args.before, args.low), (args.peak, args.high), (args.after, args.low)]
        load, watch = SteppedLoad(cluster.router_url, phases), Watch(cluster)
        watcher = threading.Thread(target=watch.run, daemon=True)
        watcher.start()
        load.run()
        for thread in load.threads:
            thread.join(timeout=65)
        watch.stopping.set()
        watcher.join(timeout=10)
    finally:
        cluster.stop()
    return summarize(args, setting, load, watch, decisions(home))


def decisions(home: str) -> list[str]:
    """The controller's autoscaling decisions, as its log says them (time and figures)."""
    with open(os.path.join(home, "logs", "controller.log"), errors="replace") as log:
        return [
            f"{line[11:19]} {line.split('autoscaling bench: ', 1)[1].strip()}"
            for line in log
            if "autoscaling bench: " in line
        ]


def summarize(args, setting: str, load: SteppedLoad, watch: Watch, decided_lines: list[str]) -> dict:
    step = load.started + args.before
    samples = watch.samples
    before = [s for s in samples if s[0] <= step]
    base_count = before[-1][1] if before else samples[0][1]
    base_workers = before[-1][3] if before else samples[0][3]
    decided = next((s[0] - step for s in samples if s[0] > step and s[1] > base_count), None)
    serving = next((s[0] - step for s in samples if s[0] > step and s[3] > base_workers), None)
    engine_seconds = sum((b[0] - a[0]) * a[2] for a, b in zip(samples, samples[1:]))
    # Where they go: before the step, during it, and after it (the queue's drain and the scale-down).
    phases = [0.0, 0.0, 0.0]
    for a, b in zip(samples, samples[1:]):
        phases[(a[0] >= step) + (a[0] >= step + args.peak)] += (b[0] - a[0]) * a[2]
    counts = [s[1] for s in samples]
    moves = [1 if b > a else -1 for a, b in zip(counts, counts[1:]) if a != b]
    direction_changes = sum(1 for a, b in zip(moves, moves[1:]) if a != b)
    by_second: dict[int, list[float]] = {}
    for sent, _status, answered in load.results:
        by_second.setdefault(int(sent - load.started), []).append(answered - sent)
    slow = sum(1 for times in by_second.values() if nearest_rank(times, 0.95) > args.ttft)
    failed = sum(1 for _, status, _ in load.results if status != 200)
    row = {
        "setting": setting,
        "decided_s": decided,
        "serving_s": serving,
        "slow_seconds": slow,
        "engine_seconds": engine_seconds,
        "engine_seconds_before_during_after": [round(x) for x in phases],
        "failed": failed,
        "requests": len(load.results),
        "direction_changes": direction_changes,
        "counts": [c for i, c in enumerate(counts) if i == 0 or counts[i - 1] != c],  # in order
        "decisions": decided_lines,
    }
    print(f"{setting}: {row}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-s", type=float, default=10.0, help="the simulated model's load time (default 10)")
    parser.add_argument("--low", type=float, default=5.0, help="requests/s before and after the step (default 5)")
    parser.add_argument("--high", type=float, default=30.0, help="requests/s during the step (default 30)")
    parser.add_argument("--before", type=float, default=30.0, help="seconds at --low before the step (default 30)")
    parser.add_argument("--peak", type=float, default=40.0, help="seconds at --high (default 40)")
    parser.add_argument("--after", type=float, default=60.0, help="seconds at --low after the step (default 60)")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="each request's time (default 200)")
    parser.add_argument("--seqs", type=int, default=2, help="max_num_seqs of each engine (default 2)")
    parser.add_argument("--max", type=int, default=5, help="autoscaling max, and the fixed count (default 5)")
    parser.add_argument("--target", type=float, default=1.5, help="target_in_flight (default 1.5)")
    parser.add_argument("--delay", type=float, default=15.0, help="scale_down_delay_s (default 15)")
    parser.add_argument("--ttft", type=float, default=1.0, help="the TTFT p95 target in seconds (default 1)")
    parser.add_argument("--settings", default="spare,nospare,fixed,fixedspare", help="which settings, comma-separated")
    args = parser.parse_args()
    rows = [run_setting(args, setting, 43000 + 2000 * index) for index, setting in enumerate(args.settings.split(","))]
    print(f"\nload average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"{'setting':<9} {'decision':>9} {'serving':>8} {'p95>ttft s':>10} {'engine-s':>9} {'failed':>7} "
        f"{'requests':>9} {'dir.changes':>11}"
    )
    for r in rows:
        decided = f"{r['decided_s']:.1f}s" if r["decided_s"] is not None else "-"
        serving = f"{r['serving_s']:.1f}s" if r["serving_s"] is not None else "-"
        print(
            f"{r['setting']:<9} {decided:>9} {serving:>8} {r['slow_seconds']:>10} {r['engine_seconds']:>9.0f} "
            f"{r['failed']:>7} {r['requests']:>9} {r['direction_changes']:>11}"
        )
    print("engine-seconds before / during / after the step, and against the fixed count (with a spare: with one):")
    by_setting = {r["setting"]: r for r in rows}
    for r in rows:
        # Without a spare against the fixed count; with one, against it and the fixed count with one.
        compared = {"spare": ("fixed", "fixedspare"), "nospare": ("fixed",)}.get(r["setting"], ())
        peers = [by_setting[p] for p in compared if p in by_setting]
        share = ", ".join(f"{100 * r['engine_seconds'] / p['engine_seconds']:.0f} % of {p['setting']}" for p in peers)
        print(f"  {r['setting']:<10} {' / '.join(map(str, r['engine_seconds_before_during_after'])):<16} {share}")
    for r in rows:
        for line in r["decisions"]:
            print(f"  {r['setting']:<10} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
