"""An engine is up only while it serves its deployment's model: the engine server's health check
holds a simulated engine that serves another name in INIT, with a reason naming both names."""

from __future__ import annotations

import asyncio

import pytest

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from engine_server.served_model import served_model_health
from engine_server.server import EngineServer
from engine_server.status import Health
from motor.contract.user_config import EngineSection
from motor.ports import free_port


async def run_engine(serves: str, deployment_model: str | None, seconds: float = 1.0) -> EngineServer:
    options = EngineOptions(
        role="union", instance_id="u-0", dp_rank=0, host="127.0.0.1", port=free_port(), master_dp_ip="127.0.0.1",
        engine_args={"model": serves},
    )  # fmt: skip
    section = EngineSection.model_validate(
        {"engine_type": "sim", "engine_args": {"model": serves}, "deployment_model": deployment_model,
         "health_check_config": {"health_poll_interval": 0.05}}
    )  # fmt: skip
    engine = SimEngine(options)
    health = served_model_health(options, section)
    core = EngineServer(options, section, engine, health_client=health)
    if health is not None:
        health.report_to(core.machine)
    await core.start()
    deadline = asyncio.get_running_loop().time() + seconds
    while core.machine.state is Health.INIT and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return core


@pytest.mark.parametrize("serves", ["sim-small", "sim-other"])
async def test_an_engine_is_normal_only_while_it_serves_the_deployments_model(serves):
    core = await run_engine(serves, deployment_model="sim-small")
    try:
        if serves == "sim-small":
            assert core.machine.state is Health.NORMAL
        else:
            assert core.machine.state is Health.INIT
            assert "'sim-other'" in core.machine.reason and "'sim-small'" in core.machine.reason
    finally:
        await core.close(1.0)


async def test_an_engine_server_started_without_a_deployment_model_checks_only_health():
    core = await run_engine("anything", deployment_model=None)
    try:
        assert core.machine.state is Health.NORMAL
    finally:
        await core.close(1.0)
