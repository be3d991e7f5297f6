"""Controller failover on etcd (docs/ha.md), one run, printed tables.

1. Failover: the `motorctl up --ha` cluster (etcd, two controllers, two real node managers with
   sim engines, the example deployment). `--kills` times: SIGKILL the leader, then measure until
   the other controller (a) leads, (b) has accepted a heartbeat of every node, (c) has accepted
   and stored a write (a RegisterNode of a probe node); then restart the killed controller as the
   standby. Then `--pauses` times the same with SIGSTOP (a paused leader: no confirmed death, the
   lease must expire), SIGCONT once measured. At the end: engines restarted (pids or generations
   changed) must be 0.
2. Steady state: one controller on etcd, `--nodes` simulated nodes (bench/fleet, the Go fleet of
   bench/controller_scale.py, in its own process, reporting no engine failures) heartbeating at
   1 Hz on StreamHeartbeats with 8 engines each; etcd writes per second over a window, read from
   etcd's revision (every write transaction raises it by one).

    .venv/bin/python bench/ha_failover.py                     # 20 kills, 2000 nodes
    .venv/bin/python bench/ha_failover.py --kills 5 --pauses 2 --nodes 200 --window 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from endpoint_removal import wait  # noqa: E402
from scale_fleet import ENGINES_PER_NODE, Fleet, deployment  # noqa: E402

from controller.store.etcd_client import EtcdTarget, connect  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc, types_pb2  # noqa: E402
from motorctl.etcd_cluster import EtcdCluster  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402

DEPLOYMENT = os.path.join(ROOT, "examples", "local-deployment.yaml")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def stub(address: str) -> controller_pb2_grpc.ControllerServiceStub:
    return controller_pb2_grpc.ControllerServiceStub(grpc.insecure_channel(address))


def leader_seen_by(address: str) -> str:
    try:
        return stub(address).ListControllers(C.ListControllersRequest(), timeout=1).leader_address
    except grpc.RpcError:
        return ""


def engines(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    found = {}
    for port in cluster.node_ports.values():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            listed = node_manager_pb2_grpc.NodeManagerServiceStub(channel).ListEngines(
                node_manager_pb2.ListEnginesRequest(), timeout=5
            )
            for e in listed.engines:
                if e.state == types_pb2.ENGINE_STATE_RUNNING:
                    found[e.engine_id] = (e.pid, e.spec.generation)
    return found


def fail_leader(cluster: LocalCluster, how: str, args, probe: C.NodeInfo) -> tuple[float, float, float]:
    """SIGKILL ("kill") or SIGSTOP ("pause") the leader; the seconds until the other controller
    leads, has a heartbeat of every node, and has stored a write. The failed one is restarted
    (killed) or continued (paused) and waited for as the standby."""
    old = wait(lambda: leader_seen_by(cluster.controller_addresses[0]), 30, "a leader")
    index = cluster.controller_addresses.index(old)
    other = next(a for a in cluster.controller_addresses if a != old)
    process = cluster.process("controller" if index == 0 else f"controller-{index + 1}")
    time.sleep(random.uniform(0, args.ttl / 3))  # anywhere in the renewal cycle
    failed_wall, failed = time.time(), time.monotonic()
    os.kill(process.process.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        wait(lambda: leader_seen_by(other) == other, 30, "the standby to lead")
        led = time.monotonic() - failed

        def heard_every_node() -> bool:
            nodes = stub(other).ListNodes(C.ListNodesRequest(), timeout=2).nodes
            real = [n for n in nodes if n.info.node_id in cluster.node_ports]
            return len(real) == len(cluster.node_ports) and all(
                n.last_heartbeat.ToMicroseconds() / 1e6 > failed_wall for n in real
            )

        wait(heard_every_node, 30, "a heartbeat of every node at the new leader")
        heartbeat = time.monotonic() - failed

        def write_accepted() -> bool:
            try:
                stub(other).RegisterNode(C.RegisterNodeRequest(node=probe), timeout=2)
                return True
            except grpc.RpcError:
                return False

        wait(write_accepted, 30, "a write at the new leader")
        write = time.monotonic() - failed
    finally:
        if how == "pause":
            os.kill(process.process.pid, signal.SIGCONT)
    if how == "kill":
        process.process.wait(10)
        cluster.launch_controller(index)
        cluster.wait_serving(old, 30)
    wait(lambda: leader_seen_by(old) == other, 30, "the failed controller to stand by")
    return led, heartbeat, write


def failover(args) -> None:
    cluster = LocalCluster(
        tempfile.mkdtemp(prefix="motor-ha-bench-"),
        nodes=2,
        deployment_path=DEPLOYMENT,
        heartbeat_interval=args.heartbeat,
        controller_port=free_port(),
        engine_port_base=36000,
        ha=True,
        extra_controller_args=["--lease-ttl", str(args.ttl), "--log-level", "WARNING"],
        node_id_prefix="bench-node",
    )
    probe = C.NodeInfo(node_id="bench-probe", address="127.0.0.1:9", host="127.0.0.1")
    rows: dict[str, list[tuple[float, float, float]]] = {"kill": [], "pause": []}
    loads = [os.getloadavg()[0]]
    try:
        cluster.start(timeout=60)

        def all_normal() -> bool:
            leader = leader_seen_by(cluster.controller_addresses[0])
            instances = stub(leader).ListInstances(C.ListInstancesRequest(), timeout=5).instances if leader else []
            return bool(instances) and all(i.state == C.INSTANCE_STATE_READY for i in instances)

        wait(all_normal, 90, "every instance READY")
        before = engines(cluster)
        for how, count in (("kill", args.kills), ("pause", args.pauses)):
            for n in range(count):
                led, heartbeat, write = fail_leader(cluster, how, args, probe)
                rows[how].append((led, heartbeat, write))
                loads.append(os.getloadavg()[0])
                print(
                    f"{how} {n + 1:>2}: leads after {led:5.2f}s, every node's heartbeat after {heartbeat:5.2f}s, "
                    f"a write after {write:5.2f}s",
                    flush=True,
                )
        time.sleep(args.heartbeat * 4)
        after = engines(cluster)
        restarted = sum(1 for engine_id, seen in before.items() if after.get(engine_id) != seen)
    finally:
        cluster.stop()
    for how, title in (("kill", "leader SIGKILLed"), ("pause", "leader SIGSTOPped")):
        if not rows[how]:
            continue
        print()
        print(f"{f'{title} (lease {args.ttl} s, {len(rows[how])} times)':<44} {'median':>8} {'p99':>8}")
        for label, column in (
            ("new leader elected", 0),
            ("heartbeat of every node accepted", 1),
            ("write accepted and stored", 2),
        ):
            values = [row[column] for row in rows[how]]
            print(f"{label:<44} {quantile(values, 0.5):7.2f}s {quantile(values, 0.99):7.2f}s")
    print(f"engines restarted or stopped across all failovers: {restarted} of {len(before)}")
    print(f"load average (1 min) during the failovers: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs")


def steady_state(args) -> None:
    work = tempfile.mkdtemp(prefix="motor-ha-writes-")
    etcd = EtcdCluster(os.path.join(work, "etcd"), size=1).start()
    port = free_port()
    command = [
        os.path.join(os.path.dirname(sys.executable), "motor-controller"),
        "--listen",
        f"127.0.0.1:{port}",
        "--db",
        os.path.join(work, "controller.db"),
        "--store",
        etcd.url + "/motor",
        "--lease-ttl",
        str(args.steady_ttl),
        "--commit-timeout",
        "300",
        "--heartbeat-interval",
        "1",
        "--node-grace",
        "30",
        "--log-level",
        "WARNING",
        # Every simulated node's stream comes from 127.0.0.1: a plaintext caller is counted per host.
        "--max-streams-per-caller",
        str(2 * args.nodes + 100),
    ]
    log = open(os.path.join(work, "controller.log"), "wb")
    controller = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    fleet = None

    async def revision() -> int:
        client = connect(EtcdTarget(((etcd.members[0].host, etcd.members[0].client_port),), "/motor"))
        try:
            return (await client.get(b"/motor/state/generation")).header.revision
        finally:
            await client.close()

    try:
        wait(lambda: leader_seen_by(f"127.0.0.1:{port}"), 30, "the controller to lead")
        # No engine failures reported: every etcd write in the window would be a real change.
        fleet = Fleet(
            f"127.0.0.1:{port}", argparse.Namespace(transport="stream", victims=0, reports_per_s=0, conns=8), None
        )
        fleet.ask(f"grow {args.nodes}")
        applying = time.monotonic()
        stub(f"127.0.0.1:{port}").ApplyDeployment(
            C.ApplyDeploymentRequest(deployment=deployment(args.nodes)), timeout=300
        )
        applied = time.monotonic() - applying
        wait(lambda: fleet.ask("starts")["starts"] >= args.nodes * ENGINES_PER_NODE, 600, "every engine started")
        time.sleep(args.warmup)
        first = asyncio.run(revision())
        seen = fleet.ask(f"measure {args.window}")
        last = asyncio.run(revision())
        listed = stub(f"127.0.0.1:{port}").ListNodes(C.ListNodesRequest(filter="state=READY"), timeout=60)
        print()
        print(
            f"steady state: {args.nodes} simulated nodes (bench/fleet) x {ENGINES_PER_NODE} engines heartbeating at "
            f"1 Hz, {len(listed.nodes)} nodes READY (lease {args.steady_ttl} s; ApplyDeployment of "
            f"{args.nodes * ENGINES_PER_NODE} engines took {applied:.1f} s)"
        )
        print(
            f"etcd writes over {args.window:g} s: {last - first} ({(last - first) / args.window:.2f}/s) "
            f"while the leader answered {seen['rate']:.0f} heartbeats/s ({seen['errors']} failed)"
        )
    finally:
        if fleet:
            fleet.stop()
        controller.send_signal(signal.SIGTERM)
        controller.wait(30)
        etcd.stop()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="leader kills [20]")
    parser.add_argument("--pauses", type=int, default=5, help="leader SIGSTOPs past the lease (the TTL path) [5]")
    parser.add_argument("--ttl", type=int, default=2, help="leader lease TTL in seconds [2, the default]")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="node heartbeat interval (s) [1, the default]")
    parser.add_argument("--nodes", type=int, default=2000, help="simulated nodes for the write rate [2000]")
    parser.add_argument(
        "--steady-ttl",
        type=int,
        default=30,
        help="lease TTL of the write-rate part [30]: one reconcile pass placing 16,000 engines holds "
        "the controller's loop for seconds, longer than 2/3 of a short lease (docs/ha.md)",
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after the last start before measuring [10]")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of the write-rate window [30]")
    args = parser.parse_args()
    if args.kills or args.pauses:
        failover(args)
    if args.nodes:
        steady_state(args)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
