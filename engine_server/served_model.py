"""An engine is up only while it serves its deployment's model.

An engine that answers GET /health 200 under another model name (`engine_args.model` or vLLM's
`served_model_name` naming something else) answered every request for the deployment's model 404
while Motor listed it as serving. This health check adds one question to GET /health: does GET
/v1/models list the name the controller wrote in the section (`deployment_model`)? Until it does
the engine stays INIT, with a reason naming both names; once NORMAL, a check that finds another
name counts as a failed check like a /health error (ABNORMAL after max_failure_count).
"""

from __future__ import annotations

import aiohttp

from engine_server.engines.base import EngineOptions
from engine_server.probing import HttpHealthClient, HttpSession, ProbeFailed
from engine_server.server import connect_host
from engine_server.status import Event, Health, HealthStateMachine
from motor.contract.names import excerpt
from motor.contract.user_config import EngineSection


class ServedModelHealthClient(HttpSession, HttpHealthClient):
    """GET /health (on a connection of its own, its answerer checked), then GET /v1/models on a
    kept session, which must list `model`; ProbeFailed saying why not."""

    def __init__(self, base_url: str, timeout: float, model: str):
        super().__init__(base_url, timeout)
        self.models_url = base_url.rstrip("/") + "/v1/models"
        self.model = model
        self.machine: HealthStateMachine | None = None

    def report_to(self, machine: HealthStateMachine) -> None:
        """Name a mismatch in `machine`'s reason while it is INIT (its log says it in any case)."""
        self.machine = machine

    async def check(self) -> None:
        await super().check()
        served = await self._served()
        if self.model in served:
            return
        shown = ", ".join(excerpt(name) for name in served) or "no model"
        problem = (
            f"the engine serves {shown}, not the deployment's model {self.model!r} "
            "(engine_args' model or served_model_name names another model)"
        )
        if self.machine is not None and self.machine.state is Health.INIT:
            self.machine.fire(Event.STARTING, f"starting: {problem}")
        raise ProbeFailed(problem)

    async def _served(self) -> list[str]:
        try:
            async with self.session(aiohttp.ClientTimeout(total=self.timeout)).get(self.models_url) as response:
                if response.status != 200:
                    raise ProbeFailed(f"GET /v1/models answered {response.status}")
                body = await response.json(content_type=None)
        except TimeoutError:
            raise ProbeFailed(f"GET /v1/models timed out after {self.timeout:g}s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise ProbeFailed(f"GET /v1/models failed: {type(exc).__name__}") from None
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            raise ProbeFailed("GET /v1/models answered without a list of models")
        return [str(entry.get("id")) for entry in data if isinstance(entry, dict)]


def served_model_health(options: EngineOptions, section: EngineSection) -> ServedModelHealthClient | None:
    """The health check of an engine started for a deployment's model (None: a section without
    `deployment_model`, e.g. an engine server started by hand, keeps the plain GET /health)."""
    if not section.deployment_model:
        return None
    base_url = f"http://{connect_host(options.host)}:{options.port}"
    timeout = section.health_check_config.health_collector_timeout
    return ServedModelHealthClient(base_url, timeout, section.deployment_model)
