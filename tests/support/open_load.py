"""Open-loop load: requests sent at a fixed rate whatever the answers, each one's outcome and timing
kept, for tests that count what a fault cost clients; and HTTP in one call."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from tests.support.background import OpenLoop


def http(method: str, url: str, body=None, timeout: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class OpenLoad(OpenLoop):
    """Open-loop completions through a router (one request every `period` s, each on its own
    thread): a stalled request does not slow the others. `results`: (sent, status, answered)."""

    SIM_COMPLETION = {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}

    def __init__(
        self, url: str, period: float = 0.05, timeout: float = 30.0, body: dict | None = None, join_timeout: float = 0
    ):
        """`timeout`: each request's; `body`: the completion sent (the simulated engine's by default);
        `join_timeout`: how long the end waits for each request thread (default `timeout` + 5)."""
        super().__init__(period, join_timeout or timeout + 5)
        self.url, self.timeout = url, timeout
        self.body = body if body is not None else self.SIM_COMPLETION
        self.results: list[tuple[float, int, float]] = []

    def request(self) -> None:
        sent = time.monotonic()
        try:
            status, _ = http("POST", self.url + "/v1/completions", self.body, timeout=self.timeout)
        except OSError:
            status = 0
        self.results.append((sent, status, time.monotonic()))

    def failed(self) -> list[tuple[float, int, float]]:
        return [r for r in self.results if r[1] != 200]

    def served_rate(self, start: float, end: float) -> float:
        """Completions answered 200 within [start, end) (monotonic), per second."""
        served = sum(1 for _, status, answered in self.results if status == 200 and start <= answered < end)
        return served / (end - start)

    def lowest_rate(self, start: float, end: float, window: float = 2.0) -> float:
        """The lowest served rate in any `window` s between start and end (windows every 0.25 s)."""
        starts = [start + 0.25 * i for i in range(int((end - start - window) / 0.25) + 1)]
        return min(self.served_rate(t, t + window) for t in starts)
