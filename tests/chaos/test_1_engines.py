"""Engine faults: SIGKILL, SIGSTOP 2 s / 8 s / forever, an unasked exit 0, a crash at start-up and
a crash loop. The node manager notices (pidfd for exits, missed status calls for a paused one),
the controller restarts within the deployment's crash-loop budget; nothing else is touched."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from motor.v1 import controller_pb2 as C
from tests.support import process_alive, wait_for
from tests.support.chaos_cluster import deployment
from tests.support.chaos_rows import Fault, run_row
from tests.support.process_cluster import apply


def pid_of(cluster, instance_id: str, rank: int = 0) -> int:
    [pid] = cluster.engine_processes()[(instance_id, rank)]
    return pid


def test_engine_sigkill(cluster):
    def inject(fault: Fault) -> float:
        os.kill(pid_of(cluster, "decode-0"), signal.SIGKILL)
        return time.monotonic()

    run_row(cluster, Fault("engine SIGKILL", inject, justified={"decode-0"}, must_replace={"decode-0"}))


def paused(cluster, instance_id: str, rank: int, seconds: float) -> float:
    pid = pid_of(cluster, instance_id, rank)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the fault itself: the process stays paused this long
    finally:
        if process_alive(pid):  # else killed as hung meanwhile
            os.kill(pid, signal.SIGCONT)
    return time.monotonic()


def test_engine_sigstop_2s(cluster):
    # Two or three missed status calls, under the threshold of five: nothing is killed.
    run_row(cluster, Fault("engine SIGSTOP 2 s", lambda fault: paused(cluster, "prefill-0", 1, 2.0)))


def test_engine_sigstop_8s(cluster):
    # Past the threshold of five missed calls: killed as hung and restarted (its instance only).
    def inject(fault: Fault) -> float:
        pid = pid_of(cluster, "decode-0")
        ended = paused(cluster, "decode-0", 0, 8.0)
        fault.notes.append("killed as hung" if not process_alive(pid) else "survived")
        return ended

    run_row(cluster, Fault("engine SIGSTOP 8 s", inject, justified={"decode-0"}))


def test_engine_sigstop_forever(cluster):
    def inject(fault: Fault) -> float:
        pid = pid_of(cluster, "prefill-0", 0)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(lambda: not process_alive(pid), timeout=60, interval=0.2, what="the paused engine killed as hung")
        fault.notes.append(f"killed {time.monotonic() - stopped_at:.1f}s after SIGSTOP")
        return stopped_at

    run_row(cluster, Fault("engine SIGSTOP forever", inject, justified={"prefill-0"}, must_replace={"prefill-0"}))


def test_engine_exit_0(cluster):
    # SIGTERM: the engine server drains and exits 0, unasked by its node manager: still a failure.
    def inject(fault: Fault) -> float:
        pid = pid_of(cluster, "decode-0")
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not process_alive(pid), timeout=30, interval=0.1, what="the engine server exited")
        return time.monotonic()

    run_row(cluster, Fault("engine exit 0", inject, justified={"decode-0"}, must_replace={"decode-0"}))


def crashing(cluster, faults: dict) -> Callable[[Fault], float]:
    """A group `crashy` whose engines crash as `faults` says, next to the baseline: it must end
    FAILED with its crash-loop budget spent and no process left, the baseline untouched; then
    the baseline is applied again (the group removed)."""

    def inject(fault: Fault) -> float:
        applied_at = time.monotonic()
        apply(cluster, deployment([{"name": "crashy", "role": "union", "count": 1}], union=faults))
        failed = wait_for(
            lambda: (i := cluster.instances().get("crashy-0")) and i.state == C.INSTANCE_STATE_FAILED and i,
            timeout=90,
            interval=0.2,
            what="crashy-0 FAILED",
            detail=cluster.describe,
        )
        assert "crash-loop budget spent" in failed.state_reason, failed.state_reason
        wait_for(
            lambda: ("crashy-0", 0) not in cluster.engine_processes(),
            timeout=30,
            interval=0.2,
            what="no process left of crashy-0",
        )
        fault.notes.append(
            f"FAILED after {failed.restarts} restarts in {time.monotonic() - applied_at:.1f}s, no process left"
        )
        apply(cluster, deployment())
        return applied_at

    return inject


def test_crash_at_start_up(cluster):
    # Dies while still loading (INIT), before it ever served.
    run_row(
        cluster,
        Fault("crash at start-up", crashing(cluster, {"startup_delay_s": 30, "faults": {"crash_after_s": 0.3}})),
    )


def test_crash_loop(cluster):
    # Serves, then dies, again and again.
    run_row(cluster, Fault("crash loop", crashing(cluster, {"faults": {"crash_after_s": 1.5}})))
