"""Whether the engine serves: the stall watchdog, on every engine whatever probing says.

The engine's own traffic is the probe. From what the engine reports (its client requests in
flight, its progress: tokens and scheduler steps, and how its client requests end), one explicit
state machine:

    SERVING --requests in flight, no progress for stall_timeout--> STALLED
    SERVING --FAILED_IN_A_ROW client requests failed (5xx but 503), none succeeded--> FAILING
    STALLED --progress again, or a recovery probe answers--> SERVING
    FAILING --a client request succeeds, or a recovery probe answers--> SERVING

While not serving, one recovery probe is outstanding at a time (`RecoveryProbes`), the first at
once: a probe queued in a hung engine is answered when the hang ends, so the engine is back about
when it is (the requests it held were failed back: no progress of theirs can say so).

A not-serving engine is left out of the routers at once (EngineStatus.not_serving_reason, carried
by the node manager to the controller's endpoints): leaving rotation is cheap and early. A state
that lasts `stall_kill_after` (a stall counted from its last progress, failing from its
detection) turns the health ABNORMAL, which gets the engine killed and replaced like failed
probes: killing is late and sure (Kubernetes' readiness and liveness). The watchdog never acts
on an engine without requests in flight and no failures: an idle hang is the probes' to find.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine_server.probing import ProbeClient, ProbeFailed
from engine_server.status import Event, Health, HealthStateMachine
from motor.clock import SYSTEM_CLOCK, Clock
from motor.contract.user_config import HealthCheckConfig
from motor.state_machine import Transitions

logger = logging.getLogger(__name__)

# Client requests failing in a row with a server error (HTTP 5xx other than 503, which a
# draining, loading or sleeping engine answers on purpose) and none succeeding in between: an
# engine answering 500 to every inference while its /health answers 200. One or two failures
# can be a request's own fault; three in a row with no success is the engine.
FAILED_IN_A_ROW = 3
# How often the watchdog reads the engine: a stall is seen within this of stall_timeout.
CHECK_PERIOD = 0.2
# Recovery probes start at least this far apart: a probe failing at once (inference answering
# 500, a refused connection) is not repeated in a busy loop. One that waits (queued in a hung
# engine) is followed at once when probe_timeout ends it, so one is always waiting in the engine.
RECOVERY_PROBE_SPACING = 0.5


class Serving(enum.Enum):
    SERVING = "serving"
    STALLED = "stalled"  # requests in flight and no progress for stall_timeout
    FAILING = "failing"  # client requests fail with server errors and none succeeds


# from -> allowed next states (the reason comes with each change).
TRANSITIONS: Transitions[Serving, Serving] = Transitions.between(
    {
        Serving.SERVING: (Serving.STALLED, Serving.FAILING),
        Serving.STALLED: (Serving.SERVING,),
        Serving.FAILING: (Serving.SERVING,),
    },
    lambda serving: serving.name,
)


class EngineActivity(Protocol):
    """What the watchdog reads of the engine (engines.base.EngineBackend provides it)."""

    def in_flight_requests(self) -> int: ...

    def progress(self) -> int | None: ...

    def request_outcomes(self) -> tuple[int, int] | None:
        """(client requests succeeded, client requests failed with a server error), probes
        excluded, both counting up; None when the engine cannot tell."""


@dataclass(frozen=True)
class ServingChange:
    before: Serving
    after: Serving
    reason: str


@dataclass(eq=False)
class ServingWatchdog:
    """Reads the engine every CHECK_PERIOD (`check`) and keeps `state` and `reason`; `change` is
    the only mutator. `on_change` hears every change (the engine server publishes it)."""

    settings: HealthCheckConfig
    activity: EngineActivity
    machine: HealthStateMachine
    on_change: Callable[[ServingChange], None] = lambda change: None
    metrics: Any = None
    clock: Clock = SYSTEM_CLOCK

    def __post_init__(self) -> None:
        self.state = Serving.SERVING
        self.reason = ""
        self._since = 0.0  # monotonic: when the current not-serving state began (a stall: its last progress)
        self._progress: int | None = None
        self._quiet_since = self.clock.monotonic()  # last progress, or last moment without requests in flight
        self._outcomes: tuple[int, int] | None = None
        self._failed_in_a_row = 0
        self._made_abnormal = False  # the watchdog turned the health ABNORMAL (and may undo it)
        if self.metrics is not None:
            self._observe()

    @property
    def serving(self) -> bool:
        return self.state is Serving.SERVING

    @property
    def not_serving_reason(self) -> str:
        """'' while serving, else why not (EngineStatus.not_serving_reason)."""
        return "" if self.serving else self.reason

    def check(self) -> None:
        """One reading of the engine, and whatever change it calls for."""
        now = self.clock.monotonic()
        in_flight = self.activity.in_flight_requests()
        progress = self.activity.progress()
        first = self._progress is None  # the first reading (or the first since a source appeared)
        moved = progress is not None and not first and progress != self._progress
        self._progress = progress
        if moved or first or progress is None or (self.serving and in_flight == 0):
            self._quiet_since = now
        succeeded = self._read_outcomes()

        if self.state is Serving.SERVING:
            quiet = now - self._quiet_since
            if in_flight and quiet >= self.settings.stall_timeout:
                self.change(
                    Serving.STALLED,
                    f"no progress for {quiet:.1f} s with {in_flight} request{'s' if in_flight != 1 else ''} in flight",
                    since=self._quiet_since,
                )
            elif self._failed_in_a_row >= FAILED_IN_A_ROW:
                self.change(
                    Serving.FAILING,
                    f"{self._failed_in_a_row} client requests in a row failed with a server error and none succeeded",
                    since=now,
                )
            return
        if self.state is Serving.STALLED and moved:
            self.change(Serving.SERVING, "progress resumed")
        elif self.state is Serving.FAILING and succeeded:
            self.change(Serving.SERVING, "client requests succeed again")
        elif now - self._since >= self.settings.stall_kill_after:
            self._turn_abnormal(now)

    def _read_outcomes(self) -> bool:
        """Update the failures in a row; True when a client request succeeded since the last reading."""
        outcomes = self.activity.request_outcomes()
        before, self._outcomes = self._outcomes, outcomes
        if outcomes is None or before is None:
            return False
        succeeded, failed = outcomes[0] - before[0], outcomes[1] - before[1]
        if succeeded > 0:  # failures in the same reading may have come before it: not "in a row"
            self._failed_in_a_row = 0
            return True
        self._failed_in_a_row += max(0, failed)
        return False

    def probe_succeeded(self) -> None:
        """A recovery probe got its answer: the engine serves again."""
        if not self.serving:
            self.change(Serving.SERVING, "a probe was answered")

    def change(self, after: Serving, reason: str, since: float | None = None) -> None:
        before = self.state
        TRANSITIONS.check("serving", before, after, reason)
        self.state, self.reason = after, reason
        self._since = self.clock.monotonic() if since is None else since
        if after is Serving.SERVING:
            self._quiet_since, self._failed_in_a_row = self.clock.monotonic(), 0
            if self._made_abnormal:
                self._made_abnormal = False
                self.machine.fire(Event.SERVING_AGAIN, f"serving again: {reason}")
            logger.info("engine serving again: %s", reason)
        else:
            logger.warning("engine not serving (%s): %s", after.value, reason)
        if self.metrics is not None:
            self.metrics.serving_changes.labels(after.value).inc()
            self._observe()
        self.on_change(ServingChange(before, after, reason))

    def _turn_abnormal(self, now: float) -> None:
        if self._made_abnormal or self.machine.state is not Health.NORMAL:
            return
        lasted = now - self._since
        what = "no progress" if self.state is Serving.STALLED else "client requests failing"
        self._made_abnormal = self.machine.fire(
            Event.STALLED,
            f"{what} for {lasted:.1f} s (stall_kill_after {self.settings.stall_kill_after:g} s): {self.reason}",
        )

    def _observe(self) -> None:
        for state in (Serving.STALLED, Serving.FAILING):
            self.metrics.not_serving.labels(state.value).set(1 if self.state is state else 0)


@dataclass(eq=False)
class RecoveryProbes:
    """While the watchdog says not serving: 1-token probes, one at a time, each bounded by
    probe_timeout, started RECOVERY_PROBE_SPACING apart at most, the first at once; the first
    answered brings the engine back (`ServingWatchdog.probe_succeeded`). Not probe_interval: that
    paces the probing of a serving engine, and waiting it out kept a 3 s hang out of the routers
    for 5 s more, or got it killed (a probe_interval over stall_kill_after - stall_timeout).
    `paused` (draining, sleeping) sends none; `stopped` (dead, closing) ends the run."""

    settings: HealthCheckConfig
    client: ProbeClient
    watchdog: ServingWatchdog
    clock: Clock = SYSTEM_CLOCK
    paused: Callable[[], bool] = lambda: False
    stopped: Callable[[], bool] = lambda: False

    async def run(self) -> None:
        said = None  # the last failure logged: a failure repeating twice a second is said once
        while not (self.watchdog.serving or self.stopped()):
            started = self.clock.monotonic()
            if not self.paused():
                failure = await self._probe()
                if not failure:
                    self.watchdog.probe_succeeded()
                    return
                if failure != said:
                    logger.info("recovery probe failed (%s): still not serving", failure)
                    said = failure
            await self.clock.sleep(max(0.0, started + RECOVERY_PROBE_SPACING - self.clock.monotonic()))

    async def _probe(self) -> str:
        """'' when the probe was answered, else why not."""
        try:
            async with asyncio.timeout(self.settings.probe_timeout):
                await self.client.probe()
        except TimeoutError:
            return f"timed out after {self.settings.probe_timeout:g}s"
        except ProbeFailed as exc:
            return str(exc) or "failed"
        return ""
