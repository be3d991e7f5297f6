"""The hang no signal can hide, on real processes: the engine's completions never answer while
its /health answers 200 and its accelerator reads 90 % busy. Virtual inference sees that nothing
is produced, the engine turns ABNORMAL, leaves the endpoints, is killed by its node manager and
replaced by the controller. Under traffic the stall watchdog sees it first, probing or not."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T
from tests.support import process_alive, wait_for
from tests.support.process_cluster import apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes

FAST_PROBES = {
    "enable_virtual_inference": True, "probe_interval": 0.3, "busy_probe_interval": 0.6, "probe_timeout": 0.5,
    "utilization_window": 0.1, "utilization_sample_period": 0.05, "max_failure_count": 2,
}  # fmt: skip


def set_faults(engine: T.Engine, **faults) -> dict:
    request = urllib.request.Request(
        f"http://{engine.spec.host}:{engine.spec.port}/sim/faults", data=json.dumps(faults).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def health_status(engine: T.Engine) -> int:
    with urllib.request.urlopen(f"http://{engine.spec.host}:{engine.spec.port}/health", timeout=10) as response:
        return response.status


def test_a_busy_looking_hang_turns_abnormal_leaves_the_endpoints_and_is_replaced(make_cluster):
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment(utilization=90, health=FAST_PROBES))
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    stub = cluster.stub()
    listed = lambda: {e.engine_id for e in stub.ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints}  # noqa: E731
    wait_for(lambda: "u-0/rank0" in listed(), timeout=30, interval=0.2, what="the engine listed")
    first = cluster.engine_copies()[("node-a", "u-0/rank0")]
    feed = stub.WatchEndpoints(C.WatchEndpointsRequest(), timeout=120)
    assert "u-0/rank0" in {e.engine_id for e in next(feed).added}

    assert set_faults(first, hang_inference=True)["utilization"] == 90
    assert health_status(first) == 200  # what vLLM's own check says of such an engine

    # ABNORMAL, as its node reports it to the controller, with the reason the engine server gave.
    abnormal = wait_for(
        lambda: next((e for e in cluster.engine_copies().values()
                      if e.health == T.HEALTH_STATUS_ABNORMAL and e.pid == first.pid), None),
        timeout=60, interval=0.1, what="the hung engine ABNORMAL",
    )  # fmt: skip
    assert "made no progress" in abnormal.health_reason and "90%" in abnormal.health_reason, abnormal.health_reason
    # It leaves the endpoints (the stream says so), then is killed and replaced.
    removed = next(m for m in feed if "u-0/rank0" in {e.engine_id for e in m.removed})
    assert removed is not None
    second = wait_for(
        lambda: next(
            (e for k, e in cluster.engine_copies().items() if k[1] == "u-0/rank0" and e.pid != first.pid), None
        ),
        timeout=60,
        interval=0.1,
        what="a replacement engine process",
    )
    assert second.spec.generation > first.spec.generation
    wait_for(lambda: not process_alive(first.pid), timeout=30, interval=0.1, what="the hung engine killed")
    readded = next(m for m in feed if "u-0/rank0" in {e.engine_id for e in m.added})
    feed.cancel()
    assert readded is not None
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="READY with the replacement")
    assert cluster.instances()["u-0"].engines[0].restarts >= 1


def test_a_hang_under_traffic_leaves_the_endpoints_at_once_without_probes_and_comes_back(make_cluster):
    """Probing off (the default): requests in flight and no progress for stall_timeout, and the
    engine is out of WatchEndpoints at once (its health still NORMAL, nothing restarted); when
    the hang ends it is listed again. Its caught requests are failed back (503) at the stall, for
    a router to retry elsewhere."""
    stall_timeout = 1.0
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment(health={"stall_timeout": stall_timeout, "stall_kill_after": 60}))
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    stub = cluster.stub()
    listed = lambda: {e.engine_id for e in stub.ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints}  # noqa: E731
    wait_for(lambda: "u-0/rank0" in listed(), timeout=30, interval=0.2, what="the engine listed")
    engine = cluster.engine_copies()[("node-a", "u-0/rank0")]
    feed = stub.WatchEndpoints(C.WatchEndpointsRequest(), timeout=120)
    assert "u-0/rank0" in {e.engine_id for e in next(feed).added}

    set_faults(engine, hang_inference=True)
    hung_at = time.monotonic()
    statuses: list[int] = []

    def complete() -> None:
        request = urllib.request.Request(
            f"http://{engine.spec.host}:{engine.spec.port}/v1/completions", data=b'{"prompt": "x"}',
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                statuses.append(response.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)

    for _ in range(2):
        threading.Thread(target=complete, daemon=True).start()
    next(m for m in feed if "u-0/rank0" in {e.engine_id for e in m.removed})
    out_after = time.monotonic() - hung_at
    # stall_timeout, the watchdog's 0.2 s reading, and the way to the routers (measured well
    # under a second; bounded loosely for a loaded machine).
    assert out_after < stall_timeout + 2.0, f"out of the endpoints {out_after:.2f}s after the hang"
    copy = cluster.engine_copies()[("node-a", "u-0/rank0")]
    assert copy.health == T.HEALTH_STATUS_NORMAL and copy.pid == engine.pid
    assert copy.not_serving_reason.startswith("no progress for 1.") and "2 requests in flight" in (
        copy.not_serving_reason
    )

    set_faults(engine, hang_inference=False)
    next(m for m in feed if "u-0/rank0" in {e.engine_id for e in m.added})
    feed.cancel()
    wait_for(lambda: statuses == [503, 503], timeout=30, what="the caught requests failed back")
    assert cluster.engine_copies()[("node-a", "u-0/rank0")].pid == engine.pid  # nothing restarted
