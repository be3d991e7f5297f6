"""A configuration vLLM refuses at its start (`max_model_len` above the tiny model's 512: the
engine server exits 2, config_error) is FAILED at once under the default restart policy, with
vLLM's words, after one launch (issue 61 #13: it was launched five times over 30 s first). The
controller cannot see it at apply: only vLLM's own check, reading the model, can."""

from __future__ import annotations

import time

import pytest

from motor.v1 import controller_pb2
from tests.support import wait_for
from tests.support.vllm_engines import vllm_cluster, vllm_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_configuration_vllm_refuses_at_start_is_failed_after_one_launch(tiny_model, vllm_env, tmp_path):
    section = vllm_config(tiny_model, max_model_len=100_000)["motor_engine_prefill_config"]
    found: dict[str, object] = {}
    applied = time.monotonic()

    def failed(local, stub) -> None:
        def instance():
            listed = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
            return next((i for i in listed if i.state == controller_pb2.INSTANCE_STATE_FAILED), None)

        found["instance"] = wait_for(instance, timeout=300, interval=0.5, what="the instance FAILED")
        found["took"] = time.monotonic() - applied
        stream = stub.WatchEvents(controller_pb2.WatchEventsRequest(), timeout=5)
        found["events"] = list(next(stream).snapshot.recent_events)
        stream.cancel()

    with vllm_cluster(tiny_model, vllm_env, str(tmp_path / "run"), section, failed,
                      node_id_prefix="refused", engine_port_base=38000):  # fmt: skip
        pass
    instance = found["instance"]
    assert "max_model_len" in instance.state_reason, instance.state_reason
    assert "refused this configuration at its start" in instance.state_reason, instance.state_reason
    launches = [e for e in found["events"] if e.type == controller_pb2.EVENT_TYPE_ENGINE_STARTED]
    assert len(launches) == 1, [e.message for e in launches]
    assert instance.restarts <= 1, instance
