"""A real motor-controller process on a temporary store, and motorctl run against it."""

from __future__ import annotations

import os
import signal
import subprocess

from motor.ports import free_port
from motorctl.cluster_processes import script_path
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.controller_harness import EXAMPLE

# A lone controller on a new store: the file is applied at once (--startup-grace 0), not after the
# grace it otherwise leaves node managers that run engines to register (test_startup_deployment.py).
AT_ONCE = ("--deployment", EXAMPLE, "--startup-grace", "0")


def motorctl(address: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [script_path("motorctl"), "--controller", address, *args], capture_output=True, text=True, timeout=60
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


class ControllerProcess:
    def __init__(self, tmp_path, *args: str):
        self.db = str(tmp_path / "state" / "controller.db")
        self.metrics_port = free_port()
        self.argv = [
            script_path("motor-controller"),
            "--listen",
            "127.0.0.1:0",
            "--db",
            self.db,
            "--metrics-port",
            str(self.metrics_port),
            *args,
        ]
        self.log = open(tmp_path / "controller.log", "ab")
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        port_file = os.path.join(os.path.dirname(self.db), "controller.port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        self.process = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        port = wait_for(
            lambda: os.path.exists(port_file) and open(port_file).read().strip(), timeout=30, what="port file"
        )
        self.address = f"127.0.0.1:{port}"
        LocalCluster.wait_serving(self.address, 30)
        return self.address

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
