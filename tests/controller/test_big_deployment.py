"""A big deployment must not block the controller's loop.

A real controller process (SQLite) and 10 simulated nodes of 400 accelerators heartbeating every
0.5 s, whose node manager is one fake gRPC server in a child process (tests/support/big_fleet.py).
ApplyDeployment of 10,000 instances x dp 4 (40,000 engines, all written and held in memory; the
fleet has room for 4,000, the other instances wait PENDING and every reconcile pass goes over
them), a replacing apply (every spec changes), then DeleteDeployment. Checked: the controller's
/metrics saw no stall of its loop over HANG_BOUND and at most one over STALL_BOUND, every
heartbeat sent meanwhile was answered, no node went SUSPECT, and the API's answers hold
(revisions, instances listed, nothing left).

The stall is read from motor_event_loop_blocked_seconds: the loop lag less the time the loop's
thread waited for a CPU, so that other processes loading this shared 2-core machine do not fail
the test (motor_event_loop_lag_seconds is printed beside it). The bounds and the node grace
(GRACE) are hang bounds, not the goal (50 ms): before the fixes the same run held the loop for
seconds (the apply ~1.6 s; delete and replace 10-40 s before instance removal was made linear,
0.3-2.5 s before the garbage collections were tamed). The real figures come from
bench/big_deployment.py (README).
"""

from __future__ import annotations

import grpc
import pytest

from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.big_fleet import BigFleet, deployment, lag_stalls

pytestmark = pytest.mark.processes

INSTANCES, DP = 10_000, 4
NODES, ACCELERATORS = 10, 400
PLACED = NODES * ACCELERATORS  # engines the fleet has room for
# Seconds, bucket bounds of motor_event_loop_blocked_seconds: hang bounds, not the 50 ms goal
# (bench/big_deployment.py measures that). No observation over HANG_BOUND: the defect held the
# loop 10-40 s (delete 10.6 s, replace 39.7 s). At most one over STALL_BOUND: that one is the
# complete walk of the heap (controller/gc_tuning.py: once the heap has doubled, as a fleet's first
# 10,000-instance apply makes it), which took 0.3-1.0 s here under load (it visits every object
# at once); everything else stays near 50 ms, where before the fixes a replace and a delete each
# held the loop 0.5-2.5 s several times (garbage collections of queued calls' reference cycles,
# a feed refresh of every engine, a quadratic forget of old stops).
HANG_BOUND = 2.5
STALL_BOUND = 0.5
GRACE = 10.0  # --node-grace


@pytest.mark.slow
def test_a_10000_instance_apply_replace_and_delete_never_stall_the_loop_nor_silence_a_node(tmp_path):
    fleet = BigFleet(nodes=NODES, accelerators=ACCELERATORS, grace=GRACE, work=str(tmp_path))
    try:
        fleet.start()
        before, lag_before = fleet.lag_buckets("blocked"), fleet.lag_buckets()
        stub = fleet.stub

        def placed(key: str, target: int, what: str) -> None:
            wait_for(
                lambda: fleet.counts()[key] >= target,
                timeout=400,
                interval=0.5,
                what=what,
                detail=lambda: f"fake node manager: {fleet.counts()}; heartbeats: {len(fleet.beats.failed)} failed",
            )

        reply = stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(INSTANCES, DP)), timeout=300)
        assert reply.revision == 1
        # Answered once durable and made in memory: every instance is listed at once.
        page = stub.ListInstances(C.ListInstancesRequest(page_size=1000), timeout=60)
        assert len(page.instances) == 1000 and page.next_page_token
        placed("starts", PLACED, f"{PLACED} engines started")

        reply = stub.ApplyDeployment(
            C.ApplyDeploymentRequest(deployment=deployment(INSTANCES, DP, "sim-tiny-2")), timeout=300
        )
        assert reply.revision == 2 and reply.deployment.model == "sim-tiny-2"
        placed("stops", PLACED, "the replaced engines stopped")
        placed("starts", 2 * PLACED, "the new engines started")

        stub.DeleteDeployment(C.DeleteDeploymentRequest(), timeout=300)
        assert not stub.ListInstances(C.ListInstancesRequest(), timeout=60).instances
        with pytest.raises(grpc.RpcError) as gone:
            stub.GetDeployment(C.GetDeploymentRequest(), timeout=30)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        placed("stops", 2 * PLACED, "every engine stopped")

        stalls, lags = lag_stalls(before, fleet.lag_buckets("blocked")), lag_stalls(lag_before, fleet.lag_buckets())
        assert sum(stalls.values()) > 0, "the controller's loop-lag timer observed nothing"
        hung = {le: n for le, n in stalls.items() if le > HANG_BOUND and n}
        assert not hung, f"the controller's loop was held past {HANG_BOUND}s: {hung} (blocked: {stalls}; lag: {lags})"
        over = sum(n for le, n in stalls.items() if le > STALL_BOUND)
        assert over <= 1, (
            f"the controller's loop was held past {STALL_BOUND}s {over:g} times (blocked: {stalls}; lag: {lags})"
        )
        assert fleet.beats.sent >= NODES * 10 and not fleet.beats.failed, fleet.beats.failed[:5]
        # A node that went SUSPECT and came back says so in its reason; these were only registered.
        nodes = fleet.node_reasons()
        assert len(nodes) == NODES
        assert all(
            state == "NODE_STATE_READY" and reason.startswith("registered") for state, reason in nodes.values()
        ), nodes
    finally:
        fleet.stop()
