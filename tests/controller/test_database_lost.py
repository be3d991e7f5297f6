"""The controller's database lost (moved away, a new disk) under a running fleet, with real
processes: the restarted controller starts on an empty store, the node managers keep their
engines, and applying the same deployment again adopts them (same pids, nothing FAILED, no
engine started) instead of refusing every start as stale (issue 12, defect 3)."""

from __future__ import annotations

import os
import time

from motor.v1 import controller_pb2 as C
from tests.controller.test_real_processes import HEARTBEAT, apply, make_cluster, sim_deployment  # noqa: F401
from tests.support import wait_for


def _move_database_away(cluster) -> None:
    db = os.path.join(cluster.run_dir, "controller.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.rename(db + suffix, db + suffix + ".lost")
    assert not os.path.exists(db)


def test_database_lost_then_the_same_deployment_applied_again_adopts_every_engine(make_cluster):
    cluster = make_cluster(nodes=2, extra=["--node-grace", "15"])
    deployment = sim_deployment(count=2, dp=2)
    apply(cluster, deployment)
    wait_for(lambda: cluster.all_ready(2), timeout=90, interval=0.2, what="READY")
    before = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    assert len(before) == 4
    cluster.kill_controller()
    _move_database_away(cluster)
    cluster.start_controller()
    wait_for(lambda: len(cluster.node_list().nodes) == 2 and all(n.HasField("last_heartbeat") for n in cluster.node_list().nodes),
             timeout=60, interval=0.2, what="both nodes registered with the empty controller")
    # No deployment yet: the engines the nodes run are kept (not stopped in a hurry).
    time.sleep(4 * HEARTBEAT)
    kept = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    assert kept == before, cluster.describe()
    apply(cluster, deployment)
    wait_for(lambda: cluster.all_ready(2), timeout=60, interval=0.2, what="READY after the re-apply", detail=cluster.describe)
    time.sleep(4 * HEARTBEAT)
    after = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    assert after == before, cluster.describe()
    instances = cluster.instances()
    assert all(i.state == C.INSTANCE_STATE_READY and i.restarts == 0 for i in instances.values()), cluster.describe()
    events = cluster.events()
    assert not [e for e in events if e.type in (C.EVENT_TYPE_ENGINE_STARTED, C.EVENT_TYPE_ENGINE_FAILED,
                                                 C.EVENT_TYPE_ENGINE_FENCED)], cluster.describe()
    assert any("adopted" in e.message for e in events), cluster.describe()
