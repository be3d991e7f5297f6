"""An engine's requests in flight averaged over time: the autoscaler's signal (docs/autoscaling.md).

A count read at one instant is a poor measure of load: under requests that arrive at random, an
engine holding 1 in flight on average reads 2 or more a quarter of the time, and the controller's
window of such readings crossed a target of 1.5 often enough to scale up and down again every
minute. The engine server reads its count every SAMPLE_PERIOD and reports the mean of the last
WINDOW_S (EngineStatus.in_flight_average); the node manager passes it on in its heartbeats.
"""

from __future__ import annotations

import statistics
from collections import deque

SAMPLE_PERIOD = 0.05  # seconds between readings: well below a request's time in the engine
WINDOW_S = 1.0  # the mean is over this long: the node manager reads the status once a second


class InFlightMeter:
    """Readings of the engine's requests in flight (`add`), and their mean over the last window."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self._readings: deque[tuple[float, int]] = deque()  # (monotonic time, requests in flight)

    def add(self, now: float, in_flight: int) -> None:
        self._readings.append((now, in_flight))
        self._forget(now)

    def average(self, now: float, in_flight: int) -> float:
        """The mean of the readings of the last window; with none, `in_flight`, the count read now
        (the loop was held longer than the window, say by a long prompt tokenized on it: read as
        0, a busy engine would say it is idle; or nothing was read yet)."""
        self._forget(now)
        return statistics.fmean(v for _, v in self._readings) if self._readings else float(in_flight)

    def _forget(self, now: float) -> None:
        while self._readings and self._readings[0][0] <= now - self.window_s:
            self._readings.popleft()
