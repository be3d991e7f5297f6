"""The processes of one local cluster (`motorctl up`), found by a tag in their environment.

Every process `motorctl up` starts (controllers, node managers, etcd members) carries
`MOTOR_LOCAL_RUN_DIR` = the run directory's absolute path, and engines inherit it from their node
manager, as do their own children. The tag is what finds them all when the parent that should
have stopped them is gone: a node manager killed while its engines run, `motorctl up` itself
killed (its guardian, or `motorctl down`, then stops the cluster), and what keeps a second
`motorctl up` from wiping a run directory that a live cluster still uses.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import psutil

from motorctl import cluster_address

RUN_ENV = "MOTOR_LOCAL_RUN_DIR"


def run_tag(run_dir: str) -> dict[str, str]:
    """The environment entry that marks a process as part of the cluster in `run_dir`."""
    return {RUN_ENV: os.path.abspath(run_dir)}


def run_processes(run_dir: str) -> list[psutil.Process]:
    """Live processes of the cluster in `run_dir` (zombies and this process excluded)."""
    wanted = os.path.abspath(run_dir)
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(RUN_ENV) == wanted and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:  # gone meanwhile, or not ours to read
            pass
    return found


def describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} ({' '.join(process.cmdline()[:3])})"
    except psutil.Error:
        return str(process.pid)


def _is_controller(process: psutil.Process) -> bool:
    try:
        return any(os.path.basename(part) == "motor-controller" for part in process.cmdline()[:2])
    except psutil.Error:
        return False


def _signal_all(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        try:
            if sig == signal.SIGTERM:
                process.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            process.send_signal(sig)
        except psutil.Error:
            pass


def stop_run(run_dir: str, timeout: float = 30.0) -> list[str]:
    """Stop every process of the cluster in `run_dir`; return those found running ("pid (command)").

    Controllers go first, so that none of them restarts an engine being stopped; then engines,
    node managers and etcd together by SIGTERM (an engine drains and exits); what is still there
    after `timeout` is killed."""
    cluster_address.forget(run_dir)  # the address is no longer this cluster's
    found = run_processes(run_dir)
    seen = {p.pid: describe(p) for p in found}
    controllers = [p for p in found if _is_controller(p)]
    _signal_all(controllers, signal.SIGTERM)
    psutil.wait_procs(controllers, timeout=timeout)
    rest = run_processes(run_dir)  # including any child started meanwhile
    seen.update((p.pid, describe(p)) for p in rest if p.pid not in seen)
    _signal_all(rest, signal.SIGTERM)
    _, alive = psutil.wait_procs(rest, timeout=timeout)
    for _ in range(3):  # children forked while we waited carry the tag too
        alive = run_processes(run_dir)
        if not alive:
            break
        _signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    return list(seen.values())


def main(argv: list[str] | None = None) -> int:
    """`motorctl down`: stop a local cluster whose `motorctl up` is gone."""
    parser = argparse.ArgumentParser(
        prog="motorctl down",
        description="Stop every process of the local cluster in --run-dir (for a `motorctl up` that was killed).",
    )
    parser.add_argument("--run-dir", default=".run", help="the run directory given to motorctl up [.run]")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for SIGTERM before SIGKILL [30]")
    args = parser.parse_args(argv)
    stopped = stop_run(args.run_dir, args.timeout)
    for process in stopped:
        print(f"stopped {process}")
    left = run_processes(args.run_dir)
    if left:
        print("still running: " + ", ".join(describe(p) for p in left), file=sys.stderr)
        return 1
    print(f"no process of the cluster in {args.run_dir} is running")
    return 0
