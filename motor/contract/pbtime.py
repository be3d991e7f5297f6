"""Seconds (float) to and from google.protobuf Duration and Timestamp, through their own helpers."""

from __future__ import annotations

import datetime

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp


def duration(seconds: float) -> Duration:
    value = Duration()
    value.FromTimedelta(datetime.timedelta(seconds=seconds))
    return value


def seconds(value: Duration) -> float:
    # Not ToTimedelta(): a Duration from a request may hold 2^63 seconds, past what a timedelta
    # holds (OverflowError, answered UNKNOWN); the plain sum works for every value.
    return value.seconds + value.nanos / 1e9


def timestamp(wall: float) -> Timestamp:
    """A Timestamp of `wall` (seconds since the epoch, as time.time())."""
    value = Timestamp()
    value.FromDatetime(datetime.datetime.fromtimestamp(wall, datetime.UTC))
    return value


def now() -> Timestamp:
    value = Timestamp()
    value.GetCurrentTime()
    return value
