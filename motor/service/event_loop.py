"""Which event loop a service runs on: the standard library's, or uvloop (libuv), which wakes for
each gRPC completion with less Python around it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal

EventLoop = Literal["uvloop", "asyncio"]


def run_on(loop: EventLoop, main: Coroutine[Any, Any, None]) -> None:
    """asyncio.run(main) on the chosen loop."""
    if loop == "uvloop":
        import uvloop  # imported only when chosen: the node manager and the door never load it

        uvloop.run(main)
    else:
        asyncio.run(main)
