"""A second node manager process claiming a live node's id, and what the cluster's log says of its refusals."""

from __future__ import annotations

import os

from motor.ports import free_port
from motorctl.cluster_processes import ManagedProcess
from tests.support.process_cluster import GRACE, HEARTBEAT, Cluster, apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)

REFUSED = "is held by another live node manager"


def start_second(
    cluster: Cluster,
    node_id: str = "node-a",
    certificate: str | None = None,
    name: str = "second",
    engine_ports_from: int | None = None,
) -> tuple[ManagedProcess, int]:
    """A second node manager for `node_id`, started as the cluster starts its own (`node_command`)
    but with its own --listen, --state-dir (<node id>-<name>), /metrics port and engine ports (500
    from `engine_ports_from`); under TLS presenting `certificate`'s pair of the
    cluster's PKI, by default the node id's own."""
    port = free_port()
    first_engine_port = engine_ports_from or cluster.engine_port_base + 2000
    own = {
        "--port-range": f"{first_engine_port}-{first_engine_port + 499}",
        "--state-dir": os.path.join(cluster.run_dir, f"{node_id}-{name}"),
        "--metrics-port": "0",  # the first node manager's port is taken
    }
    tls = cluster.tls_flags(certificate or node_id)
    own.update(zip(tls[::2], tls[1::2]))
    argv = cluster.node_command(node_id, 0, port)
    for flag, value in own.items():
        argv[argv.index(flag) + 1] = value
    managed = cluster._launch(node_id if name == "second" else f"{node_id}-{name}", argv)
    cluster.wait_serving(f"127.0.0.1:{port}", 30, cluster.credentials())
    return managed, port


def log_of(managed: ManagedProcess) -> str:
    with open(managed.log_path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def refused_so_far(cluster: Cluster) -> int:
    """Refused registrations of the conflict under way, from its ListNodes alarm."""
    for alarm in cluster.node_list().alarms:
        if "claimed by two live node managers" in alarm:
            return int(alarm.split(": ", 1)[1].split(" ", 1)[0])
    return 0
