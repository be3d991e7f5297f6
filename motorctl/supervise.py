"""Keeping the front door of `motorctl up` running: its router, motor-router-sync and the front door's
process (front_door/cli.py) are started again when they exit, as compose's restart policy does for
the same three services.

One state machine per process, moved only by `Supervisor.tick` (a thread calls it every 0.1 s):

    RUNNING --exit--> BACKOFF --delay over--> RUNNING (started again)
    BACKOFF --more than `max_restarts` exits within `window`--> FATAL (left stopped, said on the screen)

The delay doubles from `backoff_base` to `backoff_cap` with the exits counted in `window`. A
restart is said on the status screen (`describe`) and in the log; the controller sees it as well
(a new sync instance reporting, or its router not answering the sync: events of type
FRONT_DOOR, `motor_front_door_*` metrics; docs/router.md).
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

RUNNING, BACKOFF, FATAL = "running", "backoff", "fatal"


class Process(Protocol):
    def poll(self) -> int | None: ...


def exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Supervised:
    name: str
    start: Callable[[], Process]  # starts the process again (same command, same ports)
    process: Process
    state: str = RUNNING
    restarts: int = 0
    last_exit: str = ""
    retry_at: float = 0.0
    exits: collections.deque[float] = field(default_factory=collections.deque)


class Supervisor:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        backoff_base: float = 0.5,
        backoff_cap: float = 10.0,
        max_restarts: int = 5,
        window: float = 60.0,
    ):
        self.clock, self.backoff_base, self.backoff_cap = clock, backoff_base, backoff_cap
        self.max_restarts, self.window = max_restarts, window
        self.supervised: dict[str, Supervised] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, name: str, process: Process, start: Callable[[], Process]) -> None:
        with self._lock:
            self.supervised[name] = Supervised(name, start, process)

    # The state machine -------------------------------------------------------------------------

    def tick(self) -> None:
        with self._lock:
            for one in self.supervised.values():
                self._step(one, self.clock())

    def _step(self, one: Supervised, now: float) -> None:
        if one.state == RUNNING:
            code = one.process.poll()
            if code is None:
                return
            one.last_exit = exit_words(code)
            one.exits.append(now)
            while one.exits and now - one.exits[0] > self.window:
                one.exits.popleft()
            if len(one.exits) > self.max_restarts:
                one.state = FATAL
                logger.error(
                    "%s %s; %d exits within %gs: not started again",
                    one.name,
                    one.last_exit,
                    len(one.exits),
                    self.window,
                )
                return
            delay = min(self.backoff_cap, self.backoff_base * 2 ** (len(one.exits) - 1))
            one.state, one.retry_at = BACKOFF, now + delay
            logger.warning("%s %s; starting it again in %gs", one.name, one.last_exit, delay)
        elif one.state == BACKOFF and now >= one.retry_at:
            try:
                one.process = one.start()
            except OSError as exc:  # the program gone: counted as one more exit
                one.last_exit, one.retry_at = f"could not start ({exc})", now + self.backoff_cap
                return
            one.restarts += 1
            one.state = RUNNING
            logger.warning("%s started again (restart %d)", one.name, one.restarts)

    # What the screen says ----------------------------------------------------------------------

    def describe(self, name: str) -> str:
        """'' while it runs and never restarted; else what happened to it, in a few words."""
        with self._lock:
            one = self.supervised.get(name)
            if one is None:
                return ""
            if one.state == BACKOFF:
                wait = max(0.0, one.retry_at - self.clock())
                return f"{name} {one.last_exit}, starting again in {wait:.1f}s"
            if one.state == FATAL:
                return f"{name} {one.last_exit} {len(one.exits)} times within {self.window:g}s: not started again"
            return f"{name} restarted {one.restarts} time(s), last {one.last_exit}" if one.restarts else ""

    def running(self, name: str) -> bool:
        with self._lock:
            one = self.supervised.get(name)
            return one is not None and one.state == RUNNING

    # The thread --------------------------------------------------------------------------------

    def start(self, period: float = 0.1) -> None:
        def loop() -> None:
            while not self._stop.wait(period):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 (a failed tick must not end the supervision)
                    logger.exception("supervising the front door")

        self._thread = threading.Thread(target=loop, name="front-door supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No restart from now on (the cluster is stopping)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
