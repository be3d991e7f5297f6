"""The chaos suite's one cluster (package scope: every row of tests/chaos drives the same one)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from motorctl.cluster_processes import script_path
from tests.support import require, wait_for
from tests.support.chaos_cluster import (
    ABNORMAL_THRESHOLD,
    BASELINE,
    HEARTBEAT,
    NODE_GRACE,
    ChaosCluster,
    engine_port_base,
)


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    require(
        os.path.exists(script_path("motor-node-manager")) and os.path.exists(script_path("engine_server")),
        "the motor-node-manager and engine_server commands",
    )
    run_dir = str(tmp_path_factory.mktemp("chaos"))
    baseline = os.path.join(run_dir, "deployment.json")
    with open(baseline, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(BASELINE))
    cluster = ChaosCluster(
        run_dir,
        nodes=3,
        accelerators_per_node=4,
        deployment_path=baseline,
        heartbeat_interval=HEARTBEAT,
        node_grace=NODE_GRACE,
        abnormal_threshold=ABNORMAL_THRESHOLD,
        engine_port_base=engine_port_base(),
        node_id_prefix="chaos",
        extra_controller_args=["--recheck-timeout", "1"],
    )
    cluster.mount_disks()
    try:
        cluster.start(timeout=90)
        wait_for(
            lambda: not cluster.problems(),
            timeout=120,
            interval=0.3,
            what="the chaos cluster whole",
            detail=lambda: "\n".join(cluster.problems()),
        )
        yield cluster
    finally:
        if hasattr(cluster, "_channel"):
            cluster._channel.close()
        for managed in cluster.processes:  # a paused process cannot stop
            try:
                os.killpg(managed.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        problems = cluster.stop()
        cluster.unmount_disks()
        assert not [p for p in problems if "left-over" in p], problems
