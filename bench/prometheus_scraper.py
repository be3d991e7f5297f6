"""A scraper that asks for /metrics as Prometheus does, for the benchmarks: every `every` seconds
(Prometheus' usual 15 s), asking for gzip, with its default 10 s scrape timeout (a scrape that
takes longer failed, as Prometheus marks the target down), from a thread of the benchmark
process, for as long as it runs.

    scraper = PrometheusScraper(metrics_port)
    scraper.start()
    scraper.next_at(time.monotonic() + 5)   # the phase: move the next scrape (then every `every` s)
    ...
    scraper.stop()
    print(scraper.summary(began, ended))
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass

# What Prometheus 2.x sends (its scrape.go); the exposition asked for is the text format.
HEADERS = {
    "Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    "Accept-Encoding": "gzip",
    "User-Agent": "Prometheus/bench",
}


@dataclass
class Scrape:
    began: float  # monotonic
    seconds: float
    wire_bytes: int
    text_bytes: int
    error: str  # "" when answered within the timeout


class PrometheusScraper(threading.Thread):
    def __init__(self, metrics_port: int, every: float = 15.0, timeout: float = 10.0):
        super().__init__(daemon=True, name="prometheus-scraper")
        self.url, self.every, self.timeout = f"http://127.0.0.1:{metrics_port}/metrics", every, timeout
        self.scrapes: list[Scrape] = []
        self._next = time.monotonic()
        self._wake = threading.Event()
        self._stopped = False

    def next_at(self, when: float) -> None:
        """Scrape next at `when` (monotonic), then every `every` seconds from there."""
        self._next = when
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self.join()

    def run(self) -> None:
        while not self._stopped:
            self._wake.wait(max(0.0, self._next - time.monotonic()))
            self._wake.clear()
            if self._stopped or time.monotonic() < self._next:
                continue  # stopped, or moved
            began = time.monotonic()
            self._next = began + self.every
            self.scrapes.append(self._scrape(began))

    def _scrape(self, began: float) -> Scrape:
        headers = dict(HEADERS, **{"X-Prometheus-Scrape-Timeout-Seconds": f"{self.timeout:g}"})
        try:
            request = urllib.request.Request(self.url, headers=headers)
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                wire = answer.read()
                gzipped = answer.headers.get("Content-Encoding") == "gzip"
            seconds = time.monotonic() - began
            text = len(zlib.decompress(wire, 16 + zlib.MAX_WBITS)) if gzipped else len(wire)
            error = f"took {seconds:.1f}s, over the {self.timeout:g}s timeout" if seconds > self.timeout else ""
            return Scrape(began, seconds, len(wire), text, error)
        except OSError as exc:  # refused, reset, timed out (urllib's URLError is one)
            return Scrape(began, time.monotonic() - began, 0, 0, str(exc))

    def within(self, since: float, until: float) -> list[Scrape]:
        return [s for s in self.scrapes if since <= s.began < until]

    def summary(self, since: float, until: float) -> str:
        """The scrapes begun in [since, until): how many, failures, duration p50 and max, size."""
        scrapes = self.within(since, until)
        if not scrapes:
            return f"no /metrics scrape (every {self.every:g}s)"
        answered = [s for s in scrapes if not s.error]
        failed = [s for s in scrapes if s.error]
        text = f"{len(scrapes)} /metrics scrapes every {self.every:g}s"
        if answered:
            seconds = [s.seconds for s in answered]
            last = answered[-1]
            text += (
                f", {statistics.median(seconds):.2f}s p50 {max(seconds):.2f}s max,"
                f" {last.wire_bytes / 2**20:.1f} MiB gzipped ({last.text_bytes / 2**20:.1f} MiB of text)"
            )
        if failed:
            text += f", {len(failed)} failed ({failed[-1].error})"
        return text
