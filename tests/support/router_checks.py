"""What the router tests read off a local cluster and its router: its workers, the endpoints listed,
requests routed to every engine; the deployments they apply."""

from __future__ import annotations

import json

import grpc

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import (
    controller_pb2,
    controller_pb2_grpc,
)
from tests.support import wait_for
from tests.support.open_load import http


def listed_urls(cluster) -> set[str]:
    with grpc.insecure_channel(cluster.controller_address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        return {e.url for e in stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints}


def router_workers(cluster) -> set[str]:
    status, text = http("GET", cluster.router_url + "/list_workers")
    assert status == 200, text
    return set(json.loads(text)["urls"])


def all_three_routed(cluster) -> set[str]:
    urls = listed_urls(cluster)
    wait_for(
        lambda: len(listed_urls(cluster)) == 3 and router_workers(cluster) == listed_urls(cluster),
        timeout=90,
        interval=0.2,
        what="the router's workers equal to the three listed endpoints",
    )
    return urls


SIM = {"engine_type": "sim", "engine_args": {"model": "sim-tiny", "latency_ms": 20}}


def union(count: int) -> controller_pb2.Deployment:
    return deployment_from_dict(
        {
            "name": "routed",
            "model": "sim-tiny",
            "instance_groups": [{"name": "union", "role": "union", "count": count, "accelerators_per_engine": 1}],
            "engine_config": {"motor_engine_union_config": SIM},
        }
    )


def apply(cluster, deployment) -> None:
    with cluster.credentials().channel(cluster.controller_address) as channel:
        controller_pb2_grpc.ControllerServiceStub(channel).ApplyDeployment(
            controller_pb2.ApplyDeploymentRequest(deployment=deployment), timeout=30
        )


def workers(cluster) -> set[str]:
    status, text = http("GET", cluster.router_url + "/list_workers")
    assert status == 200, text
    return set(json.loads(text)["urls"])
