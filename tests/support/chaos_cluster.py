"""The one cluster the chaos suite drives: a controller and three node managers as real processes
(`motorctl up`'s LocalCluster, with the kill/restart helpers of the controller's real-process
tests), sim engine servers, and the controller's database and each node's state directory on
small tmpfs mounts of their own (so a disk can really be filled).

What a row looks at comes from outside the services as much as possible: engine server processes
are found by scanning every process of the machine (psutil), and attributed to this cluster by
their working directory (under the cluster's run directory)."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess

import grpc
import psutil

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2 as C
from motor.v1 import node_manager_pb2, node_manager_pb2_grpc
from motor.v1 import types_pb2 as T
from tests.support.process_cluster import Cluster

HEARTBEAT = 0.5
# A node manager paused 3 s is within grace; one paused 20 s is lost (grace + re-check).
NODE_GRACE = 5.0
# An engine paused 2 s misses at most two or three status calls (1 s deadline each): under the
# threshold; one paused 8 s reaches it and is killed as hung.
ABNORMAL_THRESHOLD = 5
CONFLICT_ALARM = "claimed by two live node managers"
DISK_MB = {"controller": 64, "node": 32}

SIM_SECTION = {
    "engine_type": "sim",
    "engine_args": {"model": "sim-tiny", "latency_ms": 1, "utilization": 10},
    "health_check_config": {"enable_virtual_inference": False},
}
BASELINE = {
    "name": "chaos",
    "model": "sim-tiny",
    "instance_groups": [
        {
            "name": "prefill",
            "role": "prefill",
            "count": 1,
            "data_parallel_size": 2,
            "accelerators_per_engine": 1,
            "pair_with": "decode",
        },
        {"name": "decode", "role": "decode", "count": 1, "data_parallel_size": 1, "accelerators_per_engine": 1},
    ],
    # Failures older than 30 s do not count: the rows kill the same instances again and again.
    "restart_policy": {
        "scope": "group",
        "initial_backoff": "0.5s",
        "max_backoff": "2s",
        "reset_after": "10s",
        "max_failures": 4,
        "failure_window": "30s",
    },
    "engine_config": {"motor_engine_prefill_config": SIM_SECTION, "motor_engine_decode_config": SIM_SECTION},
}
# (instance id, dp rank) of every engine of BASELINE.
BASELINE_ENGINES = {("prefill-0", 0), ("prefill-0", 1), ("decode-0", 0)}
BASELINE_INSTANCES = {"prefill-0", "decode-0"}


def deployment(extra_groups: list[dict] | None = None, union: dict | None = None) -> C.Deployment:
    """BASELINE, plus groups of role union configured by `union` (sim engine_args) when given."""
    spec = {**BASELINE, "instance_groups": BASELINE["instance_groups"] + (extra_groups or [])}
    if union is not None:
        section = {**SIM_SECTION, "engine_args": {**SIM_SECTION["engine_args"], **union}}
        spec["engine_config"] = {**BASELINE["engine_config"], "motor_engine_union_config": section}
    return deployment_from_dict(spec)


def mount_tmpfs(path: str, megabytes: int) -> bool:
    """A tmpfs of its own at `path` (root only); False where this machine refuses mounts."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", path], capture_output=True)
    return done.returncode == 0


def unmount(path: str) -> None:
    subprocess.run(["umount", "-l", path], capture_output=True)


