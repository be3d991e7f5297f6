"""A deployment's engine_config checked at apply as its engine servers will read it.

Without this an engine_args typo (`latncy_ms: 5`) became a revision, and its cause surfaced only
as a start-up failure of every engine of the rollout. Each section is validated with the engine
server's own models (motor/contract/user_config.py) and its engine class's `check_args`: the
simulated engine's and SGLang's fields exactly. vLLM's check imports vLLM and reads the model
(seconds, and the controller's host may have neither): its argument names are checked by
motor/contract/engine_policy.py against the pinned vLLM's (motor/contract/vllm_request_args.py),
the rest by the engine server at start-up.
"""

from __future__ import annotations

from pydantic import ValidationError

from motor.contract.user_config import UserConfig
from motor.errors import ConfigError
from motor.service.config import describe_validation_error


def engine_config_problems(engine_config: dict, field: str = "engine_config") -> list[str]:
    """What an engine server would refuse in `engine_config` (numbers already integral where whole),
    each named by its path, e.g. `engine_config.motor_engine_decode_config.engine_args.latncy_ms:
    Extra inputs are not permitted; did you mean 'latency_ms'?`."""
    from engine_server.engines import engine_class  # the engines import the config models

    try:
        config = UserConfig.model_validate(engine_config)
    except ValidationError as exc:
        return [describe_validation_error(exc, field, UserConfig)]
    problems = []
    for name in config.present():
        section = getattr(config, name)
        engine = engine_class(section.engine_type) if section.engine_type != "vllm" else None
        if engine is None or engine.slow_check_args:
            continue
        try:
            engine.check_args(section.engine_args, f"{field}.{name}.engine_args")
        except ConfigError as exc:
            problems.append(str(exc))
    return problems
