"""Real engine_server processes (sim engine) for the engine server's end-to-end tests."""

from __future__ import annotations

from tests.support.engine_server_process import engine_server  # noqa: F401 (fixtures)
