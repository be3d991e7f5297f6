"""The instance lifecycle: one state machine with one transition function, and the restart
policy (immediate first restart, doubling backoff, reset after healthy time, crash-loop budget).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from controller.rules.restart_policy import Policy
from motor.contract.names import enum_short_name
from motor.state_machine import IllegalTransition as IllegalTransition  # the instance machine's error, re-exported
from motor.state_machine import Transitions
from motor.v1 import controller_pb2

logger = logging.getLogger(__name__)

S = controller_pb2
PENDING, STARTING, READY = S.INSTANCE_STATE_PENDING, S.INSTANCE_STATE_STARTING, S.INSTANCE_STATE_READY
DEGRADED, RESTARTING, FAILED = S.INSTANCE_STATE_DEGRADED, S.INSTANCE_STATE_RESTARTING, S.INSTANCE_STATE_FAILED

# Which state may follow which. PENDING: waiting for room; STARTING: launched, not all NORMAL;
# READY: every rank NORMAL; DEGRADED: some rank not NORMAL, nothing failed yet; RESTARTING:
# a failure is being handled (maybe backing off); FAILED: crash-loop budget spent.
TRANSITIONS = Transitions.between(
    {
        PENDING: {PENDING, STARTING, RESTARTING, FAILED},
        STARTING: {STARTING, READY, DEGRADED, RESTARTING, PENDING, FAILED},
        READY: {DEGRADED, RESTARTING, PENDING, STARTING, FAILED},
        DEGRADED: {DEGRADED, READY, RESTARTING, PENDING, STARTING, FAILED},
        RESTARTING: {RESTARTING, STARTING, PENDING, FAILED},
        FAILED: {RESTARTING, PENDING},
    },
    lambda state: state_name(state),
)


def state_name(state: int) -> str:
    return enum_short_name(S.InstanceState, state)


@dataclass(slots=True)
class InstanceRecord:
    """What the controller keeps about one instance (persisted as a dict). Slots, and tuples of
    numbers, which the garbage collector does not track: 10,000s of them
    (docs/controller-decisions.md, memory per engine)."""

    instance_id: str
    group: str
    role: int
    data_parallel_size: int
    accelerators_per_engine: int
    single_container: bool
    paired_instance_id: str
    spec_hash: str
    state: int = PENDING
    reason: str = "waiting for placement"
    restarts: int = 0
    # Failures counted by the backoff since the last reset (0: next restart is immediate).
    consecutive_failures: int = 0
    # Wall-clock times of failures inside the crash-loop window.
    failure_times: tuple[float, ...] = ()
    # Wall-clock time the pending restart is due (RESTARTING only).
    next_restart_at: float | None = None
    # Ranks the pending restart covers.
    restart_ranks: tuple[int, ...] = ()
    # Wall-clock time the instance last became READY (None while not READY).
    healthy_since: float | None = None
    state_changed_at: float = 0.0
    # The deployment revision whose spec it runs (moved on by a change that leaves its spec alone).
    revision: int = 0
    # A warm spare of its group: started, never routed, promoted when a serving one fails
    # (controller/capacity/spares.py).
    spare: bool = False
    # The model its engines serve: the deployment's model when its spec was made (a rollout that
    # renames the model leaves the old instances serving the old name until they go). Empty in a
    # record of an older store: the deployment's model.
    model: str = ""
    # The deployment it belongs to: found by its group while the group is in the deployment; an
    # instance of a group renamed under a rolling update keeps serving for it until the rollout
    # withdraws it. Empty in a record of an older store.
    deployment: str = ""
    # The engine_config its engines start with: its deployment's when its spec was made, so a
    # restart runs the revision it belongs to (an old instance that fails while a bad version is
    # paused comes back as itself, not as the bad version). Empty in a record of an older store:
    # the deployment's current one.
    config: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        record = cls(**known)
        record.failure_times, record.restart_ranks = tuple(record.failure_times), tuple(record.restart_ranks)
        record.config = sys.intern(record.config)  # one copy per spec, not per instance read back
        return record


def transition(record: InstanceRecord, new_state: int, reason: str, now: float) -> bool:
    """The one place an instance changes state. Returns True when the state or reason changed."""
    if not reason:
        raise ValueError("every transition needs a reason")
    if new_state != record.state:  # staying is always allowed (a new reason)
        TRANSITIONS.check(record.instance_id, record.state, new_state, reason)
    if new_state == record.state and reason == record.reason:
        return False
    changed_state = new_state != record.state
    if changed_state:
        record.state_changed_at = now
        if new_state == READY and record.healthy_since is None:
            record.healthy_since = now
        elif new_state not in (READY, DEGRADED):
            # A DEGRADED spell keeps the healthy clock: the failure that may follow is judged
            # against the time the instance was serving.
            record.healthy_since = None
    record.state, record.reason = new_state, reason
    return changed_state


@dataclass(frozen=True)
class FailureDecision:
    give_up: bool
    delay: float
    failures_in_window: int


def on_failure(record: InstanceRecord, policy: Policy, now: float) -> FailureDecision:
    """Count a failure; say whether to restart (after `delay` seconds) or give up (FAILED)."""
    if record.healthy_since is not None and now - record.healthy_since >= policy.reset_after:
        record.consecutive_failures = 0  # healthy long enough: the backoff starts over
    record.failure_times = (*(t for t in record.failure_times if now - t < policy.failure_window), now)
    if len(record.failure_times) >= policy.max_failures:
        return FailureDecision(True, 0.0, len(record.failure_times))
    n = record.consecutive_failures
    delay = 0.0 if n == 0 else min(policy.initial_backoff * 2 ** (n - 1), policy.max_backoff)
    record.consecutive_failures = n + 1
    return FailureDecision(False, delay, len(record.failure_times))
