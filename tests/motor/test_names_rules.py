"""motor.contract.names, rule by rule: the default field names, excerpt's bound, engine ids of any type,
roles by name or number (plain functions; written to kill the mutants `make mutation` found)."""

from __future__ import annotations

import pytest

from motor.contract.names import (
    ID_RULE,
    check_instance_id,
    check_node_id,
    check_printable,
    enum_short_name,
    excerpt,
    parse_engine_id,
    parse_role,
    role_name,
)  # fmt: skip
from motor.errors import InvalidArgument
from motor.v1 import types_pb2 as T


def test_id_errors_name_the_default_field():
    with pytest.raises(InvalidArgument) as error:
        check_instance_id("Bad")
    assert str(error.value) == f"instance_id 'Bad' {ID_RULE}"
    with pytest.raises(InvalidArgument) as error:
        check_node_id("Bad")
    assert str(error.value) == f"node_id 'Bad' {ID_RULE}"


def test_an_excerpt_cuts_only_what_is_longer_than_its_limit():
    assert excerpt("abcd", limit=4) == "'abcd'"
    assert excerpt("abcde", limit=4) == "'abcd'... (5 characters)"


@pytest.mark.parametrize("value, shown", [(17, "17"), (None, "None"), ("a/b", "'a/b'")])
def test_a_bad_engine_id_of_any_type_is_invalid_argument_quoting_it(value, shown):
    with pytest.raises(InvalidArgument) as error:
        parse_engine_id(value)
    assert str(error.value) == (
        f"engine_id {shown} is not of the form '<instance_id>/rank<dp_rank>' (e.g. 'prefill-0/rank1')"
    )


@pytest.mark.parametrize(
    "value, role",
    [("prefill", T.ROLE_PREFILL), (" Decode ", T.ROLE_DECODE), ("ROLE_UNION", T.ROLE_UNION), ("role_prefill", T.ROLE_PREFILL),
     (T.ROLE_DECODE, T.ROLE_DECODE)],
)  # fmt: skip
def test_roles_by_name_or_number(value, role):
    assert parse_role(value) == role


@pytest.mark.parametrize("value, shown", [("leader", "'leader'"), (0, "0"), (9, "9"), ("role_", "'role_'")])
def test_anything_else_is_not_a_role(value, shown):
    with pytest.raises(InvalidArgument) as error:
        parse_role(value)
    assert str(error.value) == f"role {shown} is not a role: use prefill, decode or union"
    with pytest.raises(InvalidArgument, match=r"^groups\[0\]\.role "):
        parse_role(value, "groups[0].role")


def test_role_names():
    assert [role_name(r) for r in (T.ROLE_PREFILL, T.ROLE_DECODE, T.ROLE_UNION, T.ROLE_UNSPECIFIED)] == [
        "prefill",
        "decode",
        "union",
        "unspecified",
    ]


def test_printable_text_passes_with_its_spaces_digits_and_punctuation():
    assert check_printable("node-1.example:50052 ~é", "node.address") == "node-1.example:50052 ~é"


@pytest.mark.parametrize("bad", ["\x00", "\n", "\x1f", "\x7f"])
def test_a_control_character_is_named(bad):
    with pytest.raises(InvalidArgument) as error:
        check_printable(f"10.0.0.1{bad}", "node.host")
    assert str(error.value) == f"node.host {f'10.0.0.1{bad}'!r} holds the control character {bad!r}; remove it"


def test_an_enum_number_without_a_name_is_shown_by_its_number():
    # Open proto3 enums: a newer peer may send a number this version has no name for.
    assert enum_short_name(T.HealthStatus, T.HEALTH_STATUS_NORMAL) == "NORMAL"
    assert enum_short_name(T.HealthStatus, 77) == "UNKNOWN_77"
