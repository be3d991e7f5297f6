"""StartEngine refusals a controller waits out or works around rather than counting them as
engine failures, worded in one place: the node manager raises them with these functions and the
controller recognises them with `kind` (the words are the contract between the two services).

- HELD: the accelerators or ports asked for are held by another engine on that node, typically
  an old copy still draining and stopping (a replaced deployment): try again after a backoff.
- WRONG_NODE: the address the node registered with answers as another node (a wrong
  --advertise-address, a stolen certificate): the node is no use until it registers again.
- NEVER: the spec itself is refused (INVALID_ARGUMENT: a local path outside the node's
  --model-root, code named in the engine config...): a restart sends the same spec and is refused
  the same way, so the instance fails at once instead of spending its restart budget.
"""

from __future__ import annotations

import enum

from motor.errors import FailedPrecondition

_HELD_ACCELERATORS = "are in use by"  # the words node managers have always used
_HELD_PORT = "is in use by engine"
_WRONG_NODE = "is registered with the wrong address"


class Refusal(enum.Enum):
    HELD = "held by another engine"
    WRONG_NODE = "the address answers as another node"
    NEVER = "the node refuses the spec itself"


def accelerators_held(taken: list[int], holders: list[str]) -> FailedPrecondition:
    return FailedPrecondition(f"spec.accelerator_ids: accelerator(s) {taken} {_HELD_ACCELERATORS} {holders}")


def port_held(field: str, port: int, holder: str) -> FailedPrecondition:
    return FailedPrecondition(f"spec.{field} {port} {_HELD_PORT} {holder}")


def wrong_node(asked: str, this_node: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"node_id {asked}: this address is node {this_node}'s node manager; node "
        f"{asked} {_WRONG_NODE} (check its --advertise-address)"
    )


def kind(code: str, message: str) -> Refusal | None:
    """Which of these refusals a node manager's answer (status code name, details) is, if any."""
    if code == "INVALID_ARGUMENT":
        return Refusal.NEVER
    if code != "FAILED_PRECONDITION":
        return None
    if message.startswith("node_id ") and _WRONG_NODE in message:
        return Refusal.WRONG_NODE
    if (message.startswith("spec.accelerator_ids: accelerator(s) ") and f" {_HELD_ACCELERATORS} " in message) or (
        message.startswith("spec.") and f" {_HELD_PORT} " in message
    ):
        return Refusal.HELD
    return None
