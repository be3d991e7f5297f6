"""A request body's Content-Encoding undone, within a size limit that holds while it unpacks.

A few kB of gzip can unpack to gigabytes: the body is unpacked a step at a time and refused the
moment it passes the limit, so the door never holds more than the limit (and one step) of it. The
relay runs this off its event loop (front_door/relay.py BodyReader). Brotli is not read (415): its
Python module unpacks a body whole, with no bound on what comes out.
"""

from __future__ import annotations

import logging
import zlib

logger = logging.getLogger(__name__)

STEP = 1024 * 1024  # bytes unpacked at a time


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
