"""The one way a deployment file writes a duration, wherever it takes one (restart_policy's
backoffs and windows, strategy's deadlines, autoscaling's scale_down_delay_s): seconds as a plain
number (`60`, `0.5`), or a number with a unit: `500ms`, `60s`, `5m`, `1h`."""

from __future__ import annotations

import math
import re
from typing import Any

FORMS = "seconds as a number (60) or with a unit: 500ms, 60s, 5m, 1h"
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "": 1.0}
_WRITTEN = re.compile(r"(-?\d+(?:\.\d+)?)\s*(ms|s|m|h|)")


def parse_seconds(value: Any) -> float | None:
    """`value` in seconds, or None when it is not a duration as FORMS says."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    written = _WRITTEN.fullmatch(value.strip())
    if written is None:
        return None
    return float(written.group(1)) * _UNITS[written.group(2)]


def protobuf_json(seconds: float) -> str:
    """A google.protobuf.Duration as protobuf JSON writes it ("1.5s"), to the nanosecond."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"
