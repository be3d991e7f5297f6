"""The engine's health status: one state machine, one transition function, a reason on every change.

    INIT --starting--> INIT (a start-up step with its reason, e.g. checking the configuration)
    INIT --health_up--> NORMAL --failure_limit--> ABNORMAL --probe_succeeded--> NORMAL
                                                  ABNORMAL --health_recovered--> NORMAL
                        NORMAL --stalled--> ABNORMAL --serving_again--> NORMAL (serving.py)
    any  --engine_died--> ABNORMAL (final: a dead engine never comes back in this process)

Flags that are not states (sleeping, draining, probing) live beside it in the EngineStatus message.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from motor.clock import SYSTEM_CLOCK, Clock
from motor.state_machine import Transitions

logger = logging.getLogger(__name__)


class Health(enum.IntEnum):
    # Values match motor.v1.HealthStatus.
    INIT = 1
    NORMAL = 2
    ABNORMAL = 3


class Event(enum.Enum):
    STARTING = "starting"  # a step of the start-up (checking the configuration, loading)
    HEALTH_UP = "health_up"  # GET /health answered 200
    FAILURE_LIMIT = "failure_limit"  # max_failure_count consecutive failed checks (/health or probes)
    PROBE_SUCCEEDED = "probe_succeeded"
    HEALTH_RECOVERED = "health_recovered"  # /health answers 200 again while nothing probes
    ENGINE_DIED = "engine_died"
    STALLED = "stalled"  # not serving (no progress, or failing requests) for stall_kill_after
    SERVING_AGAIN = "serving_again"  # the watchdog's stall or failing state ended


# from -> {event: to}. Anything else is ignored (e.g. a success while NORMAL changes nothing).
TRANSITIONS: Transitions[Health, Event] = Transitions(
    {
        Health.INIT: {Event.STARTING: Health.INIT, Event.HEALTH_UP: Health.NORMAL, Event.ENGINE_DIED: Health.ABNORMAL},
        Health.NORMAL: {
            Event.FAILURE_LIMIT: Health.ABNORMAL,
            Event.STALLED: Health.ABNORMAL,
            Event.ENGINE_DIED: Health.ABNORMAL,
        },
        Health.ABNORMAL: {
            Event.PROBE_SUCCEEDED: Health.NORMAL,
            Event.HEALTH_RECOVERED: Health.NORMAL,
            Event.SERVING_AGAIN: Health.NORMAL,
            Event.ENGINE_DIED: Health.ABNORMAL,
        },
    },
    lambda health: health.name,
)


@dataclass(frozen=True)
class Transition:
    before: Health
    after: Health
    event: Event
    reason: str
    at: float


class HealthStateMachine:
    """Holds the status and its reason; `fire` is the only way to change them."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK):
        self.state = Health.INIT
        self.reason = "starting: waiting for the inference plane's GET /health to answer"
        self.dead = False
        self.changed_at = clock.time()
        self._clock = clock
        self._listeners: list[Callable[[Transition], None]] = []

    def on_transition(self, listener: Callable[[Transition], None]) -> None:
        self._listeners.append(listener)

    def fire(self, event: Event, reason: str) -> bool:
        """Apply `event`; return True when the status or its reason changed."""
        if self.dead:
            return False  # a dead engine stays ABNORMAL with the death's reason
        after = TRANSITIONS.next(self.state, event)
        if after is None:
            return False
        # Death is final even when its reason repeats the current one (nothing else changes then).
        self.dead = event is Event.ENGINE_DIED
        if after == self.state and reason == self.reason:
            return False
        transition = Transition(self.state, after, event, reason, self._clock.time())
        self.state, self.reason, self.changed_at = after, reason, transition.at
        log = logger.warning if after is Health.ABNORMAL else logger.info
        log("status %s -> %s (%s): %s", transition.before.name, after.name, event.value, reason)
        for listener in self._listeners:
            listener(transition)
        return True
