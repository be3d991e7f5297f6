"""Engines behind `motorctl up`'s front door, for faults under a stream: which engine serves a
stream (its in-flight count, from its management plane's GetStatus), every engine routed again
after one was replaced, the door's own Prometheus series."""

from __future__ import annotations

import json

import grpc

from motor.v1 import controller_pb2, engine_pb2, engine_pb2_grpc
from tests.support import wait_for
from tests.support.open_load import http
from tests.support.vllm_engines import parse_metrics


def workers(router_url: str) -> set[str]:
    status, text = http("GET", router_url + "/list_workers", timeout=5)
    assert status == 200, text
    return set(json.loads(text)["urls"])


def all_routed(local, stub, count: int, timeout: float = 300.0) -> list[controller_pb2.Endpoint]:
    """`count` endpoints listed by the controller, and exactly those in the router."""

    def ready():
        endpoints = list(stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints)
        return (
            endpoints if len(endpoints) == count and workers(local.router_url) == {e.url for e in endpoints} else None
        )

    return wait_for(ready, timeout=timeout, interval=0.5, what=f"{count} engines in the router")


def engines(stub) -> list:
    """The nodes' engines (each with its pid and spec.mgmt_port)."""
    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes
    return [e for n in nodes for e in n.engines]


def in_flight(engine) -> int:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{engine.spec.mgmt_port}") as channel:
            status = engine_pb2_grpc.EngineServiceStub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=2)
    except grpc.RpcError:
        return -1
    return status.status.in_flight_requests


def busiest(stub, timeout: float = 10.0):
    """The engine holding the most requests in flight (at least one): the one serving a stream."""

    def found():
        counted = [(in_flight(e), e) for e in engines(stub)]
        top = max(counted, key=lambda pair: pair[0], default=(0, None))
        return top[1] if top[0] >= 1 else None

    return wait_for(found, timeout=timeout, interval=0.02, what="an engine with a request in flight")


def door_series(router_url: str, prefix: str) -> dict[str, float]:
    """The door's /metrics samples whose name starts with `prefix`."""
    status, text = http("GET", router_url + "/metrics", timeout=5)
    assert status == 200, text
    return {k: v for k, v in parse_metrics(text)[0].items() if k.startswith(prefix)}


def total(series: dict[str, float], name: str) -> float:
    return sum(v for k, v in series.items() if k == name or k.startswith(name + "{"))