class ChaosCluster(Cluster):
    """Three node managers chaos-a/b/c with four accelerators each; the controller is started
    with --deployment (the baseline) so that it knows the desired state whatever its disk says."""

    disks_mounted: bool = False

    @property
    def db_dir(self) -> str:
        return os.path.join(self.run_dir, "controller-disk")

    @property
    def db_path(self) -> str:
        return os.path.join(self.db_dir, "controller.db")

    def state_dir(self, node_id: str) -> str:
        return os.path.join(self.run_dir, node_id)

    def mount_disks(self) -> bool:
        """tmpfs for the controller's database and each node's state directory (docs/chaos.md)."""
        wanted = [(self.db_dir, DISK_MB["controller"])] + [
            (self.state_dir(n), DISK_MB["node"]) for n in self.node_ids()
        ]
        self.mounts = [path for path, size in wanted if mount_tmpfs(path, size)]
        self.disks_mounted = len(self.mounts) == len(wanted)
        return self.disks_mounted

    def unmount_disks(self) -> None:
        """Keeps the logs written there (engine servers') in <run dir>/kept/, then unmounts."""
        for path in getattr(self, "mounts", []):
            try:
                shutil.copytree(
                    path,
                    os.path.join(self.run_dir, "kept", os.path.basename(path)),
                    dirs_exist_ok=True,
                    ignore=lambda folder, names: [n for n in names if n == "filler"],
                )
            except (OSError, shutil.Error):  # a file gone meanwhile: keep what was copied
                pass
            unmount(path)

    def with_db(self, argv: list[str]) -> list[str]:
        argv = list(argv)
        argv[argv.index("--db") + 1] = self.db_path
        if "--deployment" not in argv:
            argv += ["--deployment", self.deployment_path]
        return argv

    def controller_command(self, index: int) -> list[str]:
        return self.with_db(super().controller_command(index))

    def controller_argv(self) -> list[str]:
        return self.with_db(super().controller_argv())

    # --- what the rows look at -------------------------------------------------------------

    def engine_processes(self) -> dict[tuple[str, int], list[int]]:
        """(instance id, rank) -> pids of live engine server processes of this cluster, found by
        scanning every process of the machine."""
        found: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
        for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
            info = proc.info
            argv, cwd = info["cmdline"] or [], info["cwd"] or ""
            if info["status"] == psutil.STATUS_ZOMBIE or "--instance-id" not in argv:
                continue
            if not cwd.startswith(self.run_dir + os.sep) or not any(
                os.path.basename(a) == "engine_server" for a in argv[:2]
            ):
                continue
            rank = int(argv[argv.index("--dp-rank") + 1]) if "--dp-rank" in argv else 0
            found[(argv[argv.index("--instance-id") + 1], rank)].append(proc.pid)
        return dict(found)

    def listed_pids(self) -> dict[str, set[int]]:
        """node id -> pids of the live engines its node manager lists (unanswered: absent)."""
        listed: dict[str, set[int]] = {}
        for node_id, port in self.node_ports.items():
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
                    engines = stub.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=3).engines
            except grpc.RpcError:
                continue
            listed[node_id] = {e.pid for e in engines if e.state in (T.ENGINE_STATE_STARTING, T.ENGINE_STATE_RUNNING)}
        return listed

    def orphans(self) -> list[int]:
        """Engine processes of this cluster that no live node manager lists as its own."""
        owned = set().union(*self.listed_pids().values())
        return sorted(pid for pids in self.engine_processes().values() for pid in pids if pid not in owned)

    def problems(self, instances: set[str] = BASELINE_INSTANCES) -> list[str]:
        """Why the cluster is not whole; empty when every node is READY with no alarm, every
        instance READY with each engine RUNNING and NORMAL, each engine running exactly once (as
        the controller says), and no engine process is an orphan."""
        nodes = self.node_list()
        # A node id conflict's alarm stays until the refused process has been quiet for a minute
        # (controller/fleet/claims.py): it tells of a past conflict, not of a cluster still broken.
        problems = [f"alarm: {a}" for a in nodes.alarms if CONFLICT_ALARM not in a]
        states = {n.info.node_id: n.state for n in nodes.nodes}
        problems += [f"{n} not READY" for n in self.node_ids() if states.get(n) != C.NODE_STATE_READY]
        found = self.instances()
        problems += [f"{i} missing" for i in instances - set(found)]
        problems += [
            f"{i} is {C.InstanceState.Name(inst.state)}: {inst.state_reason}"
            for i, inst in found.items()
            if i in instances and inst.state != C.INSTANCE_STATE_READY
        ]
        problems += [f"instance {i} not in the deployment" for i in set(found) - instances]
        for inst in found.values():
            problems += [
                f"{e.engine_id} {T.EngineState.Name(e.state)} {T.HealthStatus.Name(e.health)}"
                for e in inst.engines
                if e.state != T.ENGINE_STATE_RUNNING or e.health != T.HEALTH_STATUS_NORMAL
            ]
        processes = self.engine_processes()
        expected = {(i, r) for i, r in BASELINE_ENGINES if i in instances}
        problems += [
            f"{k} has {len(processes.get(k, []))} processes" for k in expected if len(processes.get(k, [])) != 1
        ]
        problems += [f"unexpected engine processes {k}: {v}" for k, v in processes.items() if k not in expected]
        reported = {
            (e.engine_id.split("/rank")[0], int(e.engine_id.split("/rank")[1])): e.pid
            for n in nodes.nodes
            for e in n.engines
            if e.state == T.ENGINE_STATE_RUNNING
        }
        problems += [
            f"{k}: the controller says pid {reported.get(k)}, the machine runs {processes.get(k)}"
            for k in expected
            if processes.get(k) and reported.get(k) not in processes[k]
        ]
        if not problems:
            problems += [f"orphan engine process {pid}" for pid in self.orphans()]
        return problems

    def where(self) -> dict[tuple[str, int], str]:
        """(instance id, rank) -> the node the controller placed it on."""
        return {(i.instance_id, e.dp_rank): e.node_id for i in self.instances().values() for e in i.engines}

    def busiest_node(self) -> str:
        counts = collections.Counter(self.where().values())
        return max(sorted(counts), key=counts.get)


def engine_port_base() -> int:
    """Engine ports of its own for each run (3,500 from this base: three nodes and the claimants of
    the node id rows), so that two chaos runs on one machine seldom meet on a port."""
    return 36000 + 4000 * (os.getpid() % 6)
