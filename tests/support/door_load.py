"""Open-loop load on the front door, each request on a fresh connection and its own thread, with
what went wrong recorded by kind: a refused connection apart from a request cut or failed."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass


@dataclass
class Outcome:
    sent: float
    ended: float
    status: int  # 0: no answer
    error: str = ""  # the exception's name when there was no answer


class FreshConnectionLoad:
    def __init__(self, port: int, model: str, period: float = 0.05, timeout: float = 30.0) -> None:
        self.port, self.model, self.period, self.timeout = port, model, period, timeout
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, daemon=True)
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> FreshConnectionLoad:
        self._sender.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sender.join()
        for thread in self._threads:
            thread.join(self.timeout + 5)

    def _send(self) -> None:
        while not self._stop.is_set():
            thread = threading.Thread(target=self._one, daemon=True)
            thread.start()
            self._threads.append(thread)
            time.sleep(self.period)

    def _one(self) -> None:
        sent = time.monotonic()
        with self._lock:
            self.in_flight += 1
        status, error = 0, ""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            body = json.dumps({"model": self.model, "prompt": "x", "max_tokens": 2})
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            reply.read()
            status = reply.status
        except (OSError, http.client.HTTPException) as exc:
            error = type(exc).__name__
        finally:
            connection.close()
            with self._lock:
                self.in_flight -= 1
        self.outcomes.append(Outcome(sent, time.monotonic(), status, error))

    def refused(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error == "ConnectionRefusedError"]

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]
