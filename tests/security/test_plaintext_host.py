"""A node manager's engines serve on its --host with its TLS settings: a non-loopback --host
without TLS (and without --insecure) is refused when the node manager starts, naming `host`,
instead of every engine exiting 2 later (each exit spent against the crash-loop budget)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support import wait_for
from tests.support.node_manager_harness import node_manager_process

pytestmark = pytest.mark.processes


def test_a_non_loopback_host_without_tls_is_refused_at_start(tmp_path):
    process = node_manager_process(
        tmp_path, "--node-id", "node-a", "--host", "192.0.2.2", "--controller", "127.0.0.1:1", "--metrics-port", "0"
    )
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert "host: 192.0.2.2" in output and "is not a loopback address and TLS is off" in output, output
    assert "--tls-cert" in output and "--insecure" in output, output
    assert "Traceback" not in output, output


def test_with_insecure_it_starts_and_warns(tmp_path):
    process = node_manager_process(
        tmp_path,
        "--node-id",
        "node-a",
        "--host",
        "192.0.2.2",
        "--controller",
        "127.0.0.1:1",
        "--metrics-port",
        "0",
        "--insecure",
    )
    try:
        port_file = tmp_path / "node" / "node_manager.port"
        wait_for(lambda: port_file.exists() or process.poll() is not None, timeout=60, what="the node manager serving")
        assert process.poll() is None
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert "INSECURE" in output and "192.0.2.2" in output, output
