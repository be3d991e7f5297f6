"""`motorctl up` run as a user runs it: its command line (the example deployment, the run
directory, then the test's own flags), from the repository's root with this tree on the path."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import psutil

from motor.v1 import controller_pb2_grpc
from motorctl.run_processes import run_processes
from tests.support import REPO_ROOT, wait_for

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


def motorctl_up_argv(
    run_dir, *flags: str, deployment: str = DEPLOYMENT, nodes: int = 1, program: list[str] | None = None
) -> list[str]:
    """`motorctl up` (or `program`, a stand-in for `motorctl`) of `nodes` node managers."""
    motorctl = program or [sys.executable, "-m", "motorctl.cli"]
    return [*motorctl, "up", "--nodes", str(nodes), "--deployment", str(deployment), "--run-dir", str(run_dir), *flags]


def up_env() -> dict[str, str]:
    """The environment `motorctl up` runs in: this tree's packages first."""
    return dict(os.environ, PYTHONPATH=REPO_ROOT)


def run_motorctl_up(run_dir, *flags: str, deployment: str = DEPLOYMENT, timeout: float = 120):
    """`motorctl up` to its end (one that fails at start), its output captured."""
    return subprocess.run(
        motorctl_up_argv(run_dir, *flags, deployment=deployment),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=up_env(),
    )


def start_motorctl_up(
    argv: list[str], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`argv` (a `motorctl up` command line) started in a session of its own from the repository's
    root, its output text; `env`: up_env() unless given."""
    return subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=True,
        env=env if env is not None else up_env(),
    )


def until_controller_answers(
    process: subprocess.Popen, address: str, read, what: str, timeout: float = 120, interval: float = 0.3
):
    """What `read(stub)` gives (a ControllerService stub on `address`) once it gives something; an
    RPC error is no answer yet, and `motorctl up` (`process`, its stderr piped) ending fails."""
    with grpc.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)

        def answered():
            assert process.poll() is None, f"motorctl up ended: {process.stderr.read()}"
            try:
                return read(stub)
            except grpc.RpcError:
                return None

        return wait_for(answered, timeout=timeout, interval=interval, what=what)


def cluster_processes(run_dir) -> list[psutil.Process]:
    """The controller and node managers of the cluster in `run_dir` (their flags name it), with
    everything they started."""
    found = run_processes(str(run_dir))  # by the run tag: the router's command line does not name it
    for p in psutil.process_iter():
        try:
            if any(str(run_dir) in part for part in p.cmdline()):
                found += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    return found


def assert_nothing_left(run_dir, timeout: float = 10) -> None:
    def gone():
        return not [p for p in cluster_processes(run_dir) if p.status() != psutil.STATUS_ZOMBIE]

    wait_for(gone, timeout=timeout, what="the cluster's processes gone")


def kill_all(process: subprocess.Popen, run_dir) -> None:
    if process.poll() is None:
        process.kill()
    for p in cluster_processes(run_dir):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
