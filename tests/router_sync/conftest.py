"""The real routers (vllm-router, and SGLang's gateway for the tests of both), for the sync's tests."""

from __future__ import annotations

from tests.support.router_process import any_router, router  # noqa: F401 (fixtures)
