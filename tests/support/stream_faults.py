"""Engines behind `motorctl up`'s front door, for faults under a stream: which engine serves a
stream (the worker vllm-router sent it to: its decisions counter), every engine routed again
after one was replaced, the door's own Prometheus series."""

from __future__ import annotations

import json

from motor.v1 import controller_pb2
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


def router_decisions(local) -> dict[str, float]:
    """How many requests vllm-router has sent each worker (URL -> its decisions counter)."""
    status, text = http("GET", f"http://127.0.0.1:{local.metrics_ports['router']}/metrics", timeout=5)
    assert status == 200, text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm_router_policy_decisions_total") and 'worker="' in line:
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            counts[worker] = counts.get(worker, 0.0) + float(line.rpartition(" ")[2])
    return counts


def routed_to(local, stub, before: dict[str, float], only: bool = True):
    """The engine the router sent requests to since `before` (router_decisions), the most of them
    (`only`: all of them): the one serving a stream, however fast it answers (an engine's in-flight
    count may not show a short one)."""

    def moved_since() -> dict[str, float]:
        now = router_decisions(local)
        return {url: count - before.get(url, 0.0) for url, count in now.items() if count > before.get(url, 0.0)}

    moved = wait_for(moved_since, timeout=5, interval=0.05, what="the router's decisions to move")
    assert len(moved) == 1 or not only, f"the router's decisions moved for {moved}"
    endpoints = stub.ListEndpoints(controller_pb2.ListEndpointsRequest(), timeout=5).endpoints
    by_url = {e.url.rstrip("/"): e.engine_id for e in endpoints}
    ranked = [url.rstrip("/") for url in sorted(moved, key=moved.get, reverse=True)]
    engine_id = next((by_url[url] for url in ranked if url in by_url), None)
    assert engine_id is not None, f"the router's decisions moved for {moved}, none an endpoint of {sorted(by_url)}"
    return next(e for e in engines(stub) if e.engine_id == engine_id)


def door_series(router_url: str, prefix: str) -> dict[str, float]:
    """The door's /metrics samples whose name starts with `prefix`."""
    status, text = http("GET", router_url + "/metrics", timeout=5)
    assert status == 200, text
    return {k: v for k, v in parse_metrics(text)[0].items() if k.startswith(prefix)}


def total(series: dict[str, float], name: str) -> float:
    return sum(v for k, v in series.items() if k == name or k.startswith(name + "{"))
