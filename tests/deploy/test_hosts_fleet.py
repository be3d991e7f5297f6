"""The plain-host fleet of docs/hosts.md, run as processes on this machine: each systemd unit's
ExecStart (deploy/systemd), its variables from motor.env and the settings files as shipped, with
this machine's paths and free ports in place of /etc/motor, /var/lib/motor and the fixed ports;
one etcd member over mutual TLS (Debian's etcd-server), certificates named as cert-manager names
them. A deployment applied with the operator's certificate serves a completion through the front
door. What this does not run: systemd itself (no init system here) and three hosts."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess

import psutil
import pytest
import yaml

from motor.ports import free_port
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority
from motorctl.etcd_cluster import EtcdCluster, EtcdTls
from tests.support import require, wait_for
from tests.support.deploy_tools import DEPLOYMENT, UNITS_DIR, exec_start, http, parse_unit, venv_tool

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def lay_out_pki(root: str) -> dict[str, str]:
    """One CA; each role's files in <root>/etc/motor/pki/<role>/ as tls.crt, tls.key, ca.crt."""
    ca = CertificateAuthority.create()
    issued = {
        "controller": ca.issue(Identity.parse("controller"), ["127.0.0.1", "localhost"]),
        "node": ca.issue(Identity.parse("node/host-a"), ["127.0.0.1"]),
        "router-sync": ca.issue(Identity.parse("router-sync/router-sync"), []),
        "operator": ca.issue(Identity.parse("operator/operator"), []),
        # The members carry `etcd`, the one name controller.yaml checks (etcd_server_name).
        "etcd": ca.issue(None, ["127.0.0.1", "etcd"]),
    }
    dirs = {}
    for role, leaf in issued.items():
        directory = os.path.join(root, "etc", "motor", "pki", role)
        os.makedirs(directory)
        ca.save(directory)
        leaf.save(directory, "tls")
        os.remove(os.path.join(directory, "ca.key"))
        dirs[role] = directory
    return dirs


def installed(path: str, root: str) -> str:
    """A path of docs/hosts.md's layout, moved under `root`."""
    return path.replace("/etc/motor", f"{root}/etc/motor").replace("/var/lib/motor", f"{root}/var/lib/motor")


def command_of(unit: str, env: dict[str, str], root: str, ports: dict[str, int]) -> list[str]:
    argv = [re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m[1]], a) for a in exec_start(unit)]
    argv = [installed(a, root) for a in argv]
    for fixed, port in ports.items():  # the units' fixed ports, as whole ports only
        argv = [re.sub(rf"(?<=:){fixed}\b|^{fixed}$", str(port), a) for a in argv]
    command = os.path.basename(argv[0])
    tool = venv_tool(command)
    require(tool is not None, f"{command} (make setup)")
    return [tool, *argv[1:]]


def settings_file(name: str, root: str, changes: dict) -> str:
    with open(os.path.join(UNITS_DIR, name)) as handle:
        values = yaml.safe_load(installed(handle.read(), root))
    values.update(changes)
    path = os.path.join(root, "etc", "motor", name)
    with open(path, "w") as handle:
        yaml.safe_dump(values, handle)
    return path


def test_the_units_command_lines_make_a_fleet_that_serves(tmp_path):
    require(shutil.which("etcd") is not None, "etcd (Debian's etcd-server: run scripts/etcd-server.sh)")
    root = str(tmp_path)
    pki = lay_out_pki(root)
    for state in ("node", "models", "controller"):  # the units' StateDirectory=
        os.makedirs(os.path.join(root, "var", "lib", "motor", state))
    ports = {p: free_port() for p in ("50051", "50052", "8079", "8080", "8081", "29000")}
    controller = f"127.0.0.1:{ports['50051']}"
    settings_file("controller.yaml", root, {"metrics_port": 0, "listen": controller})  # listen: 0.0.0.0:50051
    settings_file("node-manager.yaml", root, {"metrics_port": 0})
    etcd = EtcdCluster(
        str(tmp_path / "etcd"),
        size=1,
        tls=EtcdTls(ca=f"{pki['etcd']}/ca.crt", cert=f"{pki['etcd']}/tls.crt", key=f"{pki['etcd']}/tls.key"),
    )
    with open(os.path.join(UNITS_DIR, "motor.env")) as handle:
        env = dict(line.strip().split("=", 1) for line in handle if re.match(r"[A-Z_]+=", line))
    env.update(
        MOTOR_ETCD_MEMBERS=etcd.url.removeprefix("etcd://"),
        MOTOR_CONTROLLERS=controller,
        MOTOR_ADVERTISE=controller,
        MOTOR_NODE_ID="host-a",
        MOTOR_NODE_IP="127.0.0.1",
    )
    operator = ["--controller", controller, "--cacert", f"{pki['operator']}/ca.crt"]
    operator += ["--cert", f"{pki['operator']}/tls.crt", "--key", f"{pki['operator']}/tls.key"]
    motorctl = [venv_tool("motorctl"), *operator]
    started: list[tuple[str, subprocess.Popen]] = []
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(unit: str) -> None:
        process_env = {**os.environ, **env}
        for line in parse_unit(unit)["Service"].get("Environment", []):  # Environment=K=V K=V
            process_env.update(installed(pair, root).split("=", 1) for pair in shlex.split(line))
        argv = command_of(unit, env, root, ports)
        log = open(logs / f"{unit}.log", "w")
        started.append((unit, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=process_env)))

    def detail() -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.iterdir()))

    etcd.start()
    try:
        for unit in (
            "motor-controller.service",
            "motor-node-manager.service",
            "motor-router.service",
            "motor-router-sync.service",
            "motor-front-door.service",
        ):
            start(unit)
        nodes = wait_for(
            lambda: "host-a" in subprocess.run([*motorctl, "nodes"], capture_output=True, text=True).stdout,
            timeout=60,
            interval=0.5,
            what="host-a registered",
            detail=detail,
        )
        assert nodes
        path = tmp_path / "deployment.yaml"
        path.write_text(yaml.safe_dump(DEPLOYMENT))
        subprocess.run([*motorctl, "apply", "-f", str(path)], check=True, capture_output=True, timeout=60)
        door = f"http://127.0.0.1:{ports['8080']}"
        wait_for(
            lambda: [m["id"] for m in http("GET", f"{door}/v1/models")[1].get("data", [])] == ["sim-tiny"],
            timeout=90,
            interval=0.5,
            what="the front door serving sim-tiny",
            detail=detail,
        )
        status, answer = http("POST", f"{door}/v1/completions", {"model": "sim-tiny", "prompt": "hi", "max_tokens": 4})
        assert status == 200 and answer["choices"], answer
        subprocess.run([*motorctl, "delete", "hosts-sim"], check=True, capture_output=True, timeout=60)
        wait_for(
            lambda: "union" not in subprocess.run([*motorctl, "instances"], capture_output=True, text=True).stdout,
            timeout=60,
            interval=0.5,
            what="the engines stopped",
            detail=detail,
        )
    finally:
        for _, process in reversed(started):
            process.send_signal(signal.SIGTERM)
        for _, process in reversed(started):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        etcd.stop()
        # Engines outlive their node manager (KillMode=process): none may be left from this test.
        left = [p for p in psutil.process_iter(["cmdline"]) if any(root in a for a in (p.info["cmdline"] or []))]
        for p in left:
            p.kill()
    assert not left, f"processes left: {[p.info['cmdline'] for p in left]}"
