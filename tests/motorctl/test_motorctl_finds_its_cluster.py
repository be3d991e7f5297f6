"""motorctl commands reach the cluster they belong to: `motorctl up` writes `<run dir>/motorctl.env`
(its address, and its operator's credentials under TLS), removed when the cluster stops; without
--controller, motorctl reads MOTOR_CONTROLLER, else ./.run/motorctl.env, else localhost:50051; the
screen prints the line that points another shell at this cluster."""

from __future__ import annotations

import os
from types import SimpleNamespace

from motorctl import cluster_address, run_processes
from motorctl.cli import main as motorctl
from motorctl.connect import Credentials
from motorctl.door_access import DoorAccess
from motorctl.up_screen import try_commands


def test_the_order_is_the_environment_then_the_run_dir_here_then_localhost(tmp_path):
    assert cluster_address.find({}, str(tmp_path)) == cluster_address.Found("localhost:50051", "the default")
    os.makedirs(tmp_path / ".run")
    cluster_address.write(str(tmp_path / ".run"), ["127.0.0.1:50251"])
    assert cluster_address.find({}, str(tmp_path)).controller == "127.0.0.1:50251"
    assert cluster_address.find({}, str(tmp_path)).source == ".run/motorctl.env"
    chosen = cluster_address.find({"MOTOR_CONTROLLER": "127.0.0.1:50999"}, str(tmp_path))
    assert (chosen.controller, chosen.source, chosen.credentials) == ("127.0.0.1:50999", "env MOTOR_CONTROLLER", {})


def test_the_env_file_carries_the_tls_credentials_and_loads_into_a_shell(tmp_path):
    credentials = Credentials(ca="pki/ca.pem", cert="pki/operator.pem", key="pki/operator-key.pem")
    path = cluster_address.write(str(tmp_path), ["127.0.0.1:1", "127.0.0.1:2"], credentials)
    values = cluster_address.read(path)
    assert values["MOTOR_CONTROLLER"] == "127.0.0.1:1,127.0.0.1:2"
    assert values["MOTOR_CACERT"] == os.path.abspath("pki/ca.pem") and values["MOTOR_KEY"].endswith("operator-key.pem")
    assert all(line.startswith("export MOTOR_") for line in open(path).read().splitlines())


def test_motorctl_without_controller_uses_the_run_dir_here_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MOTOR_CONTROLLER", raising=False)
    for variable in cluster_address.CREDENTIAL_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    os.makedirs(tmp_path / ".run")
    cluster_address.write(str(tmp_path / ".run"), ["127.0.0.1:9"])  # the discard port: nothing answers
    monkeypatch.chdir(tmp_path)
    assert motorctl(["--timeout", "1", "instances"]) == 1
    assert "controller 127.0.0.1:9 (from .run/motorctl.env) is not reachable" in capsys.readouterr().err


def test_a_stopped_cluster_leaves_no_address_behind(tmp_path):
    cluster_address.write(str(tmp_path), ["127.0.0.1:50251"])
    run_processes.stop_run(str(tmp_path), timeout=1)  # `motorctl down`, the guardian
    assert not os.path.exists(cluster_address.env_file(str(tmp_path)))
    cluster_address.forget(str(tmp_path))  # twice is fine


def fake_cluster(run_dir: str, tls: bool = False) -> SimpleNamespace:
    credentials = Credentials(ca="ca.pem", cert="op.pem", key="op-key.pem") if tls else Credentials()
    pki = SimpleNamespace(
        ca="ca.pem", cert=lambda who: f"{who}.pem", key=lambda who: f"{who}-key.pem", directory="pki",
        token_file=lambda who: f"{who}.token",
    )  # fmt: skip
    return SimpleNamespace(
        run_dir=run_dir,
        tls=tls,
        ha=False,
        pki=pki,
        token_port=1,
        controller_address="127.0.0.1:50251",
        controller_addresses=["127.0.0.1:50251"],
        credentials=lambda who="operator": credentials,
        router_port=None,
        door_access=DoorAccess(),
    )


def test_the_screen_prints_the_line_that_points_another_shell_at_this_cluster(tmp_path):
    text = try_commands(fake_cluster(str(tmp_path / "mine")))
    assert "export MOTOR_CONTROLLER=127.0.0.1:50251" in text
    assert "finds .run/motorctl.env by itself" not in text  # not the run dir of the current directory
    tls = try_commands(fake_cluster(str(tmp_path / "mine"), tls=True))
    assert f". {tmp_path / 'mine' / 'motorctl.env'}" in tls
