"""A 10,000-instance apply and delete (issue 12, defect 5): the baseline plus 10,000 instances of
data-parallel size 4 (40,000 engines, none placeable: 8 accelerators each), then the baseline
again (the 10,000 removed). The controller's loop must never block long enough to miss
heartbeats: no node turns SUSPECT, and its event-loop lag histogram (/metrics) shows no timer
late by a second or more (a hang bound, twenty times the 50 ms goal; the largest lag seen is
recorded in the table)."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor.v1 import controller_pb2 as C
from tests.chaos.cluster import deployment
from tests.chaos.rows import Fault, run_row

BULK = 10_000
LAG_BOUND_S = 1.0


def lag_buckets(port: int) -> dict[float, float]:
    """le -> cumulative count of motor_event_loop_lag_seconds on the controller."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {float(s.labels["le"]): s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "motor_event_loop_lag_seconds_bucket"}


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
                self.seen |= {(n.info.node_id, C.NodeState.Name(n.state)) for n in nodes if n.state != C.NODE_STATE_READY}
            except Exception:  # noqa: BLE001 (a slow answer is what the lag histogram reports)
                pass
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# Not strict: on a quiet machine main's unsliced apply (about 0.7 s of loop held) stays under the
# hang bound and passes; under load it holds the loop for seconds and nodes turn SUSPECT.
@pytest.mark.xfail(strict=False, reason="issue 12 defect 5: a 10,000 x dp 4 apply holds the controller's loop "
                                        "(seconds under load, nodes SUSPECT); helper slicing's fix, long work in "
                                        "slices, not on main yet")
def test_10000_instances_apply_and_delete(cluster):
    verdict: dict[str, object] = {}

    def inject(fault: Fault) -> float:
        port = cluster.metrics_ports["controller"]
        before = lag_buckets(port)
        big = deployment([{"name": "bulk", "role": "union", "count": BULK, "data_parallel_size": 4,
                           "accelerators_per_engine": 8}], union={})
        with NodeStates(cluster) as states:
            started = time.monotonic()
            cluster.stub().ApplyDeployment(C.ApplyDeploymentRequest(deployment=big), timeout=300)
            applied = time.monotonic()
            page = cluster.stub().ListInstances(C.ListInstancesRequest(page_size=1000), timeout=60)
            assert len(page.instances) == 1000 and page.next_page_token, "the 10,000 instances listed"
            cluster.stub().ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment()), timeout=300)
            deleted = time.monotonic()
            time.sleep(2 * cluster.heartbeat_interval)  # the passes after the delete, too
        lags = lags_over(before, lag_buckets(port))
        worst = max((le for le, n in lags.items() if n), default=0.0)
        verdict.update(states=sorted(states.seen), late=sum(n for le, n in lags.items() if le > LAG_BOUND_S))
        fault.notes.append(f"apply {applied - started:.1f}s, delete {deleted - applied:.1f}s, loop lag up to "
                           f"{'over 5' if worst == float('inf') else worst:}s, nodes not READY meanwhile: "
                           f"{sorted(states.seen) or 'none'}")
        return deleted

    run_row(cluster, Fault("10,000-instance apply and delete", inject))
    assert not verdict["states"], f"nodes not READY during the apply and delete: {verdict['states']}"
    assert not verdict["late"], f"the controller's loop was late by {LAG_BOUND_S:g}s or more {verdict['late']:g} times"
