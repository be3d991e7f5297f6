"""Warm spares through the real vllm-router: a spare is started and loaded but never a worker of
the router; when a serving engine is SIGKILLed, the spare serves in its place within a second
(no model load waited for), no request fails, and the failed instance loads again as the spare."""

from __future__ import annotations

import os
import signal
import time

import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2, controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.open_load import OpenLoad
from tests.support.router_checks import apply, workers
from tests.support.router_process import running

LOAD_S = 6.0  # the simulated model's load time: what a promotion does not wait for


def deployment(spares: int) -> controller_pb2.Deployment:
    sim = {"engine_type": "sim", "engine_args": {"model": "sim-tiny", "latency_ms": 20, "load_s": LOAD_S}}
    return deployment_from_dict(
        {
            "name": "spared",
            "model": "sim-tiny",
            "instance_groups": [
                {"name": "union", "role": "union", "count": 2, "spares": spares, "accelerators_per_engine": 1}
            ],
            "engine_config": {"motor_engine_union_config": sim},
        }
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(
        str(tmp_path_factory.mktemp("spares")),
        nodes=2,
        heartbeat_interval=1.0,
        engine_port_base=38000 + 1000 * (os.getpid() % 4),
        router_port=0,
        node_id_prefix="spares",
    )
    yield from running(local)


def instances(cluster) -> dict[str, controller_pb2.Instance]:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        return {
            i.instance_id: i for i in stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=10).instances
        }


def urls(listed: dict[str, controller_pb2.Instance], spare: bool) -> set[str]:
    return {f"http://{e.host}:{e.port}" for i in listed.values() if i.spare == spare for e in i.engines}


def all_ready(cluster, total: int) -> dict[str, controller_pb2.Instance]:
    def ready():
        listed = instances(cluster)
        return (
            listed
            if len(listed) == total and all(i.state == controller_pb2.INSTANCE_STATE_READY for i in listed.values())
            else None
        )

    return wait_for(ready, timeout=90, interval=0.3, what=f"{total} instances READY")


def pid_of(cluster, engine: controller_pb2.InstanceEngine) -> int:
    with cluster.credentials().channel(f"127.0.0.1:{cluster.node_ports[engine.node_id]}") as channel:
        node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        return node.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=engine.engine_id), timeout=5).engine.pid


def test_the_router_has_exactly_the_serving_engines_never_the_spare(cluster):
    apply(cluster, deployment(spares=1))
    listed = all_ready(cluster, 3)
    serving, spare = urls(listed, spare=False), urls(listed, spare=True)
    assert len(serving) == 2 and len(spare) == 1
    wait_for(lambda: workers(cluster) == serving, timeout=30, interval=0.2, what="the two serving engines routed")
    # The spare is READY and stays out: still out a few router-sync rounds later.
    time.sleep(2)
    assert workers(cluster) == serving
    # Placed apart (best fit alone would pack all three on one node): the serving instances spread
    # over the two nodes, so a node lost never takes the model down; the spare shares a node with
    # one of them (docs/spares.md: none is free of the group).
    nodes = {i.instance_id: i.engines[0].node_id for i in listed.values()}
    serving_nodes = [node for i, node in nodes.items() if not listed[i].spare]
    assert len(set(serving_nodes)) == 2, nodes


def test_sigkill_of_a_serving_engine_under_load_promotes_the_spare_and_fails_no_request(cluster):
    apply(cluster, deployment(spares=1))
    listed = all_ready(cluster, 3)
    serving = urls(listed, spare=False)
    wait_for(lambda: workers(cluster) == serving, timeout=30, interval=0.2, what="the serving engines routed")
    victim = next(i for i in listed.values() if not i.spare)
    spare = next(i for i in listed.values() if i.spare)
    spare_url = f"http://{spare.engines[0].host}:{spare.engines[0].port}"
    with OpenLoad(cluster.router_url) as load:
        time.sleep(1.5)
        os.kill(pid_of(cluster, victim.engines[0]), signal.SIGKILL)
        killed = time.monotonic()
        full = wait_for(
            lambda: len(workers(cluster)) == 2 and spare_url in workers(cluster),
            timeout=LOAD_S,
            interval=0.02,
            what="the spare routed in the killed engine's place",
        )
        back_after = time.monotonic() - killed
        time.sleep(2)
    print(f"full serving capacity back {back_after:.3f}s after the SIGKILL; {len(load.results)} requests")
    assert full and back_after < LOAD_S / 2, f"full capacity back after {back_after:.2f}s"
    assert len(load.results) > 50
    assert load.failed() == [], f"{len(load.failed())} of {len(load.results)} failed"
    after = instances(cluster)
    assert not after[spare.instance_id].spare and after[victim.instance_id].spare
    # The failed instance loads again, as the spare, and stays out of the router once READY.
    assert after[victim.instance_id].state != controller_pb2.INSTANCE_STATE_READY
    ready = all_ready(cluster, 3)
    assert workers(cluster) == urls(ready, spare=False) and len(urls(ready, spare=False)) == 2


def test_a_restarted_controller_keeps_who_serves_and_who_is_spare(cluster):
    before = all_ready(cluster, 3)
    flags = {i: inst.spare for i, inst in before.items()}
    controller = cluster.process("controller")
    controller.process.send_signal(signal.SIGTERM)
    controller.process.wait(timeout=30)
    cluster.processes.remove(controller)
    cluster.launch_controller(0)
    cluster.wait_serving(cluster.controller_address, 30, cluster.credentials())
    after = all_ready(cluster, 3)
    assert {i: inst.spare for i, inst in after.items()} == flags
    assert sorted(flags.values()) == [False, False, True]
    wait_for(lambda: workers(cluster) == urls(after, spare=False), timeout=30, interval=0.2)
