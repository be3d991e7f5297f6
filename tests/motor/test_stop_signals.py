"""SIGHUP (a closed terminal, or a supervisor) stops the controller and the node manager the way
SIGTERM does, saying so, instead of killing them silently (its default action; found by a
hostile tester); stop signals repeated in quick succession do not kill a service that is
stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from motor.ports import free_port
from tests.support import wait_for

pytestmark = pytest.mark.processes

BIN = os.path.dirname(sys.executable)


def controller(tmp_path) -> tuple[list[str], str]:
    return (
        [
            os.path.join(BIN, "motor-controller"),
            "--listen",
            "127.0.0.1:0",
            "--db",
            str(tmp_path / "controller.db"),
            "--metrics-port",
            "0",
        ],
        str(tmp_path / "controller.port"),
    )


def node_manager(tmp_path) -> tuple[list[str], str]:
    # Nothing listens at its controller: it serves while it retries the registration.
    return (
        [
            os.path.join(BIN, "motor-node-manager"),
            "--node-id",
            "node-h",
            "--listen",
            "127.0.0.1:0",
            "--controller",
            f"127.0.0.1:{free_port()}",
            "--host",
            "127.0.0.1",
            "--state-dir",
            str(tmp_path),
            "--metrics-port",
            "0",
        ],
        str(tmp_path / "node_manager.port"),
    )


@pytest.mark.parametrize("service", [controller, node_manager])
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signal_stops_the_service_gracefully_and_says_which(tmp_path, service, sig):
    argv, port_file = service(tmp_path)
    log_path = tmp_path / "service.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(
            lambda: os.path.exists(port_file) or proc.poll() is not None, timeout=60, what="the service's port file"
        )
        assert proc.poll() is None, log_path.read_text()
        proc.send_signal(sig)
        for _ in range(5):  # more in quick succession: the stop goes on (they killed it once its loop closed)
            time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(sig)
        code = proc.wait(30)
        log = log_path.read_text()
        assert code == 0, log
        assert f"{sig.name} received: stopping" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
