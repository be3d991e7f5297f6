"""Per-tenant limits at the front door: requests and tokens per minute, requests at once (docs/security.md).

`Admission.admit` lets a tenant's request on with a `Ticket`, or says why not and when to retry
(429 with Retry-After). The ticket is given back when the answer ends (the relay's `ended`), with
the tokens the answer took, counted as answered:

- requests per minute: a token bucket holding a minute's worth, refilled continuously;
- tokens per minute: the same, charged when the answer ends with the tokens it took (its prompt
  and its completion); a tenant is admitted while its bucket is above zero, so one answer may take
  it below, and the tenant then waits until the bucket is refilled above zero. A request's tokens
  are not known before it is answered (the prompt is not tokenized here, and `max_tokens` is a
  ceiling, often absent);
- requests at once: a count, taken at admission and given back when the answer ends (a stream when
  its last byte is written, a client that leaves when it leaves).

State is by tenant name, so a key file reloaded keeps each tenant's counts; a tenant's new limits
apply from its next request.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from front_door.keys import Tenant

MINUTE = 60.0


class Bucket:
    """A token bucket of `per_minute` a minute, holding a minute's worth at most."""

    __slots__ = ("level", "at")

    def __init__(self, per_minute: float, now: float) -> None:
        self.level = per_minute
        self.at = now

    def refill(self, per_minute: float, now: float) -> float:
        self.level = min(per_minute, self.level + (now - self.at) * per_minute / MINUTE)
        self.at = now
        return self.level

    def wait(self, per_minute: float, need: float) -> float:
        """Seconds until the bucket holds `need`."""
        return max(0.0, (need - self.level) * MINUTE / per_minute)


class TenantState:
    __slots__ = ("requests", "tokens", "in_flight")

    def __init__(self, now: float, tenant: Tenant) -> None:
        limits = tenant.limits
        self.requests = Bucket(limits.requests_per_minute or 0.0, now)
        self.tokens = Bucket(limits.tokens_per_minute or 0.0, now)
        self.in_flight = 0


@dataclass
class Refusal:
    reason: str  # "requests", "tokens" or "concurrency"
    retry_after: float  # seconds
    limit: float


class Ticket:
    """One admitted request's place, given back once when its answer ends. A plain class with
    slots, not a dataclass: one is made per request (bench/door_keys.py)."""

    __slots__ = ("tenant", "label", "given_back")

    def __init__(self, tenant: str, label: str = "") -> None:
        self.tenant = tenant
        self.label = label  # the tenant's metrics label (front_door/tenant_metrics.py), looked up once
        self.given_back = False


class Admission:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.states: dict[str, TenantState] = {}

    def state(self, tenant: Tenant) -> TenantState:
        state = self.states.get(tenant.name)
        if state is None:
            state = self.states[tenant.name] = TenantState(self.clock(), tenant)
        return state

    def admit(self, tenant: Tenant, label: str = "") -> Ticket | Refusal:
        limits = tenant.limits
        state = self.states.get(tenant.name) or self.state(tenant)
        if limits.concurrent_requests is not None and state.in_flight >= limits.concurrent_requests:
            # an answer ending frees a place; when is not known: a second is what clients are told
            return Refusal("concurrency", 1.0, limits.concurrent_requests)
        now = self.clock()
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if tpm is not None and state.tokens.refill(tpm, now) <= 0:
            return Refusal("tokens", state.tokens.wait(tpm, 1.0), tpm)
        if rpm is not None:
            if state.requests.refill(rpm, now) < 1:
                return Refusal("requests", state.requests.wait(rpm, 1.0), rpm)
            state.requests.level -= 1
        state.in_flight += 1
        return Ticket(tenant.name, label)

    def give_back(self, ticket: Ticket, tokens: int, tenant: Tenant | None) -> None:
        """The answer of `ticket` ended, having taken `tokens` (prompt and completion)."""
        if ticket.given_back:
            return
        ticket.given_back = True
        state = self.states.get(ticket.tenant)
        if state is None:
            return
        state.in_flight -= 1
        tpm = tenant.limits.tokens_per_minute if tenant is not None else None
        if tpm is not None and tokens > 0:
            state.tokens.refill(tpm, self.clock())
            state.tokens.level -= tokens

    def in_flight(self, tenant: str) -> int:
        state = self.states.get(tenant)
        return state.in_flight if state is not None else 0


def retry_after(seconds: float) -> int:
    """Retry-After in whole seconds (at least 1)."""
    return max(1, math.ceil(seconds))
