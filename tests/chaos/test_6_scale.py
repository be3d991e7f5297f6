"""A 10,000-instance apply and delete (a big deployment must not block the loop): the baseline plus 10,000 instances of
data-parallel size 4 (40,000 engines, none placeable: 8 accelerators each), then the baseline
again (the 10,000 removed). The controller's loop must never block long enough to miss
heartbeats: no node turns SUSPECT, and /metrics shows no stall of its loop of a second or more
(motor_event_loop_blocked_seconds: the timer's lag less the time the loop's thread waited for a
CPU, so that other processes on this shared machine do not count; a hang bound, twenty times
the 50 ms goal, leaving room for a full garbage collection after a 10,000-instance change). The
largest stall and lag seen are recorded in the table."""

from __future__ import annotations

import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from motor.v1 import controller_pb2 as C
from tests.support.chaos_cluster import deployment
from tests.support.chaos_rows import Fault, run_row

BULK = 10_000
LAG_BOUND_S = 1.0


def lag_buckets(port: int, which: str) -> dict[float, float]:
    """le -> cumulative count of the controller's motor_event_loop_<which>_seconds (that series
    only: the whole /metrics would render every instance on the controller's loop)."""
    name = f"motor_event_loop_{which}_seconds"
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?name[]={name}_bucket", timeout=30).read().decode()
    return {
        float(s.labels["le"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == f"{name}_bucket"
    }


def worst(buckets: dict[float, float]) -> str:
    top = max((le for le, n in buckets.items() if n), default=0.0)
    return "over 5" if top == float("inf") else f"{top:g}"


def lags_over(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    """Observations between the two reads, per bucket upper bound (not cumulative)."""
    cumulative = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    bounds = sorted(cumulative)
    return {le: cumulative[le] - (cumulative[bounds[i - 1]] if i else 0.0) for i, le in enumerate(bounds)}


class NodeStates:
    """Samples ListNodes in the background: every node state other than READY seen meanwhile."""

    def __init__(self, cluster):
        self.cluster, self.seen = cluster, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                nodes = self.cluster.stub().ListNodes(C.ListNodesRequest(), timeout=30).nodes
                self.seen |= {
                    (n.info.node_id, C.NodeState.Name(n.state)) for n in nodes if n.state != C.NODE_STATE_READY
                }
            except Exception:  # noqa: BLE001 (a slow answer is what the lag histogram reports)
                pass
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_10000_instances_apply_and_delete(cluster):
    verdict: dict[str, object] = {}

    def inject(fault: Fault) -> float:
        port = cluster.metrics_ports["controller"]
        before = {which: lag_buckets(port, which) for which in ("blocked", "lag")}
        big = deployment(
            [{"name": "bulk", "role": "union", "count": BULK, "data_parallel_size": 4, "accelerators_per_engine": 8}],
            union={},
        )
        with NodeStates(cluster) as states:
            started = time.monotonic()
            cluster.stub().ApplyDeployment(C.ApplyDeploymentRequest(deployment=big), timeout=300)
            applied = time.monotonic()
            page = cluster.stub().ListInstances(C.ListInstancesRequest(page_size=1000), timeout=60)
            assert len(page.instances) == 1000 and page.next_page_token, "the 10,000 instances listed"
            cluster.stub().ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment()), timeout=300)
            deleted = time.monotonic()
            time.sleep(2 * cluster.heartbeat_interval)  # the passes after the delete, too
        stalls, lags = (lags_over(before[which], lag_buckets(port, which)) for which in ("blocked", "lag"))
        verdict.update(states=sorted(states.seen), late=sum(n for le, n in stalls.items() if le > LAG_BOUND_S))
        fault.notes.append(
            f"apply {applied - started:.1f}s, delete {deleted - applied:.1f}s, loop stalled up to "
            f"{worst(stalls)}s (lag up to {worst(lags)}s), nodes not READY meanwhile: "
            f"{sorted(states.seen) or 'none'}"
        )
        return deleted

    run_row(cluster, Fault("10,000-instance apply and delete", inject))
    assert not verdict["states"], f"nodes not READY during the apply and delete: {verdict['states']}"
    assert not verdict["late"], f"the controller's loop stalled {LAG_BOUND_S:g}s or more {verdict['late']:g} times"
