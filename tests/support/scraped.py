"""A process's Prometheus series read over HTTP, for the tests that count what engines and the door did."""

from __future__ import annotations

import re

from tests.support.open_load import http


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of `name`'s samples at `url`/metrics, of those whose labels contain `labels` if given."""
    status, text = http("GET", url + "/metrics", timeout=10)
    assert status == 200, text
    labelled = rf"\{{[^}}]*{labels}[^}}]*\}}" if labels else r"(?:\{[^}]*\})?"
    return sum(float(v) for v in re.findall(rf"^{name}{labelled} (\S+)$", text, re.M))


def kv_decisions(door_url: str, reason: str) -> float:
    """How many requests the door's KV routing decided for `reason` (cached, balanced, router, fallback)."""
    return metric(door_url, "motor_front_door_kv_decisions_total", f'reason="{reason}"')
