"""Reads a deployment file (YAML or JSON) into a motor.v1.Deployment.

Roles (and restart scopes, strategy types: "recreate") may be written as people say them ("prefill")
or as enum names ("ROLE_PREFILL");
durations as protobuf JSON strings ("1s", "0.5s"). Meaning (unique group names, pairs,
counts) is checked by the controller, the one owner of deployment validation.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from motor.errors import InvalidArgument
from motor.service.config import read_document
from motor.v1 import controller_pb2

_ENUM_PREFIXES = {"role": "ROLE_", "scope": "RESTART_SCOPE_", "type": "UPDATE_STRATEGY_TYPE_"}


def _normalize(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: _normalize(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize(v, key) for v in value]
    prefix = _ENUM_PREFIXES.get(key or "")
    if prefix and isinstance(value, str) and not value.upper().startswith(prefix):
        return prefix + value.upper()
    if prefix and isinstance(value, str):
        return value.upper()
    return value


def json_problem(value: Any, where: str) -> str | None:
    """What in a YAML document is not JSON, named by its path (None when all of it is): a
    protobuf Struct takes only string keys and JSON values, and said 'Unexpected type' or raised
    TypeError naming nothing."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where}: the key {key!r} is not a string; quote it"
            problem = json_problem(item, f"{where}.{key}")
            if problem:
                return problem
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problem = json_problem(item, f"{where}[{index}]")
            if problem:
                return problem
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            return f"{where}: a number too large to hold ({len(str(value))} digits); quote it or make it smaller"
    elif not isinstance(value, (str, float, bool, type(None))):
        return f"{where}: a {type(value).__name__} value ({value}) is not JSON; quote it"
    return None


def deployment_from_dict(data: Any, source: str = "deployment") -> controller_pb2.Deployment:
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: expected a mapping with name, model, engine_config and instance_groups")
    engine_config = data.get("engine_config")
    body = {k: v for k, v in data.items() if k != "engine_config"}
    deployment = controller_pb2.Deployment()
    try:
        json_format.ParseDict(_normalize(body), deployment)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"{source}: {exc}") from None
    if engine_config is not None:
        if not isinstance(engine_config, dict):
            raise InvalidArgument(f"{source}: engine_config must be a mapping (the engine servers' user_config)")
        problem = json_problem(engine_config, "engine_config")
        if problem:
            raise InvalidArgument(f"{source}: {problem}")
        deployment.engine_config.update(engine_config)
    return deployment


def load_deployment(path: str) -> controller_pb2.Deployment:
    return deployment_from_dict(read_document(path), source=path)
