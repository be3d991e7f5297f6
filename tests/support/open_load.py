"""Open-loop load: requests sent at a fixed rate whatever the answers, each one's outcome and timing
kept, for tests that count what a fault cost clients; and HTTP in one call."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request


def http(method: str, url: str, body=None, timeout: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class OpenLoad:
    """Open-loop completions through a router (one request every `period` s, each on its own
    thread): a stalled request does not slow the others. `results`: (sent, status, answered)."""

    SIM_COMPLETION = {"model": "sim-tiny", "prompt": "x", "max_tokens": 2}

    def __init__(
        self, url: str, period: float = 0.05, timeout: float = 30.0, body: dict | None = None, join_timeout: float = 0
    ):
        """`timeout`: each request's; `body`: the completion sent (the simulated engine's by default);
        `join_timeout`: how long the end waits for each request thread (default `timeout` + 5)."""
        self.url, self.period, self.timeout = url, period, timeout
        self.body = body if body is not None else self.SIM_COMPLETION
        self.join_timeout = join_timeout or timeout + 5
        self.results: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, daemon=True)
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> OpenLoad:
        self._sender.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sender.join()
        for thread in self._threads:
            thread.join(timeout=self.join_timeout)

    def _send(self) -> None:
        while not self._stop.is_set():
            thread = threading.Thread(target=self._one, daemon=True)
            thread.start()
            self._threads.append(thread)
            time.sleep(self.period)

    def _one(self) -> None:
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
