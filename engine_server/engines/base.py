"""The contract between the engine server and one inference engine.

The engine server owns the management plane (status, probes, drain, metrics of its own);
an `EngineBackend` owns the inference plane: it serves the OpenAI-compatible HTTP API
(`/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`) on `options.host:options.port`.
Probes reach the engine over that same HTTP API, so probing logic is engine-independent.
"""

from __future__ import annotations

import abc
import functools
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from motor.errors import ConfigError
from motor.service.config import describe_validation_error

# Probes carry `X-Request-Id: {timestamp}-{token}_virtual`, where the token is a secret of this
# engine server: only ids carrying it are probes (kept out of the metrics), so a client id that
# merely ends in `_virtual` is counted like any other. The token is kept in the environment so
# that the engine's child processes (vLLM's engine core, spawned) see the same one.
PROBE_TOKEN_ENV = "MOTOR_PROBE_ID_TOKEN"


def probe_token() -> str:
    """This engine server's probe-id token (made on first use, inherited by its children)."""
    token = os.environ.get(PROBE_TOKEN_ENV)
    if not token:
        token = os.environ[PROBE_TOKEN_ENV] = secrets.token_hex(8)
    return token


def probe_request_id(stamp_ms: int) -> str:
    """The X-Request-Id of a probe sent at `stamp_ms` (epoch milliseconds)."""
    return f"{stamp_ms}-{probe_token()}_virtual"


def is_probe_request_id(request_id: str | None) -> bool:
    """True only for this engine server's probe ids, also as engines rewrite them
    (vLLM: `cmpl-<id>-<prompt index>`, `chatcmpl-<id>`)."""
    return bool(request_id) and _probe_id_pattern(probe_token()).search(request_id) is not None


@functools.lru_cache(maxsize=4)
def _probe_id_pattern(token: str) -> re.Pattern:
    return re.compile(rf"\d-{re.escape(token)}_virtual(-\d+)?$")


@dataclass
class EngineOptions:
    """Everything an engine needs to start, from the command line and the user_config section."""

    role: str  # "prefill" | "decode" | "union"
    instance_id: str
    dp_rank: int
    host: str
    port: int  # inference plane
    master_dp_ip: str
    kv_port: int | None = None
    dp_rpc_port: int | None = None
    # The engine's own arguments from the user_config section (model path, parallel sizes, ...).
    engine_args: dict[str, Any] = field(default_factory=dict)


class UtilizationSampler(abc.ABC):
    """Reads accelerator utilization (percent, 0-100) of the accelerators this engine uses."""

    name: str = "unknown"

    @abc.abstractmethod
    async def sample(self) -> float:
        """One reading now, as a percentage (the peak across this engine's accelerators)."""


class EngineDied(Exception):
    """The engine itself died (vLLM EngineDeadError, dead engine-core or child process)."""


