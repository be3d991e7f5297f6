"""The real vllm-router, for the front door's tests in front of it."""

from __future__ import annotations

from tests.support.router_process import router  # noqa: F401 (fixtures)
