"""Open-loop load on the front door, each request on a fresh connection and its own thread, with
what went wrong recorded by kind: a refused connection apart from a request cut or failed."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

from tests.support.background import OpenLoop


@dataclass
class Outcome:
    sent: float
    ended: float
    status: int  # 0: no answer
    error: str = ""  # the exception's name when there was no answer


class FreshConnectionLoad(OpenLoop):
    def __init__(self, port: int, model: str, period: float = 0.05, timeout: float = 30.0) -> None:
        super().__init__(period, timeout + 5)
        self.port, self.model, self.timeout = port, model, timeout
        self.outcomes: list[Outcome] = []
        self.in_flight = 0
        self._lock = threading.Lock()

    def request(self) -> None:
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
