"""Every way `motorctl up` ends stops the cluster and leaves no process behind: the terminal
closed (SIGHUP), stdout gone (`motorctl up | tee log`, then Ctrl-C), the controller dying while
the nodes register. A closed pipe ends any motorctl command quietly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from motor.ports import free_port
from tests.support import REPO_ROOT, process_alive, wait_for
from tests.support.motorctl_up import (
    assert_nothing_left,
    cluster_processes,
    kill_all,
    motorctl_up_argv,
    run_motorctl_up,
    start_motorctl_up,
    up_env,
)


def screen_argv(run_dir, program: list[str] | None = None) -> list[str]:
    """`motorctl up` refreshing its screen every 0.3 s, on ports of its own."""
    # Not 9471 for /metrics: tests run side by side.
    flags = ["--controller-port", "0", "--refresh", "0.3", "--metrics-port", str(free_port())]
    return motorctl_up_argv(run_dir, *flags, program=program)


def motorctl_up(run_dir, stdout, prefix: list[str] | None = None) -> subprocess.Popen:
    return start_motorctl_up(screen_argv(run_dir, prefix), stdout)


def wait_first_screen(process: subprocess.Popen, run_dir) -> list[psutil.Process]:
    """Read motorctl up's output until its first status screen; then wait for the 3 engines."""
    deadline = time.monotonic() + 180
    for line in process.stdout:
        if "Ctrl-C stops the cluster." in line or time.monotonic() > deadline:
            break
    assert process.poll() is None, f"motorctl up ended early: {process.stderr.read()}"

    def engines():
        tree = cluster_processes(run_dir)
        return tree if sum(1 for p in tree if "engine_server" in " ".join(p.cmdline()[:3])) >= 3 else None

    return wait_for(engines, timeout=180, interval=0.3, what="3 engines started by motorctl up")


@pytest.mark.parametrize("how", ["sighup", "ctrl_c_after_the_reader_of_stdout_went_away"])
def test_motorctl_up_stops_the_cluster_however_it_ends(tmp_path, how):
    run_dir = tmp_path / "run"
    process = motorctl_up(run_dir, subprocess.PIPE)
    try:
        wait_first_screen(process, run_dir)
        if how == "sighup":
            process.send_signal(signal.SIGHUP)
        else:  # `motorctl up | tee log`, then Ctrl-C: the signal reaches both at once
            process.send_signal(signal.SIGINT)
            process.stdout.close()
        _, errors = process.communicate(timeout=90)
        assert process.returncode == 0, errors
        assert "Traceback" not in errors, errors
        assert_nothing_left(run_dir)
    finally:
        kill_all(process, run_dir)


