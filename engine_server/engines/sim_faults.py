"""The simulated engine's /sim/faults routes: read the faults, change some now, or go back to the
config's. The engine (sim.py) holds the faults and applies them (`_apply_faults`)."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from engine_server.engines.sim_answers import error
from motor.contract.engine_args import SimFaults
from motor.service.config import describe_validation_error

logger = logging.getLogger(__name__)
_BAD_BODY = 'body must be a JSON object of faults, e.g. {"fail_inference": true}'


class FaultRoutes:
    def __init__(self, engine: Any):  # (a SimEngine: sim.py imports this module)
        self.engine = engine

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/sim/faults", self.get),
            web.post("/sim/faults", self.post),
            web.delete("/sim/faults", self.reset),
        ]

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.faults.model_dump())

    async def post(self, request: web.Request) -> web.Response:
        engine = self.engine
        try:
            change = await request.json()
        except ValueError:
            return error(400, _BAD_BODY)
        if not isinstance(change, dict):
            return error(400, _BAD_BODY)
        try:
            SimFaults.model_validate(change)  # names the bad key before anything changes
            engine.faults = SimFaults.model_validate({**engine.faults.model_dump(), **change})
        except ValidationError as exc:
            return error(400, describe_validation_error(exc, "faults"))
        logger.warning("sim faults changed: %s -> %s", change, engine.faults.model_dump())
        engine._apply_faults()
        return web.json_response(engine.faults.model_dump())

    async def reset(self, request: web.Request) -> web.Response:
        engine = self.engine
        engine.faults = engine._initial_faults()
        engine._apply_faults()
        logger.warning("sim faults reset to the config's: %s", engine.faults.model_dump())
        return web.json_response(engine.faults.model_dump())
