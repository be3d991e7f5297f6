"""The real vllm-router (and simulated engine servers) in front of a cluster of real processes."""

from __future__ import annotations

from tests.support.router_process import any_router, router  # noqa: F401 (fixtures)
