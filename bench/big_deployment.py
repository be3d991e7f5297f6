"""Does a big deployment block the controller? ApplyDeployment of 10,000 instances x dp 4 (40,000
engines), a replacing apply (every instance's spec changes: 40,000 stops and 40,000 starts), then
DeleteDeployment, against a real `motor-controller` process (SQLite, or --store etcd://...).

The fleet: --nodes simulated nodes with --accelerators each, heartbeating (unary, every 0.5 s,
from a thread of this script), whose node manager is one fake gRPC server in a child process
(tests/support/big_fleet.py: StartEngine answers at once with a RUNNING, NORMAL engine). Per phase
the script prints how long the API call took to answer, how long until the fake node manager
saw every start or stop (of the engines the fleet has room for: the others wait PENDING), the
controller's event-loop lag (motor_event_loop_lag_seconds: median, p99 and the largest bucket
hit, as bucket bounds; one observation every 0.25 s) and the part of it the loop itself was held
(motor_event_loop_blocked_seconds: the lag less the time the loop's thread waited for a CPU, i.e.
without the load of other processes; and how many of its observations were over the 50 ms
goal), both read with /metrics?name[]=... (that series alone: cheap); the garbage collections'
pauses (motor_gc_pause_seconds, part of the held time: the largest of the collections of what was
made since the last one, and how many complete walks, once each time the heap doubled, with the
largest); and the slowest heartbeat round trip. Everything on 127.0.0.1, plaintext.

    .venv/bin/python bench/big_deployment.py [--instances 10000] [--dp 4] [--nodes 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from motor.v1 import controller_pb2 as C  # noqa: E402
from tests.support.big_fleet import BigFleet, deployment, lag_stalls  # noqa: E402

GOAL = 0.05  # seconds an API call may hold the controller's loop


def quantile(stalls: dict[float, float], q: float) -> float:
    total = sum(stalls.values())
    seen = 0.0
    for le in sorted(stalls):
        seen += stalls[le]
        if total and seen >= q * total:
            return le
    return float("nan")


def wait_counts(fleet: BigFleet, key: str, target: int, timeout: float) -> float:
    began = time.monotonic()
    while fleet.counts()[key] < target:
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"{key} stayed at {fleet.counts()[key]} of {target} for {timeout:g}s")
        time.sleep(0.1)
    return time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--grace", type=float, default=2.5, help="controller --node-grace (heartbeats every 0.5 s)")
    parser.add_argument("--accelerators", type=int, default=400, help="per node")
    parser.add_argument(
        "--store", default="", help="etcd://HOST:PORT/PREFIX (default: SQLite in a temporary directory)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a phase may take")
    args = parser.parse_args()
    engines = args.instances * args.dp
    placed = min(engines, args.nodes * args.accelerators)  # the rest wait PENDING (every pass goes over them)
    fleet = BigFleet(
        args.nodes, args.accelerators, grace=args.grace, store_args=["--store", args.store] if args.store else None
    )
    rows = []
    try:
        fleet.start()
        time.sleep(2)
        phases = [
            (
                "apply",
                lambda: fleet.stub.ApplyDeployment(
                    C.ApplyDeploymentRequest(deployment=deployment(args.instances, args.dp)), timeout=600
                ),
                "starts",
                placed,
            ),
            (
                "replacing apply",
                lambda: fleet.stub.ApplyDeployment(
                    C.ApplyDeploymentRequest(deployment=deployment(args.instances, args.dp, "sim-tiny-2")), timeout=600
                ),
                "starts",
                2 * placed,
            ),
            (
                "delete",
                lambda: fleet.stub.DeleteDeployment(C.DeleteDeploymentRequest(), timeout=600),
                "stops",
                2 * placed,
            ),
        ]
        for name, call, key, target in phases:
            before = {which: fleet.lag_buckets(which) for which in ("lag", "blocked")}
            gc_before = {
                walk: fleet.buckets("motor_gc_pause_seconds", f',walk="{walk}"') for walk in ("recent", "complete")
            }
            fleet.beats.slowest = 0.0
            began = time.monotonic()
            call()
            answered = time.monotonic() - began
            done = wait_counts(fleet, key, target, args.timeout) - began
            time.sleep(1.0)  # the last slice's lag is observed
            row = [name, answered, done]
            stalls = {which: lag_stalls(before[which], fleet.lag_buckets(which)) for which in ("lag", "blocked")}
            for observed in stalls.values():
                row += [
                    quantile(observed, 0.5),
                    quantile(observed, 0.99),
                    max((le for le, n in observed.items() if n > 0), default=0.0),
                ]
            held = stalls["blocked"]
            over = sum(n for le, n in held.items() if le > GOAL)  # held past the goal, of all observations
            pauses = {
                walk: lag_stalls(gc_before[walk], fleet.buckets("motor_gc_pause_seconds", f',walk="{walk}"'))
                for walk in ("recent", "complete")
            }
            largest = {
                walk: max((le for le, n in observed.items() if n > 0), default=0.0) for walk, observed in pauses.items()
            }
            row += [largest["recent"], f"{sum(pauses['complete'].values()):.0f}", largest["complete"]]
            rows.append((*row, f"{over:.0f}/{sum(held.values()):.0f}", fleet.beats.slowest, len(fleet.beats.failed)))
    finally:
        fleet.stop()
    print(
        f"{args.instances} instances x dp {args.dp} = {engines} engines ({placed} placed) on {args.nodes} nodes x "
        f"{args.accelerators} accelerators; "
        f"store {args.store or 'SQLite'}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'phase':16}{'answered s':>11}{'done s':>8}{'lag p50 <=':>12}{'p99 <=':>9}{'max <=':>9}{'held p50 <=':>13}"
        f"{'p99 <=':>9}{'max <=':>9}{'gc max <=':>11}{'complete':>10}{'max <=':>9}{'held >50ms':>12}"
        f"{'slowest beat':>14}{'failed beats':>14}"
    )
    for (
        name,
        answered,
        done,
        lag50,
        lag99,
        lagmax,
        held50,
        held99,
        heldmax,
        gc_recent,
        walks,
        gc_complete,
        over,
        beat,
        failed,
    ) in rows:
        print(
            f"{name:16}{answered:11.2f}{done:8.1f}{lag50 * 1e3:10.0f}ms{lag99 * 1e3:7.0f}ms{lagmax * 1e3:7.0f}ms"
            f"{held50 * 1e3:11.0f}ms{held99 * 1e3:7.0f}ms{heldmax * 1e3:7.0f}ms{gc_recent * 1e3:9.0f}ms{walks:>10}"
            f"{gc_complete * 1e3:7.0f}ms{over:>12}{beat * 1e3:12.0f}ms{failed:14d}"
        )
    print(
        f"heartbeats: {fleet.beats.sent} sent, {len(fleet.beats.failed)} failed"
        + (f" (first: {fleet.beats.failed[0]})" if fleet.beats.failed else "")
        + f"; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
