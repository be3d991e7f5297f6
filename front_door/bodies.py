"""A request body's Content-Encoding undone, within a size limit."""

from __future__ import annotations

import logging
import zlib

logger = logging.getLogger(__name__)


class TooLarge(Exception):
    """A compressed body that unpacks past the relay's limit."""


def _inflate(body: bytes, wbits: int, limit: int) -> bytes:
    # Never more than `limit` out: a few kB of gzip can unpack to gigabytes.
    inflater = zlib.decompressobj(wbits)
    data = inflater.decompress(body, limit + 1)
    if len(data) > limit or inflater.unconsumed_tail:
        raise TooLarge
    return data


def decoded(body: bytes, encoding: str, limit: int) -> bytes | None:
    """A request body without its Content-Encoding; None if it is not one the relay reads."""
    if encoding == "gzip" or encoding == "x-gzip":
        return _inflate(body, 16 + zlib.MAX_WBITS, limit)
    if encoding == "deflate":
        try:
            return _inflate(body, zlib.MAX_WBITS, limit)
        except zlib.error:
            return _inflate(body, -zlib.MAX_WBITS, limit)  # raw deflate, as some clients send it
    if encoding == "br":
        try:
            import brotli  # the optional codec aiohttp reads too
        except ImportError:
            return None
        return brotli.decompress(body)
    if encoding == "identity":
        return body
    return None
