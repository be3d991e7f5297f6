"""Retries (docs/shared-rules.md, "Retries"): every retry loop waits a capped exponential
backoff, and a failure that repeats is reported once, with a count, not once per try.

- `backoff_delay(failures, base, cap)`: the wait after the n-th failure in a row, base * 2^(n-1)
  at most `cap` (full jitter on request: uniform in [0, that]). Loops written with tenacity use
  its own `wait_exponential(multiplier=base, max=cap)`, the same curve.
- `with_retries(call, attempts, retryable, base, cap)`: a call tried up to `attempts` times with
  that backoff between tries, for calls made by the thousand (the controller's StartEngine and
  StopEngine): it leaves nothing in reference cycles, which tenacity's AsyncRetrying does (about
  30 objects, 4.5 KB, per call). A call that outlives one paced garbage collection has those
  frozen with it (controller/gc_tuning.py), and only the rare complete walk frees them then: at
  10,000 nodes, tens of thousands of calls' worth.
- `RepeatedFailure`: one operation that may keep failing (a stop the node refuses, a start on an
  unreachable node, a watch that breaks). `failed()` counts a try and says when it is worth a
  line or an event: the first try of a spell, then the 10th, 100th, 1000th... (a loop failing
  for a day writes a handful of lines); `delay()` is the backoff for the count so far;
  `recovered()` ends the spell and returns how many tries failed (for the one closing line).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_delay(failures: int, base: float, cap: float, jitter: bool = False) -> float:
    """Wait after the `failures`-th failure in a row (1: the first): base * 2**(failures-1), at
    most `cap`; with `jitter`, uniform in [0, that] (full jitter: many clients do not retry in step)."""
    if failures < 1:
        return 0.0
    delay = min(cap, base * 2.0 ** min(failures - 1, 62))
    return random.uniform(0, delay) if jitter else delay


async def with_retries(
    call: Callable[[], Awaitable[T]],
    attempts: int,
    retryable: Callable[[BaseException], bool],
    base: float,
    cap: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """`await call()`, tried again after an error `retryable` accepts, at most `attempts` tries in
    all, waiting backoff_delay(n, base, cap) after the n-th failure; the last error is raised."""
    failures = 0
    while True:
        try:
            return await call()
        except Exception as exc:
            failures += 1
            if failures >= attempts or not retryable(exc):
                raise
        await sleep(backoff_delay(failures, base, cap))


def worth_reporting(count: int) -> bool:
    """The 1st, 10th, 100th... failure of a spell: what is logged or announced, with its count."""
    while count >= 10 and count % 10 == 0:
        count //= 10
    return count == 1


class RepeatedFailure:
    """The failures in a row of one operation: their count, the backoff, when to report."""

    def __init__(self, base: float, cap: float, jitter: bool = False):
        self.base, self.cap, self.jitter = base, cap, jitter
        self.count = 0
        self.last_error = ""

    def failed(self, error: object = "") -> bool:
        """Count one failed try; True when this one is worth reporting (see worth_reporting)."""
        self.count += 1
        self.last_error = str(error)
        return worth_reporting(self.count)

    def delay(self) -> float:
        return backoff_delay(self.count, self.base, self.cap, self.jitter)

    def recovered(self) -> int:
        """The operation succeeded: the spell ends; returns how many tries had failed."""
        count, self.count, self.last_error = self.count, 0, ""
        return count
