"""Every listener of the local cluster is on loopback unless asked: the controller's and the node
managers' /metrics (with /discovery/engines, every engine's address: plaintext HTTP) bind
127.0.0.1, as their gRPC ports, the engines, vllm-router (its admin API: add and remove workers,
flush caches), its sync and the front door do: nothing around the door is reachable from
another host."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

from motorctl.local_cluster import LocalCluster
from tests.support import REPO_ROOT

pytestmark = pytest.mark.processes


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process and its children listen on."""
    found = set()
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for connection in process.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN:
                found.add((connection.laddr.ip, connection.laddr.port))
    return found


def on_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_every_listener_of_the_local_cluster_is_on_loopback(tmp_path):
    cluster = LocalCluster(
        str(tmp_path / "run"),
        nodes=1,
        deployment_path=os.path.join(REPO_ROOT, "examples", "local-deployment.yaml"),
        engine_port_base=36000,
        metrics_port=None,  # free ports, on
        router_port=0,  # the front door, vllm-router (its admin API) and the sync: none reachable from elsewhere
    )
    try:
        cluster.start(timeout=90)
        assert set(cluster.metrics_ports) == {"controller", "node-a", "router", "front-door"}
        assert {"router", "router-sync", "front-door"} <= {managed.name for managed in cluster.processes}
        for managed in cluster.processes:
            sockets = listening(managed.process.pid)
            assert sockets or managed.name == "router-sync", managed.name  # (the sync listens on nothing)
            wide = {(ip, port) for ip, port in sockets if not on_loopback(ip)}
            assert not wide, f"{managed.name} listens beyond loopback on {sorted(wide)}"
        assert all(url.startswith("http://127.0.0.1:") for url in cluster.metrics_urls().values())
    finally:
        cluster.stop()
