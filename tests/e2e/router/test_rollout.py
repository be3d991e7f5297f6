"""Rolling updates through the real vllm-router under open-loop load: a changed spec replaces the
instances one surge instance at a time (each new one serving before an old one leaves the router
and drains), with no request lost and no 2 s window short of serving; a version that crashes soon
after start pauses the rollout while the old instances go on serving; a controller killed in the
middle of a rollout resumes it from the store (one wave at a time, nothing on the new revision
restarted)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.open_load import OpenLoad, http
from tests.support.router_checks import workers
from tests.support.router_process import running

C = controller_pb2


def union(latency_ms: float, count: int = 3, strategy: dict | None = None, **faults) -> C.Deployment:
    return deployment_from_dict(
        {
            "name": "rolled",
            "model": "sim-tiny",
            "instance_groups": [{"name": "union", "role": "union", "count": count, "accelerators_per_engine": 1}],
            "engine_config": {
                "motor_engine_union_config": {
                    "engine_type": "sim",
                    "engine_args": {"model": "sim-tiny", "latency_ms": latency_ms, **faults},
                }
            },
            "strategy": strategy or {"min_ready": "2s"},
        }
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(
        str(tmp_path_factory.mktemp("rollout")), nodes=2, heartbeat_interval=1.0, engine_port_base=41700, router_port=0
    )
    yield from running(local)


def stub(cluster):
    channel = cluster.credentials().channel(cluster.controller_address)
    return channel, controller_pb2_grpc.ControllerServiceStub(channel)


def apply(cluster, deployment: C.Deployment) -> int:
    channel, controller = stub(cluster)
    with channel:
        return controller.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment), timeout=30).revision


def summary(cluster) -> C.DeploymentSummary:
    channel, controller = stub(cluster)
    with channel:
        return controller.ListDeployments(C.ListDeploymentsRequest(), timeout=10).deployments[0]


def instances(cluster) -> list[C.Instance]:
    channel, controller = stub(cluster)
    with channel:
        return list(controller.ListInstances(C.ListInstancesRequest(), timeout=10).instances)


def events(cluster) -> list[C.Event]:
    channel, controller = stub(cluster)
    with channel:
        stream = controller.WatchEvents(C.WatchEventsRequest(), timeout=5)
        return list(next(iter(stream)).snapshot.recent_events)


def settled(cluster, revision: int) -> bool:
    s, mine = summary(cluster), instances(cluster)
    return (
        s.rollout_state == C.ROLLOUT_STATE_COMPLETE
        and len(mine) == 3
        and all(i.revision == revision and i.state == C.INSTANCE_STATE_READY for i in mine)
        and len(workers(cluster)) == 3
    )


def test_a_changed_spec_rolls_out_with_no_failed_request_and_no_serving_gap(cluster):
    revision = apply(cluster, union(20))
    wait_for(lambda: settled(cluster, revision), timeout=120, interval=0.3, what="three engines in the router")
    before = {i.instance_id for i in instances(cluster)}
    with OpenLoad(cluster.router_url) as load:
        time.sleep(4)
        started = time.monotonic()
        revision = apply(cluster, union(30))
        # Right after the answer, the old instances still serve: nothing was stopped at once.
        assert {i.instance_id for i in instances(cluster) if i.revision < revision} == before
        wait_for(lambda: settled(cluster, revision), timeout=180, interval=0.3, what="the rollout complete")
        ended = time.monotonic()
        time.sleep(3)  # the last withdrawn engine drains and stops meanwhile
    rate_before = load.served_rate(started - 3, started)
    lowest = load.lowest_rate(started, ended + 3)
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"
    assert lowest >= rate_before * 2 / 3, f"a 2 s window served {lowest:.1f}/s; {rate_before:.1f}/s before"
    steps = [e.message for e in events(cluster) if e.type == C.EVENT_TYPE_ROLLOUT]
    assert any("withdrawn and drained" in m for m in steps) and any("complete" in m for m in steps), steps


def test_recreate_still_replaces_every_instance_at_once(cluster):
    revision = apply(cluster, union(20, strategy={"type": "recreate"}))
    wait_for(lambda: settled(cluster, revision), timeout=120, interval=0.3, what="three engines in the router")
    before = {i.instance_id for i in instances(cluster)}
    revision = apply(cluster, union(40, strategy={"type": "recreate"}))
    # Answered once made: every old instance is gone, the new ones start under the same ids.
    mine = instances(cluster)
    assert {i.instance_id for i in mine} == before and all(i.revision == revision for i in mine)
    assert all(i.state != C.INSTANCE_STATE_READY for i in mine)
    wait_for(lambda: settled(cluster, revision), timeout=120, interval=0.3, what="the new engines in the router")
    assert http("GET", cluster.router_url + "/health")[0] == 200


def test_a_version_that_crashes_soon_after_start_pauses_itself_with_the_old_instances_serving(cluster):
    revision = apply(cluster, union(20))
    wait_for(lambda: settled(cluster, revision), timeout=120, interval=0.3, what="three engines in the router")
    old = {i.instance_id for i in instances(cluster)}
    serving = workers(cluster)
    with OpenLoad(cluster.router_url) as load:
        time.sleep(2)
        apply(cluster, union(20, faults={"crash_after_s": 1}))
        paused = wait_for(
            lambda: (s := summary(cluster)).rollout_state == C.ROLLOUT_STATE_PAUSED and s,
            timeout=60,
            interval=0.2,
            what="the rollout paused",
        )
        time.sleep(4)  # the old instances go on serving while it stays paused
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"
    assert summary(cluster).rollout_state == C.ROLLOUT_STATE_PAUSED
    mine = {i.instance_id: i for i in instances(cluster)}
    assert all(mine[i].state == C.INSTANCE_STATE_READY and mine[i].restarts == 0 for i in old), mine
    assert serving <= workers(cluster)
    (new,) = set(mine) - old
    # (why, in the words of whichever came first: the instance failed, or its engine server exited)
    reason = paused.rollout_reason
    assert new in reason and ("failed" in reason or "exited" in reason), reason
    pause = [e for e in events(cluster) if e.type == C.EVENT_TYPE_ROLLOUT and "paused" in e.message]
    assert pause and pause[0].instance_id == new, pause
    # The good spec again: the crashing instance goes, the old ones stay as they are.
    apply(cluster, union(20))
    wait_for(lambda: settled(cluster, revision + 2), timeout=60, interval=0.3, what="the rollout back")
    assert {i.instance_id for i in instances(cluster)} == old


def test_a_controller_killed_mid_rollout_resumes_it_from_the_store(cluster):
    slow = {"min_ready": "4s"}  # each wave waits: time to kill the controller in the middle of one
    revision = apply(cluster, union(20, strategy=slow))
    wait_for(lambda: settled(cluster, revision), timeout=120, interval=0.3, what="three engines in the router")
    most = 0

    def counted(done) -> bool:
        nonlocal most
        most = max(most, len(instances(cluster)))
        return done()

    with OpenLoad(cluster.router_url) as load:
        time.sleep(2)
        revision = apply(cluster, union(30, strategy=slow))
        new = wait_for(
            lambda: [i for i in instances(cluster) if i.revision == revision and i.state == C.INSTANCE_STATE_READY],
            timeout=60,
            interval=0.1,
            what="a new-revision instance serving",
        )
        generations = {e.engine_id: e.generation for i in new for e in i.engines}
        controller = cluster.process("controller").process
        os.killpg(controller.pid, signal.SIGKILL)
        controller.wait(timeout=10)
        cluster.launch_controller(0)
        cluster.wait_serving(cluster.controller_address, 30, cluster.credentials())
        wait_for(lambda: counted(lambda: settled(cluster, revision)), timeout=180, interval=0.2, what="the rollout")
        time.sleep(3)
    assert most <= 4, f"{most} instances at once: count 3 + max_surge 1 at most (one wave at a time)"
    after = {e.engine_id: e.generation for i in instances(cluster) for e in i.engines}
    assert all(after.get(engine) == generation for engine, generation in generations.items()), (generations, after)
    # Nothing failed, before the kill or after it: the restarted controller sends the router its
    # endpoints only once the nodes have reported to it.
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"


def test_the_fix_for_a_paused_bad_version_keeps_the_only_serving_instance_under_load(cluster):
    """count 1: v2 completes on one instance; v3 crashes soon after start (paused); v4, the fix,
    is applied while paused: the one serving instance stays until the fix serves, 0 failed."""

    def settled_on_one(revision: int) -> bool:
        s, mine = summary(cluster), instances(cluster)
        return (
            s.rollout_state == C.ROLLOUT_STATE_COMPLETE
            and [i.revision for i in mine] == [revision]
            and mine[0].state == C.INSTANCE_STATE_READY
            and len(workers(cluster)) == 1
        )

    apply(cluster, union(20, count=1))
    revision = apply(cluster, union(25, count=1))
    wait_for(
        lambda: settled_on_one(revision),
        timeout=120,
        interval=0.3,
        what="one engine of v2 in the router",
        detail=lambda: (
            f"{summary(cluster)} {[(i.instance_id, i.revision, i.state) for i in instances(cluster)]} "
            f"{workers(cluster)}"
        ),
    )
    with OpenLoad(cluster.router_url) as load:
        time.sleep(2)
        apply(cluster, union(25, count=1, faults={"crash_after_s": 1.5}))
        wait_for(
            lambda: summary(cluster).rollout_state == C.ROLLOUT_STATE_PAUSED, timeout=60, interval=0.2, what="paused"
        )
        fixed = apply(cluster, union(30, count=1))
        lowest = len(workers(cluster))
        deadline = time.monotonic() + 120
        while not settled_on_one(fixed) and time.monotonic() < deadline:
            lowest = min(lowest, len(workers(cluster)))
            time.sleep(0.2)
        assert settled_on_one(fixed), summary(cluster).rollout_reason
        time.sleep(3)  # the withdrawn engine drains and stops meanwhile
    assert lowest >= 1, "the router was left with no worker during the fix's rollout"
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"
