"""A changed engine argument of the real vLLM CPU engine rolled out behind `motorctl up`'s router
(vllm-router and motor-router-sync) under a few requests: the new engine loads while the old one
serves, the old one leaves the router and drains only once the new one serves, and no request
fails. The node's accelerators are its two CPU cores (`--accelerator-type cpu`), so the old engine
and the new one each have a core of their own, and the loading one never moves onto the serving
one's core (where, unbound, it stalled for minutes in about half of the runs: docs/vllm.md)."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from motor.contract.deployment_file import deployment_from_dict
from motor.v1 import controller_pb2, controller_pb2_grpc
from motorctl.local_cluster import LocalCluster
from tests.support import wait_for
from tests.support.open_load import http
from tests.support.vllm_engines import START_TIMEOUT, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
C = controller_pb2


def deployment(model_path: str, **engine_args) -> C.Deployment:
    name = os.path.basename(model_path)
    section = vllm_config(model_path, served_model_name=name, **engine_args)["motor_engine_prefill_config"]
    return deployment_from_dict(
        {
            "name": "vllm",
            "model": name,
            "engine_config": {"motor_engine_prefill_config": section},
            "instance_groups": [{"name": "prefill", "role": "prefill", "count": 1}],
            "strategy": {"min_ready": "2s"},
        }
    )


# Two vLLM loads one after the other (the old engine, then the surge one while the old serves):
# about 20 s each alone, minutes on the shared 2-core machine under load.
@pytest.mark.timeout(1800)
def test_a_changed_engine_argument_rolls_out_with_no_failed_request(tiny_model, vllm_env, tmp_path):
    local = LocalCluster(
        str(tmp_path / "run"),
        nodes=1,
        node_id_prefix="vllm-roll",
        accelerators_per_node=2,  # the old engine and the surge one, a core each
        accelerator_type="cpu",
        engine_port_base=38600,
        router_port=0,
        extra_node_args=["--model-root", os.path.dirname(tiny_model)],
    )
    with pytest.MonkeyPatch.context() as patch:
        for name, value in vllm_env.items():
            patch.setenv(name, value)
        local.start(timeout=60)
    channel = grpc.insecure_channel(local.controller_address)
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    model = os.path.basename(tiny_model)

    def settled(revision: int) -> bool:
        summary = stub.ListDeployments(C.ListDeploymentsRequest(), timeout=5).deployments[0]
        instances = stub.ListInstances(C.ListInstancesRequest(), timeout=5).instances
        status, _ = http("GET", local.router_url + "/list_workers")
        return (
            summary.rollout_state == C.ROLLOUT_STATE_COMPLETE
            and len(instances) == 1
            and instances[0].revision == revision
            and instances[0].state == C.INSTANCE_STATE_READY
            and status == 200
            and len(stub.ListEndpoints(C.ListEndpointsRequest(), timeout=5).endpoints) == 1
        )

    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def ask() -> None:  # a request every 0.5 s, each waited for
        while not stop.is_set():
            body = {"model": model, "prompt": "Hello", "max_tokens": 3}
            try:
                results.append(http("POST", local.router_url + "/v1/completions", body, timeout=60))
            except OSError as exc:
                results.append((0, str(exc)))
            time.sleep(0.5)

    asker = threading.Thread(target=ask, daemon=True)
    try:
        first = C.ApplyDeploymentRequest(deployment=deployment(tiny_model))
        revision = stub.ApplyDeployment(first, timeout=10).revision
        wait_for(lambda: settled(revision), timeout=3 * START_TIMEOUT, interval=1, what="the vLLM engine serving")
        old = stub.ListInstances(C.ListInstancesRequest(), timeout=5).instances[0].instance_id
        asker.start()
        time.sleep(2)
        changed = deployment(tiny_model, max_num_seqs=8)  # a changed engine argument: a new launch spec
        revision = stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=changed), timeout=10).revision
        wait_for(lambda: settled(revision), timeout=3 * START_TIMEOUT, interval=1, what="the rollout complete")
        new = stub.ListInstances(C.ListInstancesRequest(), timeout=5).instances[0].instance_id
        time.sleep(3)
    finally:
        stop.set()
        if asker.is_alive():
            asker.join(timeout=70)
        channel.close()
        assert not local.stop()
    failed = [r for r in results if r[0] != 200]
    assert len(results) >= 10 and failed == [], f"{len(failed)} of {len(results)} failed: {failed[:3]}"
    assert (old, new) == ("prefill-0", "prefill-1")  # a new instance loaded while the old one served
