"""Autoscaling end to end on real processes: sim engine servers report their requests in flight to
their node managers, the node managers to the controller in heartbeats, and the controller's
autoscaler raises the count with the warm spare serving at once, then lowers it when idle."""

from __future__ import annotations

import json
import threading
import urllib.request

import grpc

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2 as C
from motor.v1 import controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for


def deployment() -> C.Deployment:
    engine_args = {"model": "sim-tiny", "latency_ms": 1500, "max_num_seqs": 1}
    group = {
        "name": "chat",
        "role": "union",
        "count": 1,
        "spares": 1,
        "accelerators_per_engine": 1,
        "autoscaling": {"min": 1, "max": 3, "target_in_flight": 2, "scale_down_delay_s": 5},
    }
    return deployment_from_dict(
        {
            "name": "auto",
            "model": "sim-tiny",
            "instance_groups": [group],
            "engine_config": {"motor_engine_union_config": {"engine_type": "sim", "engine_args": engine_args}},
        }
    )


def complete(url: str) -> None:
    body = json.dumps({"model": "sim-tiny", "prompt": "x", "max_tokens": 2}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200


def test_requests_in_flight_scale_the_group_up_with_the_spare_first_and_back_down(tmp_path):
    cluster = LocalCluster(str(tmp_path), nodes=2, heartbeat_interval=0.5, engine_port_base=33600, metrics_port=0)
    try:
        cluster.start(timeout=60)
        with grpc.insecure_channel(cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment()), timeout=30)

            def instances() -> dict[str, C.Instance]:
                reply = stub.ListInstances(C.ListInstancesRequest(), timeout=5)
                return {i.instance_id: i for i in reply.instances}

            def count() -> int:
                return (
                    stub.GetDeployment(C.GetDeploymentRequest(name="auto"), timeout=5)
                    .deployment.instance_groups[0]
                    .count
                )

            wait_for(
                lambda: (
                    len(found := instances()) == 2 and all(i.state == C.INSTANCE_STATE_READY for i in found.values())
                ),
                timeout=60,
                what="chat-0 serving and chat-1 the READY spare",
            )
            serving = instances()["chat-0"].engines[0]
            url = f"http://{serving.host}:{serving.port}"
            # 16 requests at once on an engine that serves one at a time, 1.5 s each: about 16 in
            # flight, falling by one every 1.5 s, against a target of 2: the most, 3.
            senders = [threading.Thread(target=complete, args=(url,), daemon=True) for _ in range(16)]
            for sender in senders:
                sender.start()
            wait_for(lambda: count() == 3, timeout=40, what="the count raised to 3")
            found = instances()
            assert not found["chat-1"].spare  # the spare serves: promoted, not started
            assert sum(1 for i in found.values() if i.spare) == 1  # a new spare in its place
            [summary] = stub.ListDeployments(C.ListDeploymentsRequest(), timeout=5).deployments
            assert summary.scale[0].desired == 3 and summary.scale[0].reason.startswith("chat: 1 -> 3, in flight ")
            for sender in senders:
                sender.join(timeout=60)
            wait_for(lambda: count() == 1, timeout=60, what="the count lowered to 1 once idle")
    finally:
        problems = cluster.stop()
        assert not problems, problems
