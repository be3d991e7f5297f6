"""Inference engines the engine server can wrap: vllm (in-process), sglang (child process), sim."""

from __future__ import annotations

from engine_server.engines.base import EngineBackend
from motor.errors import ConfigError

# Where vLLM is missing: `make run` sets up only what the simulated engine needs.
VLLM_INSTALL_HINT = (
    "vLLM is not installed in this environment; `make setup` (scripts/setup-venv.sh) installs it with torch, "
    "or run the node managers where it is installed"
)


def engine_class(engine_type: str) -> type[EngineBackend]:
    """The EngineBackend class for a user_config `engine_type`, imported only when used (vLLM is heavy)."""
    if engine_type == "sim":
        from engine_server.engines.sim import SimEngine

        return SimEngine
    if engine_type == "sglang":
        from engine_server.engines.sglang import SglangEngine

        return SglangEngine
    if engine_type == "vllm":
        try:
            from engine_server.engines.vllm_engine import VllmEngine
        except ImportError as exc:
            raise ConfigError(f"engine_type 'vllm' is not available here ({exc}): {VLLM_INSTALL_HINT}") from None
        return VllmEngine
    raise ConfigError(f"engine_type {engine_type!r} is not one of vllm, sglang, sim")
