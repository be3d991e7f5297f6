"""Local weights and the nodes' model roots: ApplyDeployment refuses a deployment naming a local
path that no registered node allows (naming --model-root); with no node registered it accepts it;
an instance whose start a node refuses for the spec itself fails at once, saying why, instead of
spending its restart budget."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controller.engines.node_client import NodeCallError
from motor.contract.deployment_file import deployment_from_dict
from motor.contract.engine_policy import check_engine_config
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2 as C
from tests.support import async_wait_for
from tests.support.controller_harness import node_info

MODEL = "/models/llama/tiny"


def local_weights(model: str = MODEL, **extra) -> C.Deployment:
    section = {"engine_type": "vllm", "engine_args": {"model": model, "served_model_name": "tiny"}}
    return deployment_from_dict(
        {
            "name": "tiny",
            "model": "tiny",
            "engine_config": {"motor_engine_prefill_config": section},
            "instance_groups": [{"name": "tiny", "role": "union"}],
            **extra,
        }
    )


async def register(harness, node_id: str, roots: list[str]) -> None:
    info = node_info(node_id)
    info.model_roots.extend(roots)
    reply = await harness.controller.register_node(info, harness.client.report(node_id))
    harness.generations[node_id] = reply.generation


async def test_a_local_path_no_registered_node_allows_is_refused_at_apply_naming_the_flag(harness, served):
    await register(harness, "node-a", [])
    await register(harness, "node-b", ["/weights"])
    with pytest.raises(grpc.RpcError) as refused:
        await served.ApplyDeployment(C.ApplyDeploymentRequest(deployment=local_weights()), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "engine_config.motor_engine_prefill_config.engine_args.model: '/models/llama/tiny' is a local path that "
        "no registered node allows (node-a allows no local paths; node-b allows only /weights): start the node "
        "managers with --model-root DIR, a folder holding it (motorctl up --model-root DIR; compose: "
        "MOTOR_MODEL_ROOTS), then apply again"
    )
    assert not harness.controller.instances and not harness.client.starts()


async def test_one_node_allowing_the_path_is_enough_and_model_names_are_not_paths(harness, served):
    await register(harness, "node-a", [])
    await served.ApplyDeployment(C.ApplyDeploymentRequest(deployment=local_weights("Qwen/Qwen2-0.5B")), timeout=5)
    await register(harness, "node-b", ["/models"])
    applied = await served.ApplyDeployment(C.ApplyDeploymentRequest(deployment=local_weights()), timeout=5)
    assert applied.revision == 2


async def test_with_no_node_registered_the_deployment_is_accepted_and_waits(harness, served):
    await served.ApplyDeployment(C.ApplyDeploymentRequest(deployment=local_weights()), timeout=5)
    assert harness.instance("tiny-0").state == C.INSTANCE_STATE_PENDING


def refusal_of(node_roots: list[str]) -> NodeCallError:
    """The node manager's own refusal of the spec (node_manager/specs.py checks the same way)."""
    config = {"motor_engine_prefill_config": {"engine_type": "vllm", "engine_args": {"model": MODEL}}}
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(config, node_roots, "spec.config_json")
    return NodeCallError("INVALID_ARGUMENT", str(refused.value))


async def test_a_start_the_node_refuses_for_the_spec_itself_fails_the_instance_at_once(harness):
    """The node was registered allowing /models, then restarted without it (its refusal is
    what counts): one start, one failure event, FAILED with the node's words, no restart."""
    await harness.start()
    await register(harness, "node-a", ["/models"])
    harness.client.start_errors["tiny-0/rank0"] = refusal_of([])
    await harness.controller.apply(local_weights(restart_policy={"initial_backoff": "0.1s"}))
    inst = harness.instance("tiny-0")
    await async_wait_for(lambda: inst.state == C.INSTANCE_STATE_FAILED, timeout=5, what="the instance FAILED")
    assert "is a local path outside a model root (the node allows no local paths: --model-root)" in inst.reason
    assert inst.reason.endswith(
        "not restarted: the node would refuse the same spec again (fix what it names: the node's settings or the "
        "deployment); left alone until the deployment is applied again"
    )
    await asyncio.sleep(0.5)  # restarts would come at 0 s, 0.1 s, 0.2 s ...
    assert len(harness.client.starts("tiny-0/rank0")) == 1 and inst.restarts == 0
    failures = [e for e in harness.controller.events.recent if e.type == C.EVENT_TYPE_ENGINE_FAILED]
    assert len(failures) == 1 and "StartEngine INVALID_ARGUMENT: spec.config_json." in failures[0].message
    # Once the node allows it, applying the deployment again gives the instance a new chance.
    await harness.controller.apply(local_weights(restart_policy={"initial_backoff": "0.1s"}))
    await async_wait_for(lambda: len(harness.client.starts("tiny-0/rank0")) == 2, timeout=5, what="started again")
    assert harness.instance("tiny-0").state != C.INSTANCE_STATE_FAILED
