"""The real vllm-router binary, and simulated engine servers behind it."""

from __future__ import annotations

from tests.support.router_process import any_router, router  # noqa: F401 (fixtures)
