"""Following the leading controller among several (docs/ha.md): node managers and motorctl are
given every controller's address; a standby refuses a mutating call with UNAVAILABLE and names
the leader in the trailing metadata `motor-leader`; an unreachable controller is skipped."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from motor.service import retry

logger = logging.getLogger(__name__)

LEADER_METADATA = "motor-leader"
# Trailing metadata of a refusal while no controller leads: this one may lead in a moment (or
# learn who does), so the caller asks it again rather than a controller that may be gone.
ELECTION_METADATA = "motor-election"
# With several controllers, a failed call is retried on the next one after a short delay that
# doubles from this one up to a cap (or the heartbeat interval, when shorter): a failover is
# found within tens of milliseconds of its end, not a whole heartbeat interval later.
FOLLOW_RETRY_BASE = 0.05
FOLLOW_RETRY_CAP = 0.5
# A controller that keeps answering "election under way" (cut off from etcd itself, say) is
# left for the next one after this many answers in a row.
ELECTION_PATIENCE = 5
# Seconds after a controller failed to answer during which a refusal naming it is not followed.
SUSPECT_FOR = 5.0
# Failures after which the next controller is tried: unreachable or not leading (UNAVAILABLE),
# or silent (DEADLINE_EXCEEDED: a paused or partitioned leader holds calls until their deadline).
MOVE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Capped exponential backoff with full jitter: uniform in [0, min(cap, base * 2**(failures-1))]."""
    return retry.backoff_delay(failures, base, cap, jitter=True)


def parse_addresses(value: str, setting: str) -> list[str]:
    """ "h1:p1,h2:p2" -> ["h1:p1", "h2:p2"]; ValueError naming `setting` when one is not host:port."""
    addresses = [item.strip() for item in value.split(",") if item.strip()]
    if not addresses:
        raise ValueError(f"{setting}: give at least one host:port")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"{setting}: {address!r} is not host:port with a port in 1-65535")
    return addresses


def _trailer(error: Any, name: str) -> str | None:
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:
        return None
    for key, value in metadata:
        if key == name and value:
            return value.decode() if isinstance(value, bytes) else value
    return None


def leader_named_in(error: Any) -> str | None:
    """The leader's address a standby put in its refusal, if any (grpc.RpcError, sync or asyncio)."""
    return _trailer(error, LEADER_METADATA)


class ControllerAddresses:
    """Which controller to call: the one last known to lead, else the next in the list."""

    def __init__(self, addresses: list[str], clock: Callable[[], float] = time.monotonic):
        self.addresses = list(addresses)
        self.current = self.addresses[0]
        self.waited = 0  # "election under way" answers in a row from the current controller
        self.clock = clock
        self._silent: dict[str, float] = {}  # address -> when it last failed to answer

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def _suspect(self, address: str) -> bool:
        """It failed to answer lately: a refusal naming it as the leader is not followed (the
        others still name a dead or paused leader until its lease is gone; a name advertised
        inside a network may not resolve from where the caller is)."""
        failed = self._silent.get(address)
        return failed is not None and self.clock() - failed < SUSPECT_FOR

    def after_failure(self, error: Any) -> bool:
        """Move on after a failed call: to the leader the refusal names, or (UNAVAILABLE without
        one: unreachable; DEADLINE_EXCEEDED: a paused or cut-off controller; a named leader that
        failed to answer lately) to the next address that has not; stay on a controller that
        answered that an election is under way. True when the address changed."""
        leader = leader_named_in(error)
        code = getattr(error, "code", lambda: None)()
        previous = self.current
        electing = bool(_trailer(error, ELECTION_METADATA))
        if code in MOVE_ON and not leader and not electing:
            self._silent[previous] = self.clock()
        self.waited = self.waited + 1 if electing else 0
        if electing and self.waited < ELECTION_PATIENCE:
            pass  # it answered, and no one leads yet: it is the one to ask again
        elif leader and not self._suspect(leader):
            if leader not in self.addresses:
                self.addresses.append(leader)  # a controller added since we started
            self.current = leader
        elif self.several and (leader or code in MOVE_ON):
            self._next()
        if self.current != previous:
            self.waited = 0
            logger.info(
                "controller %s did not take the call; trying %s%s",
                previous,
                self.current,
                " (named as the leader)" if self.current == leader else "",
            )
        return self.current != previous

    def _next(self) -> None:
        """The next address in turn that has not failed lately; if every other one has, stay on
        one that answers, or go round anyway when the current one did not answer either."""
        start = self.addresses.index(self.current)
        order = [self.addresses[(start + i) % len(self.addresses)] for i in range(1, len(self.addresses) + 1)]
        fresh = [a for a in order if a != self.current and not self._suspect(a)]
        if fresh:
            self.current = fresh[0]
        elif self._suspect(self.current):
            self.current = order[0]
