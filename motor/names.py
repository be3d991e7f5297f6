"""Ids and enum names shared by every service and client."""

from __future__ import annotations

import re

from motor.errors import InvalidArgument
from motor.v1 import types_pb2

INSTANCE_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
ENGINE_ID_PATTERN = re.compile(r"^(?P<instance>[a-z0-9][a-z0-9._-]{0,62})/rank(?P<rank>\d+)$")

ROLE_NAMES = {
    types_pb2.ROLE_PREFILL: "prefill",
    types_pb2.ROLE_DECODE: "decode",
    types_pb2.ROLE_UNION: "union",
}
ROLES_BY_NAME = {name: role for role, name in ROLE_NAMES.items()}


def engine_id(instance_id: str, dp_rank: int) -> str:
    return f"{instance_id}/rank{dp_rank}"


def parse_engine_id(value: str) -> tuple[str, int]:
    match = ENGINE_ID_PATTERN.match(value)
    if not match:
        raise InvalidArgument(
            f"engine_id {value!r} is not of the form '<instance_id>/rank<dp_rank>' (e.g. 'prefill-0/rank1')"
        )
    return match["instance"], int(match["rank"])


def check_instance_id(value: str, field: str = "instance_id") -> str:
    if not INSTANCE_ID_PATTERN.match(value or ""):
        raise InvalidArgument(
            f"{field} {value!r} must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


def role_name(role: int) -> str:
    """ROLE_PREFILL -> 'prefill'."""
    return ROLE_NAMES.get(role, "unspecified")


def parse_role(value: str | int, field: str = "role") -> int:
    """'prefill', 'ROLE_PREFILL' or 1 -> ROLE_PREFILL; anything else is INVALID_ARGUMENT."""
    if isinstance(value, int) and value in ROLE_NAMES:
        return value
    text = str(value).strip().lower()
    if text.startswith("role_"):
        text = text[len("role_") :]
    if text in ROLES_BY_NAME:
        return ROLES_BY_NAME[text]
    raise InvalidArgument(f"{field} {value!r} is not a role: use prefill, decode or union")


def enum_short_name(enum_type, value: int) -> str:
    """HEALTH_STATUS_NORMAL -> 'NORMAL' (for tables and logs)."""
    full = enum_type.Name(value)
    prefix = enum_type.DESCRIPTOR.name
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", prefix).upper() + "_"
    return full[len(snake) :] if full.startswith(snake) else full