def test_motorctl_up_whose_reader_goes_away_stops_the_cluster_and_ends_with_141(tmp_path):
    """`motorctl up | head -c 300`: head exits after its bytes; nothing else would ever stop the
    cluster (no screen, no Ctrl-C to give), so the closed pipe does, and the exit is SIGPIPE's."""
    run_dir = tmp_path / "run"
    pipeline = (
        " ".join(f"'{a}'" for a in screen_argv(run_dir)) + ' | head -c 300 >/dev/null; echo "exit ${PIPESTATUS[0]}"'
    )
    try:
        result = subprocess.run(
            ["bash", "-c", pipeline],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=180,
            env=up_env(),
        )
        assert result.stdout.strip() == "exit 141", (result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert_nothing_left(run_dir)
    finally:
        for p in cluster_processes(run_dir):
            p.kill()


def test_a_controller_that_exits_at_start_is_named_at_once_with_its_own_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel: sim-tiny\ninstance_groups: 5\n")
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_motorctl_up(run_dir, "--controller-port", "0", "--metrics-port", "0", deployment=str(bad))
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert took < 30, f"took {took:.0f}s"  # not the 60 s wait for a port nobody will serve
    assert "the controller exited with code 2 at start: " in result.stderr and "instance_groups" in result.stderr, (
        result.stderr
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert_nothing_left(run_dir)


# motorctl up whose controller is killed while the node managers register (ListNodes: UNAVAILABLE).
CONTROLLER_DIES = """
import json, os, signal, sys
from motorctl import cli, up
original = up.LocalCluster.wait_nodes_registered
def controller_dies(self, count, timeout):
    with open(os.environ["PIDS_FILE"], "w") as handle:
        json.dump([p.process.pid for p in self.processes], handle)
    os.kill(self.process("controller").process.pid, signal.SIGKILL)
    return original(self, count, timeout)
up.LocalCluster.wait_nodes_registered = controller_dies
sys.exit(cli.main())
"""


def test_motorctl_up_stops_the_nodes_when_its_controller_dies_during_start_up(tmp_path):
    pids_file = tmp_path / "pids.json"
    os.environ["PIDS_FILE"] = str(pids_file)
    try:
        process = motorctl_up(tmp_path / "run", subprocess.DEVNULL, prefix=[sys.executable, "-c", CONTROLLER_DIES])
    finally:
        del os.environ["PIDS_FILE"]
    try:
        _, errors = process.communicate(timeout=120)
    finally:
        kill_all(process, tmp_path / "run")
    assert process.returncode == 1, errors
    assert "Traceback" not in errors, errors
    assert "motorctl up: the controller at 127.0.0.1:" in errors and "stopped answering (UNAVAILABLE" in errors
    pids = json.loads(pids_file.read_text())
    assert len(pids) == 2  # the controller and node-a
    assert not [pid for pid in pids if process_alive(pid)]


def test_a_closed_pipe_ends_a_motorctl_command_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # `motorctl ... | head` once head has gone
    try:
        result = subprocess.run(
            [sys.executable, "-m", "motorctl.cli", "--controller", "127.0.0.1:1", "--help"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr


def running(run_dir, *programs: str) -> list[psutil.Process]:
    """The cluster's live processes whose command (its first three words) names one of
    `programs`, each once (a node manager's later flags name engine_server too)."""
    found = {}
    for p in cluster_processes(run_dir):
        try:
            if any(program in " ".join(p.cmdline()[:3]) for program in programs):
                found[p.pid] = p
        except psutil.Error:  # a zombie
            pass
    return list(found.values())


def services_of(run_dir) -> set[int]:
    """Pids of the cluster's controller and node managers."""
    return {p.pid for p in running(run_dir, "motor-controller", "motor-node-manager")}


def engines_of(run_dir) -> list[psutil.Process]:
    return running(run_dir, "engine_server")


def test_a_killed_motorctl_up_is_stopped_by_its_guardian_and_its_run_dir_is_not_wiped_under_it(tmp_path):
    """kill -9 of `motorctl up` (the OOM killer) leaves nothing running: its guardian stops the
    cluster. Before that, a second `motorctl up` on the same run dir refuses to wipe it."""
    run_dir = tmp_path / "run"
    process = motorctl_up(run_dir, subprocess.PIPE)
    try:
        wait_first_screen(process, run_dir)
        # The controller and node managers (engines may be restarted meanwhile on a loaded machine).
        before = services_of(run_dir)
        second = motorctl_up(run_dir, subprocess.DEVNULL)
        _, errors = second.communicate(timeout=60)
        assert second.returncode == 2, errors
        assert f"--run-dir {run_dir} is in use by a running cluster" in errors and "motorctl down" in errors, errors
        assert before and before <= services_of(run_dir)  # the first cluster untouched
        assert os.path.exists(run_dir / "node-a" / "node_manager.lock")
        process.kill()  # SIGKILL: motorctl up cannot stop anything itself
        process.wait(10)
        assert_nothing_left(run_dir, timeout=90)
        assert "motorctl up ended without stopping the cluster" in (run_dir / "logs" / "guardian.log").read_text()
    finally:
        kill_all(process, run_dir)


def test_motorctl_down_stops_a_cluster_whose_motorctl_up_and_guardian_are_gone(tmp_path):
    run_dir = tmp_path / "run"
    process = motorctl_up(run_dir, subprocess.PIPE)
    try:
        wait_first_screen(process, run_dir)
        guardian = running(run_dir, "motorctl.guardian")
        assert len(guardian) == 1
        guardian[0].kill()
        process.kill()
        process.wait(10)
        assert engines_of(run_dir)  # nothing stops them by itself now
        down = subprocess.run(
            [sys.executable, "-m", "motorctl.cli", "down", "--run-dir", str(run_dir)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        )
        assert down.returncode == 0, down.stderr
        assert "motor-controller" in down.stdout and "engine_server" in down.stdout, down.stdout
        assert_nothing_left(run_dir)
    finally:
        kill_all(process, run_dir)


def test_motorctl_up_stops_the_engines_of_a_node_manager_that_died(tmp_path):
    """A node manager killed while its engines run (they outlive it by design) cannot stop them:
    `motorctl up` stops them itself and says so, instead of "no process left behind"."""
    run_dir = tmp_path / "run"
    process = motorctl_up(run_dir, subprocess.PIPE)
    try:
        wait_first_screen(process, run_dir)
        node_manager = running(run_dir, "motor-node-manager")
        assert len(node_manager) == 1
        orphans = {p.pid for p in engines_of(run_dir)}
        node_manager[0].kill()
        wait_for(
            lambda: not node_manager[0].is_running() or node_manager[0].status() == psutil.STATUS_ZOMBIE,
            timeout=10,
            what="the node manager dead",
        )  # a zombie until motorctl up reaps it
        assert {p.pid for p in engines_of(run_dir)} == orphans  # still running, re-parented
        process.send_signal(signal.SIGINT)
        output, errors = process.communicate(timeout=120)
        assert "no process left behind" not in output, output
        for pid in orphans:
            assert f"left-over process {pid} (" in output, output
        assert_nothing_left(run_dir)
    finally:
        kill_all(process, run_dir)
