"""A TLS mismatch between motorctl and a real controller is named as such, with the flags to
change, in both directions (it read "not reachable (... Socket closed)")."""

from __future__ import annotations

import pytest

from tests.support.controller_process import ControllerProcess, motorctl

pytestmark = pytest.mark.processes


@pytest.fixture
def tls_controller(tmp_path, dev_pki):
    proc = ControllerProcess(
        tmp_path,
        "--tls-cert",
        dev_pki.cert("controller"),
        "--tls-key",
        dev_pki.key("controller"),
        "--tls-ca",
        dev_pki.ca,
    )
    proc.start = _start_tls(proc, dev_pki)
    proc.start()
    yield proc
    proc.stop()
    proc.log.close()


def _start_tls(proc, dev_pki):
    """ControllerProcess.start, waiting for the port file only: its serving check speaks plaintext."""
    import os
    import subprocess

    from tests.support import wait_for

    def start():
        port_file = os.path.join(os.path.dirname(proc.db), "controller.port")
        proc.process = subprocess.Popen(proc.argv, stdout=proc.log, stderr=subprocess.STDOUT, start_new_session=True)
        port = wait_for(lambda: os.path.exists(port_file) and open(port_file).read().strip(), timeout=30, what="port")
        proc.address = f"localhost:{port}"

    return start


@pytest.fixture
def plaintext_controller(tmp_path):
    proc = ControllerProcess(tmp_path)
    proc.start()
    yield proc
    proc.stop()
    proc.log.close()


def test_plaintext_motorctl_against_a_tls_controller_is_told_to_give_the_tls_flags(tls_controller, dev_pki):
    result = motorctl(tls_controller.address, "--timeout", "5", "nodes", check=False)
    assert result.returncode == 1
    assert "speaks TLS" in result.stderr and "--cacert" in result.stderr and "--cert" in result.stderr, result.stderr
    assert "Socket closed" not in result.stderr
    creds = ("--cacert", dev_pki.ca, "--cert", dev_pki.cert("operator"), "--key", dev_pki.key("operator"))
    assert "NODE" in motorctl(tls_controller.address, *creds, "nodes").stdout  # the flags named are the fix


def test_tls_motorctl_against_a_plaintext_controller_is_told_it_speaks_plaintext(plaintext_controller, dev_pki):
    creds = ("--cacert", dev_pki.ca, "--cert", dev_pki.cert("operator"), "--key", dev_pki.key("operator"))
    result = motorctl(plaintext_controller.address, "--timeout", "5", *creds, "nodes", check=False)
    assert result.returncode == 1
    assert "speaks plaintext" in result.stderr and "--cacert" in result.stderr, result.stderr
    assert "NODE" in motorctl(plaintext_controller.address, "nodes").stdout


def test_nothing_listening_is_still_not_reachable(tmp_path):
    from motor.ports import free_port

    result = motorctl(f"127.0.0.1:{free_port()}", "--timeout", "2", "nodes", check=False)
    assert result.returncode == 1 and "is not reachable" in result.stderr and "TLS" not in result.stderr
