"""The controller's database lost (moved away, a new disk) under a running fleet, with real
processes: the restarted controller starts on an empty store, the node managers keep their
engines, and applying the same deployment again adopts them (same pids, nothing FAILED, no
engine started) instead of refusing every start as stale."""

from __future__ import annotations

import json
import os
import time

import pytest
from google.protobuf import json_format

from motor.contract.deployment_file import load_deployment
from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.process_cluster import HEARTBEAT, apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


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
    wait_for(
        lambda: (
            len(cluster.node_list().nodes) == 2 and all(n.HasField("last_heartbeat") for n in cluster.node_list().nodes)
        ),
        timeout=60,
        interval=0.2,
        what="both nodes registered with the empty controller",
    )
    # No deployment yet: the engines the nodes run are kept (not stopped in a hurry).
    time.sleep(4 * HEARTBEAT)
    kept = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    assert kept == before, cluster.describe()
    apply(cluster, deployment)
    wait_for(
        lambda: cluster.all_ready(2), timeout=60, interval=0.2, what="READY after the re-apply", detail=cluster.describe
    )
    time.sleep(4 * HEARTBEAT)
    after = {k: (e.pid, e.spec.generation) for k, e in cluster.engine_copies().items()}
    assert after == before, cluster.describe()
    instances = cluster.instances()
    assert all(i.state == C.INSTANCE_STATE_READY and i.restarts == 0 for i in instances.values()), cluster.describe()
    events = cluster.events()
    assert not [
        e
        for e in events
        if e.type in (C.EVENT_TYPE_ENGINE_STARTED, C.EVENT_TYPE_ENGINE_FAILED, C.EVENT_TYPE_ENGINE_FENCED)
    ], cluster.describe()
    assert any("adopted" in e.message for e in events), cluster.describe()


def _write_deployment_file(path: str, deployment: C.Deployment) -> str:
    data = json_format.MessageToDict(deployment, preserving_proto_field_name=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    assert load_deployment(path) == deployment
    return path


def test_database_lost_under_a_startup_deployment_adopts_every_engine(make_cluster, tmp_path):
    """`motor-controller --deployment FILE` restarted on a lost database: the file waits for the
    nodes to register, then adopts what they run (the same pids, nothing restarted)."""
    deployment = sim_deployment(count=2, dp=2)
    path = _write_deployment_file(str(tmp_path / "deployment.json"), deployment)
    # The first start (no engine anywhere) waits out the startup grace; the restart need not.
    cluster = make_cluster(nodes=2, extra=["--node-grace", "15", "--startup-grace", "8", "--deployment", path])
    wait_for(
        lambda: cluster.all_ready(2),
        timeout=120,
        interval=0.2,
        what="READY from the start-up deployment",
        detail=cluster.describe,
    )
    before = {k: e.pid for k, e in cluster.engine_copies().items()}
    assert len(before) == 4
    cluster.kill_controller()
    _move_database_away(cluster)
    cluster.start_controller()  # the same command line: --deployment FILE on an empty database
    wait_for(
        lambda: any("adopted" in e.message for e in cluster.events()),
        timeout=60,
        interval=0.2,
        what="the start-up deployment applied, adopting",
        detail=cluster.describe,
    )
    wait_for(
        lambda: cluster.all_ready(2), timeout=60, interval=0.2, what="READY after the restart", detail=cluster.describe
    )
    time.sleep(4 * HEARTBEAT)
    after = {k: e.pid for k, e in cluster.engine_copies().items()}
    assert after == before, cluster.describe()
    assert all(i.state == C.INSTANCE_STATE_READY and i.restarts == 0 for i in cluster.instances().values()), (
        cluster.describe()
    )
    events = cluster.events()
    assert not [
        e
        for e in events
        if e.type in (C.EVENT_TYPE_ENGINE_STARTED, C.EVENT_TYPE_ENGINE_FAILED, C.EVENT_TYPE_ENGINE_FENCED)
    ], cluster.describe()
    assert any("2 instance(s) adopted" in e.message for e in events), cluster.describe()
    with open(cluster.process("controller").log_path, encoding="utf-8") as log:
        text = log.read()
    assert "start-up deployment deferred" in text and "start-up deployment applied" in text, text[-3000:]
