"""What the front door's relay passes between its parts: a request read whole, the door's own
answer or a forward to the router, what passed; the bytes of an answer of its own."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)


@dataclass
class Request:
    method: str
    target: bytes  # as the client sent it: path and query
    path: str  # decoded, without the query
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    http_10: bool
    encoding: str = ""  # the body's Content-Encoding, once decoded ("" if it had none)
    label: str = ""  # what the door files it under in its metrics
    began: float = 0.0  # when it was passed to the router
    model: Any = None  # what the door read of its body (front_door/model_field.py ModelField), off the loop
    follow: Any = None  # a stream's plan to go on with it elsewhere if cut (front_door/continuation.py Plan)
    peer: str = ""  # the client's address
    key: Any = None  # its API key (front_door/keys.py Key), once identified
    ticket: Any = None  # its tenant's admission (front_door/admission.py Ticket), given back when answered
    usage: Any = None  # (prompt, completion) tokens read from its answer (front_door/usage.py)
    events: int = 0  # events of its streamed answer written on, where the door does not follow it


@dataclass
class Answer:
    """The door's own answer to a request: a whole HTTP response."""

    data: bytes
    status: int


@dataclass
class Forward:
    """Pass the request to the router, with this body in place of the client's (None: as it came);
    or straight to the engine at `engine` (a URL), which the door chose (front_door/kv_routing.py)."""

    body: bytes | None = None
    engine: str | None = None


@dataclass
class Passed:
    """What the relay tells the door of a request it passed to the router."""

    status: int = 0  # 0: no answer from the router (or the client left before it began)
    router_failed: bool = False  # no connection, or it broke before the answer began


# Headers that belong to one connection, not to the request: the relay writes its own. (Expect: the
# relay answers `100 Continue` itself; Content-Length: of the body as sent on.)
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
    }
)


def routed_target(target: bytes) -> tuple[bytes, str]:
    """A request's target as passed to the router, and its path decoded (what the door's rules read)."""
    if not target.startswith(b"/") and b"://" in target:
        # absolute-form (`POST http://host/path`): the router routes it by its path, so the door
        # reads the path out of it too, and passes it on as a path
        parts = urlsplit(target)
        target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
    if b"#" in target:  # a fragment is the client's own; the router routes without it, so does the door
        target = target.split(b"#", 1)[0]
    path = target.split(b"?", 1)[0].decode("latin-1")
    return target, unquote(path) if "%" in path else path


def body_head(method: bytes, version: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes | None:
    """The stand-in head to read a declined upgrade offer's body with (its method, version, framing
    and keep-alive), or None if it has no body."""
    framing = b""
    for name, value in headers:
        lower = name.lower()
        if lower == b"content-length" and value.strip() not in (b"", b"0"):
            framing = b"Content-Length: " + value.strip()
        elif lower == b"transfer-encoding":
            framing = b"Transfer-Encoding: " + value.strip()
    if not framing:
        return None
    close = b"" if keep_alive else b"\r\nConnection: close"
    return method + b" / HTTP/" + version + b"\r\n" + framing + close + b"\r\n\r\n"


def forwarded(request: Request, host: bytes, body: bytes, key_line: bytes = b"") -> bytes:
    """The request as sent to the router: its own Host and length, without this connection's headers;
    with `key_line` (the engines' key's header: motor/engine_key.py) in place of any key the client sent."""
    lines = [f"{request.method} ".encode() + request.target + (b" HTTP/1.0" if request.http_10 else b" HTTP/1.1")]
    lines.append(b"Host: " + host)
    # Headers the client names in `Connection:` are this connection's too (RFC 9110 7.6.1).
    named = {
        option.strip().lower()
        for name, value in request.headers
        if name.lower() == b"connection"
        for option in value.split(b",")
    }
    for name, value in request.headers:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or (request.encoding and lower == b"content-encoding"):
            continue
        if key_line and lower in (b"authorization", b"x-api-key"):
            continue
        lines.append(name + b": " + value)
    if key_line:
        lines.append(key_line)
    if body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def response(
    status: int, body: bytes = b"", content_type: str = "application/json", head: bool = False, extra: str = ""
) -> bytes:
    """A whole HTTP/1.1 answer of the relay's own (`extra`: more header lines, each ending CRLF)."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"{extra}\r\n".encode()
        + (b"" if head else body)
    )


# vLLM's names for the error types of the statuses the door answers itself (its ErrorResponse).
ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "BadRequestError",
    415: "BadRequestError",
    431: "BadRequestError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_answer(status: int, message: str, kind: str | None = None, param: str | None = None) -> bytes:
    """An answer of the door's own in the error shape OpenAI's clients read (vLLM's ErrorResponse),
    whatever refused the request. A 503 says when to retry: OpenAI's clients retry a 503 after
    Retry-After (else after their own backoff)."""
    error = {"message": message, "type": kind or ERROR_TYPES.get(status, "APIError"), "param": param, "code": status}
    extra = "Retry-After: 1\r\n" if status == 503 else ""
    return response(status, json.dumps({"error": error}).encode(), extra=extra)
