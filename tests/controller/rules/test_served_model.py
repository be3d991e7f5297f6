"""A deployment's engines serve its model: a file whose engine_args name another model is refused
at apply (it rolled out COMPLETE and answered every request 404), and every engine is started with
the deployment's model in its section, which its engine server holds it to
(tests/engine_server/test_served_model.py)."""

from __future__ import annotations

import json

import pytest

from controller.rules.deployment_checks import validate_deployment
from motor.contract.deployment_file import deployment_from_dict
from motor.contract.user_config import UserConfig
from motor.errors import InvalidArgument
from tests.support import async_wait_for
from tests.support.controller_harness import small_deployment


def deployment(model: str, engine_type: str, engine_args: dict):
    return deployment_from_dict(
        {
            "name": "d",
            "model": model,
            "engine_config": {"motor_engine_union_config": {"engine_type": engine_type, "engine_args": engine_args}},
            "instance_groups": [{"name": "u", "role": "union"}],
        }
    )


@pytest.mark.parametrize(
    ("engine_type", "engine_args", "named"),
    [
        ("sim", {"model": "sim-other"}, "engine_args.model: 'sim-other'"),
        ("vllm", {"model": "/models/small", "served_model_name": "sim-other"}, "engine_args.served_model_name"),
        (
            "vllm",
            {"model": "/models/small", "served_model_name": ["a", "b"]},
            "engine_args.served_model_name: 'a' or 'b'",
        ),
        ("vllm", {"model": "/models/small"}, "engine_args.model: '/models/small'"),
        ("sglang", {"model_path": "/models/small"}, "engine_args.model_path"),
    ],
)
def test_engine_args_serving_another_model_are_refused_naming_both(engine_type, engine_args, named):
    with pytest.raises(InvalidArgument) as refused:
        validate_deployment(deployment("sim-small", engine_type, engine_args))
    message = str(refused.value)
    assert f"engine_config.motor_engine_union_config.{named}" in message
    assert "not the deployment's model 'sim-small'" in message


@pytest.mark.parametrize(
    ("engine_type", "engine_args"),
    [
        ("sim", {"model": "sim-small"}),
        ("sim", {}),
        ("vllm", {"model": "/models/small", "served_model_name": "sim-small"}),
        ("vllm", {"model": "/models/small", "served_model_name": ["other", "sim-small"]}),
        ("vllm", {"model": "sim-small"}),
        ("sglang", {"model_path": "/models/small", "served_model_name": "sim-small"}),
    ],
)
def test_engine_args_serving_the_deployments_model_are_accepted(engine_type, engine_args):
    validate_deployment(deployment("sim-small", engine_type, engine_args))


async def test_every_engine_is_started_with_the_deployments_model_in_its_section(harness):
    """...and a simulated engine whose arguments name no model serves the deployment's."""
    await harness.start()
    await harness.register("node-a")
    harness.controller.apply_deployment(
        small_deployment([{"name": "u", "role": "union", "count": 2}], model="sim-small")
    )
    await async_wait_for(lambda: len(harness.client.starts()) == 2, timeout=5, what="2 StartEngine calls")
    for spec in harness.client.starts():
        config = UserConfig.model_validate(json.loads(spec.config_json))
        _, section = config.section_for("union")
        assert section.deployment_model == "sim-small"
        assert section.engine_args["model"] == "sim-small"
