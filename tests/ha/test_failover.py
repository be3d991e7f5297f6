"""Failover on real processes: etcd, two controllers on it, two node managers, sim engines
(the `motorctl up --ha` cluster). A leader killed with SIGKILL, or stopped with SIGSTOP past its
lease, is replaced by the standby without any engine being restarted or stopped; node managers
refuse a deposed leader's commands; losing etcd's quorum stops the acting, not the engines."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import pytest

from motor.ports import free_port
from motor.v1 import controller_pb2, node_manager_pb2, node_manager_pb2_grpc, types_pb2
from motorctl.cluster_processes import script_path
from tests.support import REPO_ROOT, wait_for
from tests.support.etcd_members import _require_etcd, raft_leadership_moved_off
from tests.support.ha_controllers import _controllers, _leader, _process_of, _stub
from tests.support.local_cluster import example_cluster, started

DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")
EXPECTED_ENGINES = {"prefill-0/rank0", "prefill-0/rank1", "decode-0/rank0"}
TTL = 2
NODE_GRACE = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _require_etcd()
    local = example_cluster(
        tmp_path_factory,
        "ha-cluster",
        node_grace=NODE_GRACE,
        engine_port_base=35000,
        controller_port=free_port(),
        ha=True,
        etcd_members=3,
        extra_controller_args=["--lease-ttl", str(TTL)],
        node_id_prefix="ha-node",
    )
    yield from started(local)
    assert local.etcd is not None and not any(m.running() for m in local.etcd.members)


def _engines(cluster) -> dict[str, tuple[int, int, int]]:
    """Every engine the node managers run: id -> (pid, generation, state)."""
    found = {}
    for port in cluster.node_ports.values():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            for e in stub.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5).engines:
                if e.state == types_pb2.ENGINE_STATE_RUNNING:
                    found[e.engine_id] = (e.pid, e.spec.generation, e.state)
    return found


def _all_normal(cluster) -> bool:
    leader = _leader(cluster)
    if not leader:
        return False
    instances = _stub(leader).ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
    engines = {e.engine_id: e for i in instances for e in i.engines}
    return (
        set(engines) == EXPECTED_ENGINES
        and all(e.health == types_pb2.HEALTH_STATUS_NORMAL for e in engines.values())
        and all(i.state == controller_pb2.INSTANCE_STATE_READY for i in instances)
    )


def _settled(cluster) -> dict[str, tuple[int, int, int]]:
    wait_for(lambda: _all_normal(cluster), timeout=90, interval=0.3, what="every engine NORMAL under the leader")
    return _engines(cluster)


def _nothing_restarted(cluster, before: dict, since: str) -> None:
    """After the new leader's start-up grace (node grace) and more, the same engines run with the
    same pids and generations, every instance READY with no restart."""
    time.sleep(NODE_GRACE + 2.0)
    wait_for(lambda: _all_normal(cluster), timeout=30, interval=0.3, what=f"every engine NORMAL {since}")
    assert _engines(cluster) == before, f"engines changed {since}"
    instances = _stub(_leader(cluster)).ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
    assert all(i.restarts == 0 for i in instances), [(i.instance_id, i.restarts) for i in instances]


def _refused(address: str, apply: controller_pb2.ApplyDeploymentRequest) -> bool:
    """A change sent to `address` is answered UNAVAILABLE."""
    try:
        _stub(address).ApplyDeployment(apply, timeout=5)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_kill_9_of_the_leader_hands_over_without_touching_an_engine(cluster):
    before = _settled(cluster)
    old = _leader(cluster)
    old_epoch = _controllers(cluster).epoch
    process, index = _process_of(cluster, old)
    killed_at = time.monotonic()
    os.kill(process.process.pid, signal.SIGKILL)
    process.process.wait(10)
    new = wait_for(lambda: _leader(cluster, exclude=old), timeout=TTL * 3 + 10, interval=0.05, what="a new leader")
    took = time.monotonic() - killed_at
    assert new != old
    print(f"new leader after {took:.2f}s (lease {TTL}s)")
    reply = _controllers(cluster, exclude=old)
    assert reply.epoch == old_epoch + 1
    recent = next(_stub(new).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=5)).snapshot.recent_events
    changes = [e.message for e in recent if e.type == controller_pb2.EVENT_TYPE_LEADER_CHANGED]
    # The standby saw its connection to the leader reset and the address refuse connections: it
    # revoked the dead leader's lease rather than wait for it to expire (controller/ha/leader_watch.py).
    assert any(new in m and f"the leader {old} (epoch {old_epoch}) refused connections" in m for m in changes), changes
    _nothing_restarted(cluster, before, "after the leader was killed")
    # The killed controller comes back as a standby.
    cluster.launch_controller(index)
    cluster.wait_serving(old, 30)
    wait_for(
        lambda: {c.address for c in _controllers(cluster).controllers} == set(cluster.controller_addresses),
        timeout=20,
        what="both controllers listed again",
    )
    assert _leader(cluster) == new


def test_a_standby_refuses_changes_and_names_the_leader(cluster):
    leader = _leader(cluster)
    standby = next(a for a in cluster.controller_addresses if a != leader)
    with pytest.raises(grpc.RpcError) as refused:
        _stub(standby).DeleteDeployment(controller_pb2.DeleteDeploymentRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert leader in refused.value.details()
    assert ("motor-leader", leader) in tuple(refused.value.trailing_metadata())
    beat = controller_pb2.StreamHeartbeatsRequest(
        heartbeat=controller_pb2.HeartbeatRequest(node_id="ha-node-a", generation=1)
    )
    with pytest.raises(grpc.RpcError) as streamed:
        list(_stub(standby).StreamHeartbeats(iter([beat]), timeout=5))
    assert streamed.value.code() == grpc.StatusCode.UNAVAILABLE and leader in streamed.value.details()
    # Routers follow the leader's endpoints only: a standby knows no engine's health, and its empty
    # list would take every worker out of a router (motor-router-sync moves on to the next address).
    with pytest.raises(grpc.RpcError) as watched:
        next(iter(_stub(standby).WatchEndpoints(controller_pb2.WatchEndpointsRequest(), timeout=5)))
    assert watched.value.code() == grpc.StatusCode.UNAVAILABLE and leader in watched.value.details()
    # A front door's report counts only where rollouts run: the leader.
    with pytest.raises(grpc.RpcError) as reported:
        _stub(standby).ReportFrontDoor(controller_pb2.ReportFrontDoorRequest(router="http://r:8080"), timeout=5)
    assert reported.value.code() == grpc.StatusCode.UNAVAILABLE and leader in reported.value.details()
    # Reads are answered by the standby from etcd.
    deployment = _stub(standby).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5)
    assert deployment.deployment.name == "local-sim"
    assert {
        i.instance_id for i in _stub(standby).ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
    } == {"prefill-0", "decode-0"}


def test_node_managers_refuse_a_command_of_an_older_epoch(cluster):
    _settled(cluster)
    epoch = _controllers(cluster).epoch
    port = next(iter(cluster.node_ports.values()))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        engine = stub.ListEngines(node_manager_pb2.ListEnginesRequest(), timeout=5).engines[0]
        with pytest.raises(grpc.RpcError) as refused:
            stub.StopEngine(
                node_manager_pb2.StopEngineRequest(engine_id=engine.engine_id, controller_epoch=epoch - 1), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"epoch {epoch} leads now" in refused.value.details()
        after = stub.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=engine.engine_id), timeout=5).engine
        assert after.pid == engine.pid and after.state == types_pb2.ENGINE_STATE_RUNNING


def test_sigstop_of_the_leader_past_its_lease_then_sigcont(cluster):
    before = _settled(cluster)
    old = _leader(cluster)
    epoch = _controllers(cluster).epoch
    process, _ = _process_of(cluster, old)
    log_size = os.path.getsize(process.log_path)
    os.kill(process.process.pid, signal.SIGSTOP)
    try:
        new = wait_for(lambda: _leader(cluster, exclude=old), timeout=TTL * 3 + 10, interval=0.05, what="a new leader")
        assert new != old and _controllers(cluster, exclude=old).epoch == epoch + 1
        # A stopped process still accepts connections (the kernel does): no confirmed death, the
        # standby waited for the lease to expire.
        recent = next(_stub(new).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=5)).snapshot.recent_events
        elected = [
            e.message
            for e in recent
            if e.type == controller_pb2.EVENT_TYPE_LEADER_CHANGED and f"(epoch {epoch + 1})" in e.message
        ]
        assert elected and all("lease expired" in m and "refused connections" not in m for m in elected), elected
        time.sleep(1.0)  # well past the old lease
    finally:
        os.kill(process.process.pid, signal.SIGCONT)

    def stepped_down() -> bool:
        with open(process.log_path, encoding="utf-8", errors="replace") as log:
            log.seek(log_size)
            return "stepped down" in log.read()

    wait_for(stepped_down, timeout=20, what="the resumed controller to step down")
    assert _leader(cluster) == new
    _nothing_restarted(cluster, before, "after the old leader resumed")
    with open(process.log_path, encoding="utf-8", errors="replace") as log:
        log.seek(log_size)
        resumed = log.read()
    for sign in ("StartEngine of", "stopped ", "applied "):
        assert not any(sign in line and "not sent" not in line for line in resumed.splitlines()), resumed


def test_one_etcd_member_lost_changes_nothing_and_quorum_lost_stops_only_the_acting(cluster):
    before = _settled(cluster)
    leader, epoch = _leader(cluster), _controllers(cluster).epoch
    etcd = cluster.etcd
    # The member every client tries first, a follower: losing etcd's raft leader costs an etcd
    # election longer than the 2 s TTL's deadline (docs/ha.md), which is not this test's case.
    raft_leadership_moved_off(etcd, 0)
    etcd.kill_member(0)
    apply = controller_pb2.ApplyDeploymentRequest(
        deployment=_stub(leader).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5).deployment
    )
    wait_for(lambda: _stub(leader).ApplyDeployment(apply, timeout=5), timeout=20, what="a change with one member down")
    # ListControllers reads etcd: right after the member's death a read may still fail over.
    reply = wait_for(lambda: _controllers(cluster), timeout=20, what="the controllers answering with one member down")
    assert reply.leader_address == leader and reply.epoch == epoch
    etcd.start_member(0)
    etcd.wait_healthy()

    for index in (1, 2):  # two of three members gone: no quorum
        etcd.signal_member(index, signal.SIGSTOP)
    try:
        wait_for(
            lambda: _refused(leader, apply),
            timeout=TTL * 3 + 15,
            interval=0.5,
            what="changes refused while etcd has no quorum",
        )
        assert _engines(cluster) == before, "engines changed while etcd had no quorum"
    finally:
        for index in (1, 2):
            etcd.signal_member(index, signal.SIGCONT)
    etcd.wait_healthy()
    wait_for(lambda: _leader(cluster), timeout=30, what="a leader once the quorum is back")
    _nothing_restarted(cluster, before, "after the quorum came back")


def test_sigterm_of_the_leader_resigns_before_its_port_closes(cluster):
    """A controller stopping gracefully stops acting and revokes its lease before its gRPC
    server closes: the standby leads on the resignation (not on a refused connection), the
    stopped one exits 0, nothing is restarted."""
    before = _settled(cluster)
    old, epoch = _leader(cluster), _controllers(cluster).epoch
    process, index = _process_of(cluster, old)
    process.process.send_signal(signal.SIGTERM)
    new = wait_for(lambda: _leader(cluster, exclude=old), timeout=TTL * 3 + 10, interval=0.05, what="a new leader")
    assert process.process.wait(30) == 0
    recent = next(_stub(new).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=5)).snapshot.recent_events
    elected = [
        e.message
        for e in recent
        if e.type == controller_pb2.EVENT_TYPE_LEADER_CHANGED and f"(epoch {epoch + 1})" in e.message
    ]
    assert elected and all("resigned" in m and "refused connections" not in m for m in elected), elected
    _nothing_restarted(cluster, before, "after the leader stopped")
    cluster.launch_controller(index)
    cluster.wait_serving(old, 30)
    wait_for(
        lambda: _leader(cluster) == new and len(_controllers(cluster).controllers) == 2,
        timeout=20,
        what="the restarted controller to stand by",
    )


def test_motorctl_follows_the_leader_from_a_standby(cluster):
    """motorctl given the standby first: reads answered there, a change sent on to the leader."""
    leader = _leader(cluster)
    standby = next(a for a in cluster.controller_addresses if a != leader)
    every = f"{standby},{leader}"
    shown = subprocess.run(
        [script_path("motorctl"), "--controller", every, "controllers"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert f"leader: {leader}" in shown.stdout and standby in shown.stdout
    applied = subprocess.run(
        [script_path("motorctl"), "--controller", every, "apply", "-f", DEPLOYMENT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert applied.returncode == 0, applied.stderr
    assert "deployment 'local-sim' applied" in applied.stdout


def test_both_controllers_killed_and_restarted_at_once(cluster):
    """No controller for a while, then two fresh processes: one leads with a higher epoch, adopts
    the running engines (start-up grace) and restarts nothing."""
    before = _settled(cluster)
    epoch = _controllers(cluster).epoch
    processes = [_process_of(cluster, address) for address in cluster.controller_addresses]
    for process, _ in processes:
        os.kill(process.process.pid, signal.SIGKILL)
    for process, _ in processes:
        process.process.wait(10)
    for _, index in processes:
        cluster.launch_controller(index)
    for address in cluster.controller_addresses:
        cluster.wait_serving(address, 30)
    # The old leader's key outlives it until its lease expires: wait for a newly elected one.
    wait_for(
        lambda: (reply := _controllers(cluster)) and reply.leader_address and reply.epoch > epoch,
        timeout=TTL * 3 + 20,
        what="a leader elected among the restarted controllers",
    )
    _nothing_restarted(cluster, before, "after both controllers were restarted")


def test_etcd_restarted_with_its_data_loses_nothing_and_restarts_nothing(cluster):
    """Every etcd member stopped, then started again on its data directory: meanwhile changes
    are refused and engines run untouched; afterwards a leader acts on the same stored state."""
    before = _settled(cluster)
    leader = _leader(cluster)
    stored = _stub(leader).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5)
    apply = controller_pb2.ApplyDeploymentRequest(deployment=stored.deployment)
    etcd = cluster.etcd
    etcd.stop()
    try:
        wait_for(
            lambda: _refused(leader, apply),
            timeout=TTL * 3 + 15,
            interval=0.5,
            what="changes refused while etcd is down",
        )
        assert _engines(cluster) == before, "engines changed while etcd was down"
    finally:
        for index in range(len(etcd.members)):
            etcd.start_member(index)
    etcd.wait_healthy()
    new = wait_for(lambda: _leader(cluster), timeout=30, what="a leader once etcd is back")
    again = _stub(new).GetDeployment(controller_pb2.GetDeploymentRequest(), timeout=5)
    assert again.revision == stored.revision and again.deployment == stored.deployment
    _nothing_restarted(cluster, before, "after etcd was restarted")
