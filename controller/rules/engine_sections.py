"""A deployment's engine_config checked at apply as its engine servers will read it.

Without this an engine_args typo (`latncy_ms: 5`) became a revision, and its cause surfaced only
as a start-up failure of every engine of the rollout. Each section is validated with the engine
server's own models (motor/contract/user_config.py, and motor/contract/engine_args.py for the
engine_args): the simulated engine's and SGLang's fields exactly. vLLM's check imports vLLM and reads the model
(seconds, and the controller's host may have neither): its argument names are checked by
motor/contract/engine_policy.py against the pinned vLLM's (motor/contract/vllm_request_args.py),
the rest by the engine server at start-up.
"""

from __future__ import annotations

from pydantic import ValidationError

from motor.contract.engine_args import SglangArgs, SimArgs
from motor.contract.user_config import UserConfig
from motor.service.config import describe_validation_error

# The engine_args models of the engines whose arguments are Motor's own.
ARGS_MODELS = {"sim": SimArgs, "sglang": SglangArgs}


def engine_config_problems(engine_config: dict, field: str = "engine_config") -> list[str]:
    """What an engine server would refuse in `engine_config` (numbers already integral where whole),
    each named by its path, e.g. `engine_config.motor_engine_decode_config.engine_args.latncy_ms:
    Extra inputs are not permitted; did you mean 'latency_ms'?`."""
    try:
        config = UserConfig.model_validate(engine_config)
    except ValidationError as exc:
        return [describe_validation_error(exc, field, UserConfig)]
    problems = []
    for name in config.present():
        section = getattr(config, name)
        model = ARGS_MODELS.get(section.engine_type)
        if model is None:
            continue
        try:
            model.model_validate(section.engine_args)
        except ValidationError as exc:
            problems.append(describe_validation_error(exc, f"{field}.{name}.engine_args", model))
    return problems
