"""A request body's Content-Encoding (and any transfer coding under `chunked`) undone, within a
size limit that holds while it unpacks.

A few kB of gzip can unpack to gigabytes: the body is unpacked a step at a time and refused the
moment it passes the limit, so the door never holds more than the limit (and one step) of it. The
relay runs this off its event loop (BodyReader, below). Brotli is not read (415): its
Python module unpacks a body whole, with no bound on what comes out.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from front_door.messages import Answer, Request, error_answer

logger = logging.getLogger(__name__)

STEP = 1024 * 1024  # bytes unpacked at a time
TOO_LARGE = "The request body is larger than the front door takes."


class TooLarge(Exception):
    """A compressed body that unpacks past the relay's limit."""


def _inflate(body: bytes, wbits: int, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    parts: list[bytes] = []
    size, pending = 0, body
    while True:
        part = inflater.decompress(pending, STEP)
        size += len(part)
        if size > limit:
            raise TooLarge
        parts.append(part)
        pending = inflater.unconsumed_tail
        if not part and not pending:
            break
    return b"".join(parts)


def decoded(body: bytes, encoding: str, limit: int) -> bytes | None:
    """A request body without its Content-Encoding; None if it is not one the relay reads."""
    if encoding == "gzip" or encoding == "x-gzip":
        return _inflate(body, 16 + zlib.MAX_WBITS, limit)
    if encoding == "deflate":
        try:
            return _inflate(body, zlib.MAX_WBITS, limit)
        except zlib.error:
            return _inflate(body, -zlib.MAX_WBITS, limit)  # raw deflate, as some clients send it
    if encoding == "identity":
        return body
    return None


INLINE_BODY = 64 * 1024  # a plain body up to this is read on the loop (microseconds); larger, on a thread
BODY_THREADS = 2  # bodies unpacked and read at once: the door's memory for them is this many limits


class BodyReader:
    """A request body made ready for the door's rules: its Content-Encoding undone (bodies.py) and
    `read` (the door's own reading of it, touching nothing shared) run on it. A small plain body is
    read on the loop; a compressed or large one on one of BODY_THREADS threads (zlib unpacks without
    Python's lock; the reading builds nothing), so another client's latency never waits on it."""

    def __init__(self, read: Callable[[Request], Answer | None]) -> None:
        self.read = read
        self.threads = ThreadPoolExecutor(BODY_THREADS, thread_name_prefix="front-door-body")

    @staticmethod
    def encoding(request: Request) -> str:
        for name, value in request.headers:
            if name.lower() == b"content-encoding":
                return value.decode("latin-1").strip().lower()
        return ""

    @staticmethod
    def transfer_codings(request: Request) -> list[str]:
        """The codings under `chunked` (`Transfer-Encoding: gzip, chunked`), last applied first.
        The router is sent a length, so they are undone here like a Content-Encoding."""
        codings = [
            coding.strip().lower()
            for name, value in request.headers
            if name.lower() == b"transfer-encoding"
            for coding in value.decode("latin-1").split(",")
        ]
        return [coding for coding in reversed(codings) if coding not in ("chunked", "")]

    def heavy(self, request: Request) -> bool:
        coded = self.encoding(request) or self.transfer_codings(request)
        return len(request.body) > INLINE_BODY or bool(request.body and coded)

    def prepare(self, request: Request, limit: int) -> Answer | None:
        """None when the request may go on to the door's rules; else the answer it gets."""
        for coding in self.transfer_codings(request) if request.body else ():
            try:
                body = decoded(request.body, coding, limit)
            except TooLarge:
                return Answer(error_answer(413, TOO_LARGE), 413)
            except Exception:  # noqa: BLE001 - zlib's own errors
                return Answer(error_answer(400, f"the body is not valid {coding} (Transfer-Encoding)"), 400)
            if body is None:  # RFC 9112 6.1: a transfer coding not understood is 501
                return Answer(error_answer(501, f"Transfer-Encoding {coding} is not implemented"), 501)
            request.body = body
        encoding = self.encoding(request)
        if encoding and request.body:
            try:
                body = decoded(request.body, encoding, limit)
            except TooLarge:
                return Answer(error_answer(413, TOO_LARGE), 413)
            except Exception:  # noqa: BLE001 - zlib's own errors
                body = None
            if body is None:
                return Answer(error_answer(415, "the body's Content-Encoding is not readable"), 415)
            request.body, request.encoding = body, encoding
        return self.read(request)

    def off_loop(self, request: Request, limit: int) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self.threads, self.prepare, request, limit)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
