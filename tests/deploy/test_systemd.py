"""The systemd units for plain hosts (deploy/systemd, docs/hosts.md), checked by systemd itself:
`systemd-analyze verify` on each unit, as installed, in a scratch root (--root) holding the
system's own units and Motor's commands at /opt/motor/bin, where docs/hosts.md installs them;
`systemd-analyze security --offline` for the exposure each unit's hardening leaves. And what
systemd cannot know: the flags are the commands' own, every variable a unit reads is in the
environment file, the settings files hold only settings. No unit is started here (no systemd
runs as PID 1 on this machine or CI's): docs/hosts.md says what was run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from motorctl.router import FAILOVER_FLAGS, ROUTING_POLICY
from tests.support import require
from tests.support.deploy_tools import UNITS_DIR, entry_points, exec_start, parse_unit, unknown_flags, unknown_settings

pytestmark = pytest.mark.processes  # runs systemd-analyze and the services' --help

SERVICES = sorted(f for f in os.listdir(UNITS_DIR) if f.endswith(".service"))
UNITS = SERVICES + sorted(f for f in os.listdir(UNITS_DIR) if f.endswith(".target"))
INSTALL_BIN = "/opt/motor/bin"
SYSTEM_UNITS = "/usr/lib/systemd/system"
# systemd-analyze security's exposure (0 to 10, lower is safer) that no unit may exceed. The
# node manager's is the highest (1.9): its engines need the GPUs' device nodes and write code.
MAX_EXPOSURE = 2.0


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    require(
        found is not None and os.path.isdir(SYSTEM_UNITS),
        "systemd-analyze (Debian's systemd package: scripts/systemd-tools.sh)",
    )
    return found


def scratch_root(path, units=UNITS, commands=None, text_of=None) -> str:
    """A root with the system's units, ours in /etc/systemd/system and the commands they run in
    /opt/motor/bin (the package's entry points; what `pip install` puts there)."""
    root = str(path)
    shutil.copytree(SYSTEM_UNITS, os.path.join(root, SYSTEM_UNITS.lstrip("/")), symlinks=True)
    etc = os.path.join(root, "etc", "systemd", "system")
    os.makedirs(etc)
    for unit in units:
        target = os.path.join(etc, unit)
        if text_of and unit in text_of:
            with open(target, "w") as handle:
                handle.write(text_of[unit])
        else:
            shutil.copy(os.path.join(UNITS_DIR, unit), target)
    bin_dir = os.path.join(root, INSTALL_BIN.lstrip("/"))
    os.makedirs(bin_dir)
    for command in entry_points() if commands is None else commands:
        executable = os.path.join(bin_dir, command)
        with open(executable, "w") as handle:
            handle.write("#!/bin/sh\n")
        os.chmod(executable, 0o755)
    return root


def verify(root: str, unit: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [systemd_analyze(), "verify", f"--root={root}", unit], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    systemd_analyze()
    return scratch_root(tmp_path_factory.mktemp("root"))


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify_finds_nothing_to_say(root, unit):
    done = verify(root, unit)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_verify_speaks_up_about_a_wrong_directive_and_a_missing_command(tmp_path):
    """So that the silence above means something: a misspelt key is named, a command that is not
    installed fails."""
    unit = "motor-controller.service"
    with open(os.path.join(UNITS_DIR, unit)) as handle:
        text = handle.read()
    misspelt = scratch_root(tmp_path / "a", [unit], text_of={unit: text.replace("NoNewPrivileges=", "NoNewPrivilege=")})
    done = verify(misspelt, unit)
    assert "Unknown key 'NoNewPrivilege'" in done.stderr
    missing = scratch_root(tmp_path / "b", [unit], commands=[])
    done = verify(missing, unit)
    assert done.returncode != 0 and f"{INSTALL_BIN}/motor-controller" in done.stderr


@pytest.mark.parametrize("unit", SERVICES)
def test_each_services_exposure_stays_low(root, unit):
    threshold = f"--threshold={int(MAX_EXPOSURE * 10)}"
    done = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", f"--root={root}", threshold, unit],
        capture_output=True,
        text=True,
        timeout=120,
    )
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    assert exposure, done.stdout + done.stderr
    assert done.returncode == 0 and float(exposure[1]) <= MAX_EXPOSURE, done.stdout[-2000:]


@pytest.mark.parametrize("unit", SERVICES)
def test_every_service_runs_unprivileged_and_hardened(unit):
    service = parse_unit(unit)["Service"]
    assert service.get("User", [""])[0] == "motor" or service.get("DynamicUser") == ["yes"], unit
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
        "SystemCallArchitectures": "native",
    }.items():
        assert service.get(key) == [value], f"{unit}: {key}={service.get(key)}"
    assert "@system-service" in service["SystemCallFilter"]
    assert service["Type"] == ["exec"]  # a command that cannot start fails the start, not later


@pytest.mark.parametrize("unit", SERVICES)
def test_each_unit_runs_an_installed_command_with_flags_it_has(unit):
    argv = exec_start(unit)
    assert os.path.dirname(argv[0]) == INSTALL_BIN and os.path.basename(argv[0]) in entry_points()
    assert not unknown_flags(argv), f"{unit}: not flags of {argv[0]}"


def test_every_variable_a_unit_reads_is_in_the_environment_file():
    with open(os.path.join(UNITS_DIR, "motor.env")) as handle:
        defined = {line.split("=", 1)[0] for line in handle if re.match(r"[A-Z_]+=", line)}
    for unit in SERVICES:
        service = parse_unit(unit)["Service"]
        used = set(re.findall(r"\$\{([A-Z_]+)\}", service["ExecStart"][0]))
        if used:
            assert service["EnvironmentFile"] == ["/etc/motor/motor.env"], unit
        assert used <= defined, f"{unit}: {used - defined} not in motor.env"


def test_the_settings_files_hold_only_the_services_settings():
    for file, command in (("controller.yaml", "motor-controller"), ("node-manager.yaml", "motor-node-manager")):
        with open(os.path.join(UNITS_DIR, file)) as handle:
            keys = yaml.safe_load(handle)
        assert not unknown_settings(keys, command), f"{file}: not settings of {command}"
        assert keys.get("engine_command", "engine_server") in entry_points()


def test_the_node_manager_leaves_its_engines_running_across_a_restart():
    """Engines outlive their node manager and are re-adopted (docs/node-manager.md): systemd must
    signal the node manager only, not every process of the unit."""
    service = parse_unit("motor-node-manager.service")["Service"]
    assert service["KillMode"] == ["process"]
    with open(os.path.join(UNITS_DIR, "node-manager.yaml")) as handle:
        roots = yaml.safe_load(handle)["model_roots"]
    state = {f"/var/lib/{d}" for d in service["StateDirectory"][0].split()}
    assert set(roots) <= state, "the model cache is one of the unit's state directories (writable under ProtectSystem)"


def test_the_router_runs_as_motorctl_up_and_compose_run_it():
    argv = exec_start("motor-router.service")
    joined = " ".join(argv)
    assert " ".join(ROUTING_POLICY) in joined and " ".join(FAILOVER_FLAGS) in joined
    assert argv[argv.index("--host") + 1] == "127.0.0.1"  # its admin API answers this host only
    door, sync = exec_start("motor-front-door.service"), exec_start("motor-router-sync.service")
    assert door[door.index("--table") + 1] == "127.0.0.1:8079"
    assert sync[sync.index("--front-door-table") + 1] == "http://127.0.0.1:8079"
    assert door[door.index("--router") + 1] == sync[sync.index("--router") + 1] == "http://127.0.0.1:8081"
