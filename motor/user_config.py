"""Which user_config section an engine of a role reads: one rule for the engine server (which
loads it) and the controller (which checks a deployment's engine_config before placing it)."""

from __future__ import annotations

from typing import Collection

SECTION_BY_ROLE = {
    "prefill": "motor_engine_prefill_config",
    "decode": "motor_engine_decode_config",
    "union": "motor_engine_union_config",
}


def section_name_for(role: str, present: Collection[str]) -> str:
    """The role's own section; the union role falls back to the prefill section when it has none.

    `present` holds the names of the sections the user_config has. The returned name may be
    absent from it: then the role's section is missing."""
    name = SECTION_BY_ROLE[role]
    if name not in present and role == "union" and SECTION_BY_ROLE["prefill"] in present:
        return SECTION_BY_ROLE["prefill"]
    return name
