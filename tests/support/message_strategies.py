"""Hypothesis strategies for any protobuf message, built from its descriptor: strings with NUL,
newlines, path and shell characters and huge lengths, integers at their limits, enum numbers
the API does not define, nested messages, maps, Struct values, Duration/Timestamp extremes."""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "nl\n",
    "node-a\n",
    "a\x00b",
    "../../etc/passwd",
    "/bin/sh",
    "$(id)",
    "; rm -rf /",
    "prefill-0/rank0",
    "prefill-0/rank99999999999999999999",
    "node-a",
    "NODE-A",
    "é",
    "\U0001f680",
    "\ud7ff",
    "x" * 64,
    "y" * 10_000,
    "z" * 1_000_000,
]
LIMITS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 4


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({low, high, 0, 1, max(low, -1), min(high, 2**31 - 1), min(high, 2**53 + 1)})
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 100))


def _scalar(field: Any) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == F.TYPE_STRING:
        return st.one_of(st.sampled_from(ODD_STRINGS), st.text(max_size=40))
    if kind == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == F.TYPE_BOOL:
        return st.booleans()
    if kind in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if kind == F.TYPE_FLOAT else 64)
    if kind == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _integers(-(2**31), 2**31 - 1))
    return _integers(*LIMITS[kind])


def _set(message: Any, field: Any, value: Any) -> None:
    target = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        for key, item in value.items():
            if value_field.message_type is not None:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        if field.message_type is not None:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _value(field: Any, depth: int) -> st.SearchStrategy[Any]:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key = _scalar(field.message_type.fields_by_name["key"])
        value = _value(field.message_type.fields_by_name["value"], depth)
        return st.dictionaries(key, value, max_size=3)
    single = messages(field.message_type, depth + 1) if field.message_type is not None else _scalar(field)
    if field.is_repeated:
        return st.lists(single, max_size=3)
    return single


def messages(descriptor: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Random messages of `descriptor`: each field left out or set to a random or boundary value."""
    cls = message_factory.GetMessageClass(descriptor)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    fields = {f.name: st.one_of(st.none(), _value(f, depth)) for f in descriptor.fields}

    def build(values: dict[str, Any]) -> Any:
        message = cls()
        for name, value in values.items():
            if value is not None:
                _set(message, descriptor.fields_by_name[name], value)
        return message

    return st.fixed_dictionaries(fields).map(build)


def field_names(descriptor: Any, seen: set[str] | None = None) -> set[str]:
    """Every field name in a message type, nested types included."""
    seen = set() if seen is None else seen
    names: set[str] = set()
    if descriptor.full_name in seen:
        return names
    seen.add(descriptor.full_name)
    for field in descriptor.fields:
        names.add(field.name)
        if field.message_type is not None:
            names |= field_names(field.message_type, seen)
    return names


# A field path at the start of a refusal: `node_id`, `engines[3].engine_id`, `spec.host`...
FIELD_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\[[0-9]+\])?(?:\.[a-z_][a-z0-9_]*(?:\[[0-9]+\])?)*(?=[ :/]|$)")
# A refusal of a whole deployment lists its problems after this lead-in, paths from the deployment.
DEPLOYMENT_LEAD = "invalid deployment: "
# Field types whose inside is free-form (keys, not fields): a path may go on into them.
FREE_FORM = {"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"}


def leading_field(descriptor: Any, details: str) -> str | None:
    """The field path a refusal of a `descriptor` request starts with, when it is one of the
    request's fields (nested fields by their path): `engines[1].spec.host 'x\\x00' holds ...`.
    None when the message starts with anything else (a generic word is not a field path)."""
    if details.startswith(DEPLOYMENT_LEAD) and "deployment" in descriptor.fields_by_name:
        descriptor, details = descriptor.fields_by_name["deployment"].message_type, details[len(DEPLOYMENT_LEAD) :]
    match = FIELD_PATH.match(details)
    if match is None:
        return None
    current = descriptor
    for part in match[0].split("."):
        field = current.fields_by_name.get(part.split("[")[0]) if current is not None else None
        if field is None:
            return None
        if (
            field.message_type is None
            or field.message_type.full_name in FREE_FORM
            or field.message_type.GetOptions().map_entry
        ):
            current = None  # a scalar, or keys of a map or Struct follow: nothing more to check
            break
        current = field.message_type
    return match[0]
