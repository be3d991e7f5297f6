"""`motorctl up` on a controller port another process holds: it fails naming the port and the
holder, and starts nothing against whatever answers there (a health check answered by another
cluster's controller passes just as well as its own)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from motor.ports import free_port
from motorctl.cluster_processes import ManagedProcess, PortTaken, check_answered_by
from motorctl.local_cluster import LocalCluster
from motorctl.port_holder import listening_pids
from tests.support.motorctl_up import run_motorctl_up

# Another "controller": a real gRPC server whose health check answers SERVING, as one would.
OTHER_CONTROLLER = """
import sys, time, grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("serving", flush=True)
time.sleep(600)
"""


@pytest.fixture
def other_controller():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", OTHER_CONTROLLER, str(port)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "serving"
    yield port, process.pid
    process.kill()
    process.wait()


def test_motorctl_up_on_a_taken_controller_port_fails_naming_the_port_and_its_holder(tmp_path, other_controller):
    port, holder = other_controller
    run_dir = tmp_path / "run"
    result = run_motorctl_up(run_dir, "--controller-port", str(port), "--metrics-port", "0")
    assert result.returncode == 2, result.stdout
    assert f"controller port {port} is taken by pid {holder}" in result.stderr, result.stderr
    assert "--controller-port" in result.stderr
    started = sorted(os.listdir(run_dir / "logs")) if (run_dir / "logs").exists() else []
    assert started == [], f"processes were started against the other cluster: {started}"


def test_a_local_cluster_never_takes_another_controller_for_its_own(tmp_path, other_controller):
    port, holder = other_controller
    cluster = LocalCluster(str(tmp_path / "run"), nodes=1, controller_port=port, metrics_port=0)
    try:
        with pytest.raises(PortTaken, match=f"controller port {port} is taken by pid {holder}"):
            cluster.start(timeout=30)
        assert [p.name for p in cluster.processes] == [], "nothing may start against the other controller"
    finally:
        assert cluster.stop() == []


def test_a_controller_answering_on_the_port_is_accepted_only_when_it_is_the_process_started(tmp_path, other_controller):
    """The check after the health check: the port taken between the free-port check and the bind."""
    port, holder = other_controller
    log = tmp_path / "controller.log"
    log.write_text("address already in use\n")
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(PortTaken, match=f"answered by pid {holder} .*not by this cluster's controller"):
            check_answered_by(ManagedProcess("controller", ours, str(log)), port)
    finally:
        ours.kill()
        ours.wait()
    check_answered_by(ManagedProcess("controller", FakePid(holder), str(log)), port)  # its own: accepted


class FakePid:
    def __init__(self, pid: int):
        self.pid = pid


def test_a_port_not_named_that_is_taken_is_replaced_by_a_free_one(tmp_path, other_controller):
    """`motorctl up` without --controller-port: 50051 taken at the moment its controller starts
    (another cluster starting at the same time) means another port, never the other cluster."""
    port, holder = other_controller
    cluster = LocalCluster(
        str(tmp_path / "run"), nodes=1, controller_port=port, any_free_controller_port=True, metrics_port=0
    )
    try:
        cluster.start(timeout=60)
        assert cluster.controller_port != port
        assert cluster.process("controller").process.pid in listening_pids(cluster.controller_port)
        assert holder not in listening_pids(cluster.controller_port)
    finally:
        assert cluster.stop() == []
