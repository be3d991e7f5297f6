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


def engine_config_problems(engine_config: dict, field: str = "engine_config", model: str = "") -> list[str]:
    """What an engine server would refuse in `engine_config` (numbers already integral where whole),
    each named by its path, e.g. `engine_config.motor_engine_decode_config.engine_args.latncy_ms:
    Extra inputs are not permitted; did you mean 'latency_ms'?`; with the deployment's `model`,
    also an engine that would serve another name (its requests would all get 404)."""
    try:
        config = UserConfig.model_validate(engine_config)
    except ValidationError as exc:
        return [describe_validation_error(exc, field, UserConfig)]
    problems = []
    for name in config.present():
        section = getattr(config, name)
        args_model = ARGS_MODELS.get(section.engine_type)
        if args_model is not None:
            try:
                args_model.model_validate(section.engine_args)
            except ValidationError as exc:
                problems.append(describe_validation_error(exc, f"{field}.{name}.engine_args", args_model))
                continue
        if model:
            problems.extend(served_name_problems(section.engine_type, section.engine_args, model, f"{field}.{name}"))
    return problems


# Where each engine takes the names it answers to: (the argument naming them, the fallback).
SERVED_NAME_ARGS = {
    "sim": ("model", None),
    "vllm": ("served_model_name", "model"),
    "sglang": ("served_model_name", "model_path"),
}


def served_names(engine_type: str, engine_args: dict) -> tuple[str, list[str]]:
    """(the engine_args key that names them, the model names an engine with these arguments answers
    to in requests and GET /v1/models); no names when the arguments do not say (a simulated engine
    without a model serves the deployment's, a vLLM one without a model is refused at start)."""
    key, fallback = SERVED_NAME_ARGS[engine_type]
    value = engine_args.get(key)
    if value is None and fallback is not None:
        key, value = fallback, engine_args.get(fallback)
    if value is None and engine_type == "sim":
        return key, []  # it is started with the deployment's model (controller/model/deployments.py)
    if isinstance(value, str):
        return key, [value]
    if isinstance(value, list):  # vLLM takes several names (served_model_name: [a, b])
        return key, [v for v in value if isinstance(v, str)]
    return key, []


def served_name_problems(engine_type: str, engine_args: dict, model: str, where: str) -> list[str]:
    """The engine would answer to other names than the deployment's `model`: the rollout would end
    COMPLETE with every request for `model` answered 404."""
    key, served = served_names(engine_type, engine_args)
    if not served or model in served:
        return []
    shown = " or ".join(repr(name) for name in served)
    return [
        f"{where}.engine_args.{key}: {shown}, not the deployment's model {model!r}: its engines would answer "
        f"every request for {model!r} 404; make them the same"
    ]
