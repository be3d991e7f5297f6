"""`motorctl up --accelerator-type cpu --model-root DIR`, for real: the node managers it starts
register with this host's CPU cores as their accelerators and announce the model root."""

from __future__ import annotations

import os
import signal

from motor.ports import free_port
from motor.v1 import controller_pb2
from tests.support.motorctl_up import (
    assert_nothing_left,
    kill_all,
    motorctl_up_argv,
    start_motorctl_up,
    until_controller_answers,
)


def test_node_managers_get_the_hosts_cores_and_the_model_roots(tmp_path):
    run_dir, models = tmp_path / "run", tmp_path / "models"
    models.mkdir()
    port = free_port()
    flags = ["--controller-port", str(port), "--metrics-port", "0", "--router-port", str(free_port())]
    flags += ["--accelerator-type", "cpu", "--model-root", str(models)]
    process = start_motorctl_up(motorctl_up_argv(run_dir, *flags))
    try:

        def registered(stub):
            nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=2).nodes
            return nodes[0].info if nodes else None

        info = until_controller_answers(process, f"127.0.0.1:{port}", registered, what="node-a registered")
        assert info.node_id == "node-a" and info.accelerator_type == "cpu"
        assert list(info.accelerator_ids) == sorted(os.sched_getaffinity(0))
        assert list(info.model_roots) == [str(models)]
        process.send_signal(signal.SIGINT)  # maybe before its router is up: the stop is the same
        process.wait(timeout=120)
        assert_nothing_left(run_dir)
    finally:
        kill_all(process, run_dir)
