"""Specs an engine server refused as such at its start, remembered a short while.

An engine server that exits with code 2 and the cause `config_error` (its termination message)
refused the spec itself: a bad user_config value, or one the engine's own check turns down (vLLM:
`max_model_len` above the model's). Launching the same spec again is refused again, so the next
StartEngine of the same engine with the same user_config is answered INVALID_ARGUMENT at once,
without a launch, quoting the engine server: the controller marks the instance FAILED on that
answer, as for any spec a node refuses, instead of retrying it through its crash-loop backoff.

The memory answers one StartEngine and lasts REMEMBER_S at most: the controller restarts a failed
engine at once, and an operator who fixed what the message names (model files on the host) and
applies the deployment again later gets a real launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from motor.clock import Clock
from motor.contract.names import engine_id as make_engine_id
from motor.contract.termination import CONFIG_ERROR, TerminationMessage
from motor.errors import InvalidArgument
from motor.v1 import types_pb2

# The engine server's exit code for a refused configuration (engine_server/cli.py EXIT_CONFIG).
CONFIG_EXIT_CODE = 2
REMEMBER_S = 60.0


def _user_config(spec: types_pb2.EngineSpec) -> str:
    """What the engine server judged: the user_config it was given, by content or by path."""
    return spec.config_json or f"path:{os.path.abspath(spec.config_path)}"


@dataclass(frozen=True)
class _Refusal:
    user_config: str
    message: str
    at: float


class SpecRefusals:
    def __init__(self, clock: Clock):
        self.clock = clock
        self._by_engine: dict[str, _Refusal] = {}

    def engine_exited(
        self, requested: types_pb2.EngineSpec, exit_code: int | None, message: TerminationMessage | None
    ) -> None:
        """Remember the spec when the engine server said it refused it (exit 2, config_error)."""
        if exit_code != CONFIG_EXIT_CODE or message is None or message.cause != CONFIG_ERROR:
            return
        engine_id = make_engine_id(requested.instance_id, requested.dp_rank)
        self._by_engine[engine_id] = _Refusal(_user_config(requested), message.message, self.clock.monotonic())

    def check(self, requested: types_pb2.EngineSpec) -> None:
        """INVALID_ARGUMENT when the engine server refused this engine's same user_config a moment ago."""
        engine_id = make_engine_id(requested.instance_id, requested.dp_rank)
        refusal = self._by_engine.pop(engine_id, None)  # one answer: a later StartEngine launches
        if refusal is None or refusal.user_config != _user_config(requested):
            return
        age = self.clock.monotonic() - refusal.at
        if age > REMEMBER_S:
            return
        raise InvalidArgument(
            f"spec.config_json: the engine server refused this configuration at its start {age:.1f}s ago "
            f"(exit code {CONFIG_EXIT_CODE}): {refusal.message}; not launched again with the same configuration"
        )
