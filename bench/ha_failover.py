"""Controller failover on etcd (docs/ha.md), one run, printed tables.

1. Failover: the `motorctl up --ha` cluster (etcd, two controllers, two real node managers with
   sim engines, the example deployment). `--kills` times: SIGKILL the leader, then measure until
   the other controller (a) leads, (b) has accepted a heartbeat of every node, (c) has accepted
   and stored a write (a RegisterNode of a probe node); then restart the killed controller as the
   standby. At the end: engines restarted (pids or generations changed) must be 0.
2. Steady state: one controller on etcd, `--nodes` simulated nodes (lightweight asyncio clients,
   bench/controller_scale.py's fleet) heartbeating at 1 Hz with 8 engines each; etcd writes per
   second over a window, read from etcd's revision (every write transaction raises it by one).

    .venv/bin/python bench/ha_failover.py                     # 20 kills, 2000 nodes
    .venv/bin/python bench/ha_failover.py --kills 5 --nodes 200 --window 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from controller.etcd_client import EtcdTarget, connect  # noqa: E402
from controller_scale import ENGINES_PER_NODE, FleetNodeManager, SimNode, deployment  # noqa: E402
from endpoint_removal import wait  # noqa: E402
from motor.grpc_server import MotorServer, aio_channel, service_name  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc, types_pb2  # noqa: E402
from motorctl.etcd_cluster import EtcdCluster  # noqa: E402
from motorctl.up import LocalCluster  # noqa: E402

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
            listed = node_manager_pb2_grpc.NodeManagerServiceStub(channel).ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5)
            for e in listed.engines:
                if e.state == types_pb2.ENGINE_STATE_RUNNING:
                    found[e.engine_id] = (e.pid, e.spec.generation)
    return found


def failover(args) -> None:
    cluster = LocalCluster(tempfile.mkdtemp(prefix="motor-ha-bench-"), nodes=2, deployment_path=DEPLOYMENT,
                           heartbeat_interval=args.heartbeat, controller_port=free_port(), engine_port_base=36000,
                           ha=True, extra_controller_args=["--lease-ttl", str(args.ttl), "--log-level", "WARNING"],
                           node_id_prefix="bench-node")
    probe = C.NodeInfo(node_id="bench-probe", address="127.0.0.1:9", host="127.0.0.1")
    rows = []
    try:
        cluster.start(timeout=60)

        def all_normal() -> bool:
            leader = leader_seen_by(cluster.controller_addresses[0])
            instances = stub(leader).ListInstances(C.ListInstancesRequest(), timeout=5).instances if leader else []
            return bool(instances) and all(i.state == C.INSTANCE_STATE_READY for i in instances)

        wait(all_normal, 90, "every instance READY")
        before = engines(cluster)
        for kill in range(args.kills):
            old = wait(lambda: leader_seen_by(cluster.controller_addresses[0]), 30, "a leader")
            index = cluster.controller_addresses.index(old)
            other = next(a for a in cluster.controller_addresses if a != old)
            process = cluster.process("controller" if index == 0 else f"controller-{index + 1}")
            time.sleep(random.uniform(0, args.ttl / 3))  # anywhere in the renewal cycle
            killed_wall, killed = time.time(), time.monotonic()
            os.kill(process.process.pid, signal.SIGKILL)
            wait(lambda: leader_seen_by(other) == other, 30, "the standby to lead")
            led = time.monotonic() - killed

            def heard_every_node() -> bool:
                nodes = stub(other).ListNodes(C.ListNodesRequest(), timeout=2).nodes
                real = [n for n in nodes if n.info.node_id in cluster.node_ports]
                return len(real) == len(cluster.node_ports) and all(n.last_heartbeat.ToMicroseconds() / 1e6 > killed_wall for n in real)

            wait(heard_every_node, 30, "a heartbeat of every node at the new leader")
            heartbeat = time.monotonic() - killed

            def write_accepted() -> bool:
                try:
                    stub(other).RegisterNode(C.RegisterNodeRequest(node=probe), timeout=2)
                    return True
                except grpc.RpcError:
                    return False

            wait(write_accepted, 30, "a write at the new leader")
            write = time.monotonic() - killed
            rows.append((led, heartbeat, write))
            print(f"kill {kill + 1:>2}: leads after {led:5.2f}s, every node's heartbeat after {heartbeat:5.2f}s, "
                  f"a write after {write:5.2f}s", flush=True)
            process.process.wait(10)
            cluster.launch_controller(index)
            cluster.wait_serving(old, 30)
            wait(lambda: leader_seen_by(old) == other, 30, "the restarted controller to stand by")
        time.sleep(args.heartbeat * 4)
        after = engines(cluster)
        restarted = sum(1 for engine_id, seen in before.items() if after.get(engine_id) != seen)
    finally:
        cluster.stop()
    print()
    print(f"{'failover (lease ' + str(args.ttl) + ' s, ' + str(len(rows)) + ' kills)':<44} {'median':>8} {'p99':>8}")
    for label, column in (("new leader elected", 0), ("heartbeat of every node accepted", 1), ("write accepted and stored", 2)):
        values = [row[column] for row in rows]
        print(f"{label:<44} {quantile(values, 0.5):7.2f}s {quantile(values, 0.99):7.2f}s")
    print(f"engines restarted or stopped across all kills: {restarted} of {len(before)}")


async def steady_state(args) -> None:
    work = tempfile.mkdtemp(prefix="motor-ha-writes-")
    etcd = EtcdCluster(os.path.join(work, "etcd"), size=1).start()
    fleet_nm = FleetNodeManager()
    nm_server = MotorServer("127.0.0.1:0")
    nm_server.add(node_manager_pb2_grpc.add_NodeManagerServiceServicer_to_server, fleet_nm,
                  service_name(node_manager_pb2, "NodeManagerService"))
    nm_address = f"127.0.0.1:{await nm_server.start()}"
    port = free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "motor-controller"), "--listen", f"127.0.0.1:{port}",
               "--db", os.path.join(work, "controller.db"), "--store", etcd.url + "/motor",
               "--lease-ttl", str(args.steady_ttl), "--commit-timeout", "300", "--heartbeat-interval", "1",
               "--node-grace", "30", "--log-level", "WARNING"]
    log = open(os.path.join(work, "controller.log"), "wb")
    controller = await asyncio.create_subprocess_exec(*command, stdout=log, stderr=log, start_new_session=True)
    client = connect(EtcdTarget(((etcd.members[0].host, etcd.members[0].client_port),), "/motor"))
    channel = aio_channel(f"127.0.0.1:{port}")
    control = controller_pb2_grpc.ControllerServiceStub(channel)
    stopping = False

    async def heartbeats(node: SimNode) -> None:
        await asyncio.sleep(random.random())
        while not stopping:
            try:
                await control.Heartbeat(node.heartbeat_request(), timeout=10)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1.0)

    tasks = []
    try:
        for _ in range(200):
            try:
                if (await control.ListControllers(C.ListControllersRequest(), timeout=2)).leader_address:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
        nodes = [SimNode(i, nm_address) for i in range(args.nodes)]
        for node in nodes:
            fleet_nm.by_host[node.host] = node
        for chunk in range(0, len(nodes), 100):
            replies = await asyncio.gather(*(control.RegisterNode(C.RegisterNodeRequest(node=n.info), timeout=120)
                                             for n in nodes[chunk:chunk + 100]))
            for node, reply in zip(nodes[chunk:chunk + 100], replies):
                node.generation = reply.generation
        applying = time.monotonic()
        await control.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(args.nodes)), timeout=300)
        applied = time.monotonic() - applying
        tasks = [asyncio.create_task(heartbeats(node)) for node in nodes]
        deadline = time.monotonic() + 600
        while fleet_nm.starts < args.nodes * ENGINES_PER_NODE and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await asyncio.sleep(args.warmup)
        first = (await client.get(b"/motor/state/generation")).header.revision
        await asyncio.sleep(args.window)
        last = (await client.get(b"/motor/state/generation")).header.revision
        listed = await control.ListNodes(C.ListNodesRequest(), timeout=60)
        ready = sum(1 for n in listed.nodes if n.state == C.NODE_STATE_READY)
        print()
        print(f"steady state: {args.nodes} simulated nodes x {ENGINES_PER_NODE} engines heartbeating at 1 Hz, "
              f"{fleet_nm.starts} engines started, {ready} nodes READY (lease {args.steady_ttl} s; "
              f"ApplyDeployment of {args.nodes * ENGINES_PER_NODE} engines took {applied:.1f} s)")
        print(f"etcd writes over {args.window:g} s: {last - first} ({(last - first) / args.window:.2f}/s) "
              f"while the leader took ~{args.nodes} heartbeats/s")
    finally:
        stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
        await client.close()
        controller.send_signal(signal.SIGTERM)
        await asyncio.wait_for(controller.wait(), 30)
        await nm_server.stop(0)
        etcd.stop()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="leader kills [20]")
    parser.add_argument("--ttl", type=int, default=2, help="leader lease TTL in seconds [2, the default]")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="node heartbeat interval (s) [1, the default]")
    parser.add_argument("--nodes", type=int, default=2000, help="simulated nodes for the write rate [2000]")
    parser.add_argument("--steady-ttl", type=int, default=30,
                        help="lease TTL of the write-rate part [30]: one reconcile pass placing 16,000 engines holds "
                             "the controller's loop for seconds, longer than 2/3 of a short lease (docs/ha.md)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after the last start before measuring [10]")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of the write-rate window [30]")
    args = parser.parse_args()
    if args.kills:
        failover(args)
    if args.nodes:
        asyncio.run(steady_state(args))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