class EngineBackend(abc.ABC):
    """One inference engine. Subclasses: SimEngine (engines/sim.py), VllmEngine
    (engines/vllm_engine.py), SglangEngine (engines/sglang.py); `engines.engine_class(type)` maps the
    user_config `engine_type` to the class, importing it lazily.

    Life of a backend inside the engine server:
      check_args (classmethod, at start-up, before anything runs) -> __init__ -> start ->
      [sleep / wake_up ...] -> shutdown (once, after draining);  wait_dead runs alongside all along.
    The engine server polls `GET /health` on options.host:options.port for INIT -> NORMAL and sends
    the virtual-inference probes there, so a backend needs no health logic of its own.
    """

    engine_type: str = "unknown"
    # Whether Sleep/WakeUp are supported (vLLM sleep mode, the simulated engine).
    can_sleep: bool = False
    # A pydantic model of the engine's `engine_args`, checked by the default check_args.
    args_model: type[BaseModel] | None = None
    # check_args takes seconds (vLLM imports itself and reads the model's config): the engine
    # server runs it once its management plane answers INIT "checking the configuration".
    slow_check_args: bool = False
    # Seconds shutdown() may take, on top of the drain: with drain_timeout, what the engine
    # server asks its node manager to wait between SIGTERM and SIGKILL (EngineStatus.stop_grace).
    shutdown_grace: float = 5.0

    def __init_subclass__(
        cls,
        engine_type: str | None = None,
        can_sleep: bool | None = None,
        args_model: type[BaseModel] | None = None,
        slow_check_args: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """A backend states its class facts in its header, e.g.
        `class SimEngine(EngineBackend, engine_type="sim", can_sleep=True, args_model=SimArgs)`;
        a fact it leaves out keeps the default above (or its own property, as vLLM's can_sleep)."""
        super().__init_subclass__(**kwargs)
        facts = {
            "engine_type": engine_type,
            "can_sleep": can_sleep,
            "args_model": args_model,
            "slow_check_args": slow_check_args,
        }
        for name, value in facts.items():
            if value is not None:
                setattr(cls, name, value)

    def __init__(self, options: EngineOptions):
        self.options = options
        # The engine_args as a model instance, for engines with an args_model.
        self.args: Any = self.args_model.model_validate(options.engine_args) if self.args_model else None

    @classmethod
    def check_args(cls, engine_args: dict[str, Any], field: str) -> dict[str, Any]:
        """Validate the user_config `engine_args` at start-up, before anything starts.

        `field` is the path of engine_args in the user_config (e.g.
        "motor_engine_prefill_config.engine_args"); raise motor.errors.ConfigError with a message
        that starts with the full path of the bad value (the engine server exits with code 2).
        Return the (possibly normalised) arguments. The default validates `args_model` when the
        engine has one, and accepts anything otherwise."""
        if cls.args_model is None:
            return engine_args
        try:
            return cls.args_model.model_validate(engine_args).model_dump(exclude_unset=True)
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, field, cls.args_model)) from None

    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving the inference plane; return once it is launched (it may still be loading).

        Raise an exception with a clear message when the engine cannot start at all."""

    @abc.abstractmethod
    async def wait_dead(self) -> str:
        """Return (with a reason) only when the engine itself has died. Never returns while healthy."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine and free its resources. Called once, after draining."""

    def stop_admitting(self) -> None:
        """A drain starts (SIGTERM or the Drain RPC): from now on answer new inference requests
        503 with Retry-After, and let those in flight finish. Default: keep admitting."""

    def stop_serving(self, reason: str) -> int:
        """The stall watchdog took the engine out of the routers (serving.py): answer 503 ("engine
        not serving: <reason>") to every client request it holds that has sent nothing yet,
        cancelling it in the engine, and to new client requests until `serve_again`; probes pass.
        Returns how many were failed back. Default: nothing (an HTTP layer that is not Motor's:
        SGLang). The sim engine and vLLM share the rule (admission.py)."""
        return 0

    def serve_again(self) -> None:
        """The engine is back in the routers: take client requests again."""

    def process_groups(self) -> list[int]:
        """Process groups the engine made for its processes (vLLM: its engine core's), searched
        at exit for anything left: a child re-parented to init is no descendant any more."""
        return []

    def in_flight_requests(self) -> int:
        """Requests in flight on the inference plane, probes excluded (used by Drain)."""
        return 0

    async def sleep(self, level: int) -> None:
        """Release accelerator memory (level 1: offload weights, 2: discard them); only called
        when can_sleep is true, with level 1 or 2, and never while already sleeping."""
        raise NotImplementedError

    async def wake_up(self) -> None:
        """Undo sleep(); only called when can_sleep is true and the engine sleeps."""
        raise NotImplementedError

    def progress(self) -> int | None:
        """A count that grows while the engine works for client requests (tokens produced,
        scheduler steps completed; probes excluded), or None when this engine cannot tell.
        Virtual inference excuses a failed probe only on a busy engine that made progress."""
        return None

    def request_outcomes(self) -> tuple[int, int] | None:
        """(client requests that succeeded, client requests that failed with a server error:
        HTTP 5xx other than 503), probes excluded, both counting up since the start; None when
        this engine cannot tell. The stall watchdog (serving.py) takes an engine whose requests
        all fail out of the routers."""
        return None

    def utilization_sampler(self) -> UtilizationSampler | None:
        """A sampler this engine provides (the simulated engine's figure), or None to use the
        machine's (NVML, npu-smi)."""
        return None
