"""A streamed OpenAI completion read event by event, as a client sees it: each `data:` event with
the time it arrived, for the stream-continuation test and bench (tests/vllm/
test_vllm_stream_continuation.py, bench/stream_continuation.py)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Streamed:
    status: int
    events: list[tuple[float, object]] = field(default_factory=list)  # (arrival, parsed JSON or "[DONE]")
    broken: str = ""  # the connection's error, if it broke before its end
    sent: float = 0.0

    @property
    def chunks(self) -> list[dict]:
        return [e for _, e in self.events if isinstance(e, dict) and "error" not in e]

    @property
    def errors(self) -> list[dict]:
        return [e for _, e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1][1] == "[DONE]"

    def texts(self) -> list[str]:
        """Each choice chunk's text (a completion's `text`, a chat chunk's `delta.content`)."""
        out = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or []:
                piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                out.append(piece or "")
        return out

    @property
    def text(self) -> str:
        return "".join(self.texts())

    @property
    def token_ids(self) -> list[int]:
        return [
            t for chunk in self.chunks for choice in chunk.get("choices") or [] for t in choice.get("token_ids") or []
        ]

    @property
    def usage(self) -> dict | None:
        usages = [chunk["usage"] for chunk in self.chunks if chunk.get("usage")]
        return usages[-1] if usages else None

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c["finish_reason"] for chunk in self.chunks for c in chunk.get("choices") or [] if c.get("finish_reason")
        ]

    def fields(self, name: str) -> list[dict]:
        """The chunks that carry `name`, at the top or in a choice."""
        return [c for c in self.chunks if name in c or any(name in choice for choice in c.get("choices") or [])]

    def gaps(self) -> list[float]:
        """Seconds between consecutive events."""
        times = [at for at, _ in self.events]
        return [b - a for a, b in zip(times, times[1:])]


def stream(
    base_url: str,
    path: str,
    body: dict,
    on_event: Callable[[int, object], None] | None = None,
    timeout: float = 120.0,
) -> Streamed:
    """POST `body` (with "stream": true) to `base_url + path` and read its events to the end;
    `on_event(index, event)` is called as each arrives (a fault can be injected from there)."""
    url = urlsplit(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    result = Streamed(status=0, sent=time.monotonic())
    try:
        connection.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        result.status = response.status
        if response.status != 200:
            result.events.append(
                (time.monotonic(), {"error": {"status": response.status, "body": response.read().decode()}})
            )
            return result
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            event: object = "[DONE]" if payload == b"[DONE]" else json.loads(payload)
            result.events.append((time.monotonic(), event))
            if on_event is not None:
                on_event(len(result.events) - 1, event)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.broken = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    return result
