"""The controller runs on uvloop unless told otherwise; asyncio stays available."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from controller.cli import parse_config
from motor.errors import ConfigError
from motor.service.event_loop import run_on


@pytest.mark.parametrize(("choice", "loop_type"), [("uvloop", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_a_service_runs_on_the_loop_it_chose(choice, loop_type) -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        seen.append(asyncio.get_running_loop())

    run_on(choice, main())
    assert isinstance(seen[0], loop_type)
    assert isinstance(seen[0], uvloop.Loop) == (choice == "uvloop")


def test_the_controller_defaults_to_uvloop_and_takes_asyncio(tmp_path) -> None:
    db = str(tmp_path / "c.db")
    assert parse_config(["--db", db]).event_loop == "uvloop"
    assert parse_config(["--db", db, "--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="event_loop"):
        parse_config(["--db", db, "--event-loop", "trio"])
