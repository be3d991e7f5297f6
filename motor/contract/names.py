"""Ids and enum names shared by every service and client.

One id rule for node ids, instance ids and the instance part of engine ids: a DNS-label-like
name (`ID_RULE`), checked with `fullmatch` (a trailing newline or NUL is not allowed). Values
echoed in error messages are cut to a short excerpt (`excerpt`).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

from motor.errors import InvalidArgument
from motor.text import excerpt
from motor.v1 import types_pb2

_ID = r"[a-z0-9][a-z0-9._-]{0,62}"
ID_PATTERN = re.compile(_ID)
ID_RULE = "must be 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
ENGINE_ID_PATTERN = re.compile(rf"(?P<instance>{_ID})/rank(?P<rank>[0-9]{{1,9}})")
# A control character (NUL, newline, ESC...) in a text that must be printable.
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")

ROLE_NAMES = {
    types_pb2.ROLE_PREFILL: "prefill",
    types_pb2.ROLE_DECODE: "decode",
    types_pb2.ROLE_UNION: "union",
}
ROLES_BY_NAME = {name: role for role, name in ROLE_NAMES.items()}


def check_printable(value: str, field: str) -> str:
    """INVALID_ARGUMENT naming `field` when a text that ends up on a command line or in an
    address holds a control character (a NUL byte: exec refuses it; a newline splits logs)."""
    bad = CONTROL_CHARACTER.search(value)
    if bad is not None:
        raise InvalidArgument(f"{field} {excerpt(value)} holds the control character {bad[0]!r}; remove it")
    return value


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


def _id_setting(value: str) -> str:
    if not is_valid_id(value):
        raise ValueError(ID_RULE)
    return value


# A pydantic field holding a node id or another name under the id rule (errors name the field).
IdSetting = Annotated[str, AfterValidator(_id_setting)]


def check_id(value: str, field: str) -> str:
    """Return `value` when it is a valid node or instance id, else INVALID_ARGUMENT naming `field`."""
    if not is_valid_id(value):
        raise InvalidArgument(f"{field} {excerpt(value)} {ID_RULE}")
    return value


def check_instance_id(value: str, field: str = "instance_id") -> str:
    return check_id(value, field)


def check_node_id(value: str, field: str = "node_id") -> str:
    return check_id(value, field)


def engine_id(instance_id: str, dp_rank: int) -> str:
    return f"{instance_id}/rank{dp_rank}"


def parse_engine_id(value: str, field: str = "engine_id") -> tuple[str, int]:
    match = ENGINE_ID_PATTERN.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise InvalidArgument(
            f"{field} {excerpt(value)} is not of the form '<instance_id>/rank<dp_rank>' (e.g. 'prefill-0/rank1')"
        )
    return match["instance"], int(match["rank"])


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
    raise InvalidArgument(f"{field} {excerpt(value)} is not a role: use prefill, decode or union")


def enum_short_name(enum_type, value: int) -> str:
    """HEALTH_STATUS_NORMAL -> 'NORMAL' (for tables and logs); a number without a name (proto3
    enums are open: a newer or hostile peer may send any) -> 'UNKNOWN_<number>'."""
    if value not in enum_type.values():
        return f"UNKNOWN_{value}"
    full = enum_type.Name(value)
    prefix = enum_type.DESCRIPTOR.name
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", prefix).upper() + "_"
    return full[len(snake) :] if full.startswith(snake) else full
