"""A test's background sampler or sender: `step()` called every `interval` s on a thread of its
own from the `with` block's start until its end (the step under way finishes before the block is
left)."""

from __future__ import annotations

import threading
from typing import Self


class EveryInterval:
    """Subclasses define `step()`; `with Sub(...) as x:` runs it every `interval` s meanwhile."""

    def __init__(self, interval: float, name: str | None = None) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def step(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.interval)


class OpenLoop(EveryInterval):
    """Open-loop requests: every `period` s `request()` starts on a thread of its own, whatever the
    earlier ones are doing, so a stalled request does not slow the others; the block's end waits
    up to `join_timeout` s for each request thread."""

    def __init__(self, period: float, join_timeout: float) -> None:
        super().__init__(period)
        self.period, self.join_timeout = period, join_timeout
        self._requests: list[threading.Thread] = []

    def request(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        thread = threading.Thread(target=self.request, daemon=True)
        thread.start()
        self._requests.append(thread)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for thread in self._requests:
            thread.join(timeout=self.join_timeout)
