"""A failed GET /health names where it went: `ClientConnectorError` alone says nothing of which
engine's port refused."""

from __future__ import annotations

import asyncio

import pytest

from engine_server.probing import HttpHealthClient, ProbeFailed
from motor.ports import free_port


def test_a_refused_health_check_names_host_and_port():
    port = free_port()  # nothing listens there

    async def check() -> str:
        client = HttpHealthClient(f"http://127.0.0.1:{port}", timeout=2)
        try:
            with pytest.raises(ProbeFailed) as failed:
                await client.check()
        finally:
            await client.close()
        return str(failed.value)

    message = asyncio.run(check())
    assert message.startswith("GET /health failed: ClientConnectorError at 127.0.0.1:") and str(port) in message
    assert "refused" in message.lower(), message
