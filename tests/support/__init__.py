"""Helpers shared by the test suite."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from motor.ports import free_port
from motor.processes import same_process

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def process_alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has); it may end while we look."""
    return same_process(pid, None)


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(available: bool, what: str) -> None:
    """Skip when a component is missing on a user's machine; fail under CI, where nothing may skip."""
    if available:
        return
    if under_ci():
        pytest.fail(f"{what} is missing, and under CI=true nothing may be skipped for that reason")
    pytest.skip(f"{what} is missing")


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "",
    detail: Callable[[], str] | None = None,
) -> Any:
    """Poll `predicate` until it returns a truthy value; fail after `timeout` seconds, with what
    `detail()` says about the system (state, logs) appended to the message."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the condition may not be checkable yet
            last_error = exc
        time.sleep(interval)
    message = f"timed out after {timeout}s waiting for {what or predicate}" + (
        f" (last error: {last_error!r})" if last_error else ""
    )
    raise AssertionError(message + ("\n" + detail() if detail else ""))


async def async_wait_for(
    predicate: Callable[[], Awaitable[Any] | Any], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Async twin of wait_for; `predicate` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
        except Exception as exc:
            last_error = exc
        await asyncio.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what or predicate}"
        + (f" (last error: {last_error!r})" if last_error else "")
    )


def write_sim_deployment(path, count: int, name: str = "sim") -> str:
    """A deployment file of `count` one-engine union instances of the sim engine; returns its path."""
    import yaml

    document = {
        "name": name,
        "model": "sim-tiny",
        "instance_groups": [{"name": "u", "role": "union", "count": count, "accelerators_per_engine": 1}],
        "engine_config": {"motor_engine_union_config": {"engine_type": "sim", "engine_args": {"model": "sim-tiny"}}},
    }
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(document, handle)
    return str(path)


async def serve_app(app: web.Application, port: int | None = None) -> tuple[web.AppRunner, str]:
    """`app` served on loopback (on `port`, else a free one): its runner (to clean up) and URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
