"""`motorctl up --accelerator-type cpu --model-root DIR`, for real: the node managers it starts
register with this host's CPU cores as their accelerators and announce the model root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc

from motor.ports import free_port
from motor.v1 import controller_pb2, controller_pb2_grpc
from tests.support import REPO_ROOT, wait_for
from tests.support.motorctl_up import assert_nothing_left, kill_all

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


def test_node_managers_get_the_hosts_cores_and_the_model_roots(tmp_path):
    run_dir, models = tmp_path / "run", tmp_path / "models"
    models.mkdir()
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "motorctl.cli",
            "up",
            "--nodes",
            "1",
            "--deployment",
            DEPLOYMENT,
            "--run-dir",
            str(run_dir),
            "--controller-port",
            str(port),
            "--metrics-port",
            "0",
            "--router-port",
            str(free_port()),
            "--accelerator-type",
            "cpu",
            "--model-root",
            str(models),
        ],  # fmt: skip
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)

            def registered():
                assert process.poll() is None, f"motorctl up ended: {process.stderr.read()}"
                try:
                    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=2).nodes
                except grpc.RpcError:
                    return None
                return nodes[0].info if nodes else None

            info = wait_for(registered, timeout=120, interval=0.3, what="node-a registered")
        assert info.node_id == "node-a" and info.accelerator_type == "cpu"
        assert list(info.accelerator_ids) == sorted(os.sched_getaffinity(0))
        assert list(info.model_roots) == [str(models)]
        process.send_signal(signal.SIGINT)  # maybe before its router is up: the stop is the same
        process.wait(timeout=120)
        assert_nothing_left(run_dir)
    finally:
        kill_all(process, run_dir)
