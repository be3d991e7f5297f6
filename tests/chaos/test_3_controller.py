"""Controller faults: SIGKILL and restart, SIGSTOP 10 s, and its database lost (moved away while
it is down: it starts again on an empty one with the same --deployment, applied once the nodes
registered). The engines run on under their node managers; the controller comes back
and adopts them, restarting nothing."""

from __future__ import annotations

import os
import shutil
import signal
import time

from tests.support import wait_for
from tests.support.chaos_rows import Fault, run_row


def test_controller_sigkill(cluster):
    def inject(fault: Fault) -> float:
        cluster.kill_controller()
        killed_at = time.monotonic()
        cluster.start_controller()
        return killed_at

    run_row(cluster, Fault("controller SIGKILL", inject))


def test_controller_sigstop_10s(cluster):
    def inject(fault: Fault) -> float:
        process = cluster.process("controller").process
        os.killpg(process.pid, signal.SIGSTOP)
        try:
            time.sleep(10.0)  # the fault itself
        finally:
            os.killpg(process.pid, signal.SIGCONT)
        return time.monotonic()

    run_row(cluster, Fault("controller SIGSTOP 10 s", inject))


def database_files(cluster) -> list[str]:
    return [cluster.db_path + suffix for suffix in ("", "-wal", "-shm") if os.path.exists(cluster.db_path + suffix)]


def test_controller_database_lost(cluster):
    # Started again with the same command line (--deployment FILE) on an empty database: the file
    # waits until the nodes registered and run what it describes, then adopts it (docs/controller.md,
    # "A lost database").
    lost = os.path.join(cluster.run_dir, "lost-db")

    def inject(fault: Fault) -> float:
        cluster.kill_controller()
        os.makedirs(lost, exist_ok=True)
        for path in database_files(cluster):
            shutil.move(path, lost)
        killed_at = time.monotonic()
        cluster.start_controller()
        wait_for(
            lambda: any("first deployment on a new store" in e.message for e in cluster.events()),
            timeout=60,
            interval=0.2,
            what="the start-up deployment applied on the new store",
            detail=cluster.describe,
        )
        adopted = [e.message for e in cluster.events() if "adopted the engines the nodes run" in e.message]
        fault.notes.append(f"{len(adopted)} instances adopted by the start-up deployment")
        return killed_at

    try:
        run_row(cluster, Fault("controller database lost", inject))
    except BaseException:
        # Put the old database back, so the rows after this one start from a working cluster.
        cluster.kill_controller()
        for path in database_files(cluster):
            os.remove(path)
        for name in os.listdir(lost):
            shutil.move(os.path.join(lost, name), cluster.db_dir)
        cluster.start_controller()
        raise
