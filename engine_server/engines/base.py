"""The contract between the engine server and one inference engine.

The engine server owns the management plane (status, probes, drain, metrics of its own);
an `EngineBackend` owns the inference plane: it serves the OpenAI-compatible HTTP API
(`/v1/completions`, `/v1/chat/completions`, `/health`, `/metrics`) on `options.host:options.port`.
Probes reach the engine over that same HTTP API, so probing logic is engine-independent.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

# Probes carry `X-Request-Id: {timestamp}_virtual`; engines rewrite ids (vLLM: `cmpl-<id>-<index>`),
# so match the suffix with an optional prompt index.
VIRTUAL_REQUEST_ID_PATTERN = r"_virtual(-\d+)?$"


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
    """One inference engine. Subclasses: SimEngine, VllmEngine, SglangEngine."""

    engine_type: str = "unknown"
    # Whether Sleep/WakeUp are supported (vLLM sleep mode, the simulated engine).
    can_sleep: bool = False

    def __init__(self, options: EngineOptions):
        self.options = options

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

    def in_flight_requests(self) -> int:
        """Requests in flight on the inference plane, probes excluded (used by Drain)."""
        return 0

    async def sleep(self, level: int) -> None:
        raise NotImplementedError

    async def wake_up(self) -> None:
        raise NotImplementedError

    def utilization_sampler(self) -> UtilizationSampler | None:
        """A sampler this engine provides (the simulated engine's figure), or None to use the
        machine's (NVML, npu-smi)."""
        return None
