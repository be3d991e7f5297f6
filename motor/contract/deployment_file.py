"""Reads a deployment file (YAML or JSON) into a motor.v1.Deployment.

Roles (and restart scopes, strategy types: "recreate") may be written as people say them ("prefill")
or as enum names ("ROLE_PREFILL");
durations, wherever one is taken, as motor/contract/durations.py reads them (60, "60s", "5m",
"500ms"). Meaning (unique group names, pairs,
counts) is checked by the controller, the one owner of deployment validation.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from motor.contract.durations import FORMS as DURATION_FORMS
from motor.contract.durations import parse_seconds, protobuf_json
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


_INTEGERS = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_SFIXED32,
    FieldDescriptor.TYPE_SFIXED64,
}
_WHOLE_NUMBERS = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32,
                  FieldDescriptor.TYPE_FIXED64}  # fmt: skip
# Number fields that hold a duration in seconds (the rest of them are google.protobuf.Duration).
SECONDS_FIELDS = {"scale_down_delay_s"}


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _enum_words(field: FieldDescriptor) -> list[str]:
    """An enum's values as the file writes them ("prefill" for ROLE_PREFILL), UNSPECIFIED left out."""
    prefix = _ENUM_PREFIXES.get(field.name, "")
    return [v.name[len(prefix) :].lower() for v in field.enum_type.values if not v.name.endswith("_UNSPECIFIED")]


def shape_problems(value: Any, descriptor: Descriptor, where: str = "") -> list[str]:
    """What in a document does not fit the message `descriptor`, each named by its path as the
    file spells it (`instance_groups[0].data_parallel_size: expected an integer, got 'one'`):
    protobuf's own parser names fields in camelCase, by their message type, one at a time."""
    if not isinstance(value, dict):
        return [f"{where or '(top level)'}: expected a mapping, got {_shown(value)}"]
    problems: list[str] = []
    fields = {f.name: f for f in descriptor.fields}
    by_json_name = {f.json_name: f for f in descriptor.fields}
    for key, item in value.items():
        path = f"{where}.{key}" if where else str(key)
        field = fields.get(key) or by_json_name.get(key)
        if field is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{path}: unknown field{hint} (fields here: {', '.join(fields)})")
        elif field.is_repeated:
            if not isinstance(item, list):
                problems.append(f"{path}: expected a list, got {_shown(item)}")
                continue
            for index, element in enumerate(item):
                problems.extend(_value_problems(element, field, f"{path}[{index}]"))
        elif item is not None:
            problems.extend(_value_problems(item, field, path))
    return problems


def _value_problems(value: Any, field: FieldDescriptor, path: str) -> list[str]:
    if field.message_type is not None:
        name = field.message_type.full_name
        if name == "google.protobuf.Duration":
            return _duration_problems(value, path)
        if name.startswith("google.protobuf."):
            return []  # a Struct: the engines' own configuration, checked by the controller
        return shape_problems(value, field.message_type, path)
    if field.enum_type is not None:
        words = _enum_words(field)
        prefix = _ENUM_PREFIXES.get(field.name, "")
        text = value.lower().removeprefix(prefix.lower()) if isinstance(value, str) else None
        return [] if text in words else [f"{path}: {_shown(value)} is not one of {', '.join(words)}"]
    if field.type in _INTEGERS | _WHOLE_NUMBERS:
        number = value if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, float) and value.is_integer():
            number = int(value)
        if number is None:
            return [f"{path}: expected an integer, got {_shown(value)}"]
        if field.type in _WHOLE_NUMBERS and number < 0:
            return [f"{path}: expected a whole number (0 or more), got {value}"]
        return []
    if field.name in SECONDS_FIELDS:
        return _duration_problems(value, path)
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _number_problems(value, path)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return [] if isinstance(value, bool) else [f"{path}: expected true or false, got {_shown(value)}"]
    if field.type == FieldDescriptor.TYPE_STRING and not isinstance(value, str):
        return [f"{path}: expected a string (quote it), got {_shown(value)}"]
    return []


def _number_problems(value: Any, path: str) -> list[str]:
    """A number field (autoscaling's target and delay): protobuf's parser named it by its message
    type, took nan and inf, which no comparison with them holds, and a quoted number, which an
    integer field refuses (the file reader reads 1e3 as a number: motor/service/config.py)."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            pass
    if number is None:
        hint = ""
        if isinstance(value, str) and _is_number(value):
            hint = f" (a quoted number: write it without quotes, {value.strip()})"
        return [f"{path}: expected a number, got {_shown(value)}{hint}"]
    if not math.isfinite(number):
        return [f"{path}: expected a finite number, got {value}"]
    return []


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _duration_problems(value: Any, path: str) -> list[str]:
    return (
        []
        if parse_seconds(value) is not None
        else [f"{path}: expected a duration ({DURATION_FORMS}), got {_shown(value)}"]
    )


def _durations_as_protobuf(value: Any, descriptor: Descriptor) -> Any:
    """The document with every duration as protobuf JSON takes it: a Duration as "<seconds>s", a
    seconds field as a number (after shape_problems: each one is a duration)."""
    if not isinstance(value, dict):
        return value
    fields = {f.name: f for f in descriptor.fields} | {f.json_name: f for f in descriptor.fields}
    out = {}
    for key, item in value.items():
        field = fields.get(key)
        if field is None or item is None:
            out[key] = item
        elif field.message_type is not None and field.message_type.full_name == "google.protobuf.Duration":
            out[key] = protobuf_json(parse_seconds(item))
        elif field.name in SECONDS_FIELDS:
            out[key] = parse_seconds(item)
        elif field.message_type is not None and not field.message_type.full_name.startswith("google.protobuf."):
            elements = item if field.is_repeated else [item]
            converted = [_durations_as_protobuf(element, field.message_type) for element in elements]
            out[key] = converted if field.is_repeated else converted[0]
        else:
            out[key] = item
    return out


def deployment_from_dict(data: Any, source: str = "deployment") -> controller_pb2.Deployment:
    if not isinstance(data, dict):
        raise InvalidArgument(f"{source}: expected a mapping with name, model, engine_config and instance_groups")
    engine_config = data.get("engine_config")
    body = {k: v for k, v in data.items() if k != "engine_config"}
    problems = shape_problems(body, controller_pb2.Deployment.DESCRIPTOR)
    if problems:
        raise InvalidArgument(f"{source}: " + "; ".join(problems))
    deployment = controller_pb2.Deployment()
    try:
        json_format.ParseDict(_normalize(_durations_as_protobuf(body, deployment.DESCRIPTOR)), deployment)
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
