"""Two deployments of different models side by side on one cluster of real processes (controller,
node manager, simulated engine servers): each model's requests reach only its engines, and
deleting one deployment leaves the other's engines (same pids) serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from motor.v1 import controller_pb2 as C
from tests.support import wait_for
from tests.support.process_cluster import apply, make_cluster, model_deployment  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


def complete(url: str, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_two_models_side_by_side_and_deleting_one_leaves_the_others_engines(make_cluster):
    cluster = make_cluster(nodes=1, accelerators=4)
    apply(cluster, model_deployment("chat", "sim-chat", 2))
    apply(cluster, model_deployment("embed", "sim-embed", 1))
    wait_for(lambda: cluster.all_ready(3), timeout=90, interval=0.2, what="3 instances READY", detail=cluster.describe)
    stub = cluster.stub()
    wait_for(
        lambda: len(stub.ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints) == 3,
        timeout=30,
        what="3 endpoints",
    )
    by_model = {
        m: stub.ListEndpoints(C.ListEndpointsRequest(model=m), timeout=5).endpoints for m in ("sim-chat", "sim-embed")
    }
    assert sorted(e.engine_id for e in by_model["sim-chat"]) == ["chat-0/rank0", "chat-1/rank0"]
    assert [(e.engine_id, e.deployment, list(e.models)) for e in by_model["sim-embed"]] == [
        ("embed-0/rank0", "embed", ["sim-embed"])
    ]
    for model, endpoints in by_model.items():
        other = "sim-embed" if model == "sim-chat" else "sim-chat"
        for endpoint in endpoints:
            status, body = complete(endpoint.url, model)
            assert status == 200 and body["model"] == model
            status, body = complete(endpoint.url, other)
            assert status == 404 and body["error"]["type"] == "NotFoundError", body

    watch = stub.WatchEndpoints(C.WatchEndpointsRequest(model="sim-embed"), timeout=10)
    snapshot = next(watch)
    watch.cancel()
    assert snapshot.snapshot and [e.engine_id for e in snapshot.added] == ["embed-0/rank0"]

    embed_pid = {k: e.pid for k, e in cluster.engine_copies().items() if e.engine_id.startswith("embed")}
    stub.DeleteDeployment(C.DeleteDeploymentRequest(name="chat"), timeout=10)
    wait_for(
        lambda: (
            set(cluster.instances()) == {"embed-0"}
            and not any(k[1].startswith("chat") for k in cluster.engine_copies())
        ),
        timeout=60,
        interval=0.2,
        what="chat's engines gone",
    )
    assert {k: e.pid for k, e in cluster.engine_copies().items()} == embed_pid  # the same embed engine, not restarted
    assert complete(by_model["sim-embed"][0].url, "sim-embed")[0] == 200
    listed = stub.ListDeployments(C.ListDeploymentsRequest(), timeout=5).deployments
    assert [(d.deployment.name, d.revision, d.instances, d.ready_instances) for d in listed] == [("embed", 1, 1, 1)]
