"""The engine's user_config: typed models (errors name the field) and the TLS files it implies.

One contract for the engine server (which loads it and, when standalone, serves its management
plane with `mgmt_tls_config`) and the controller (which checks a deployment's engine_config
before placing it). Under a node manager, engines serve with the node's own TLS settings and a
request may not turn `mgmt_tls_config` on (motor/contract/engine_policy.py).

Shape (one section per role; see examples/user_config.json):

    {
      "motor_engine_prefill_config": {"engine_type": "sim", "engine_args": {...},
                                      "health_check_config": {...}, "mgmt_tls_config": {...},
                                      "drain_timeout": 30},
      "motor_engine_decode_config": {...},
      "motor_engine_union_config": {...}      # optional: the union role falls back to prefill's
    }

Every model forbids unknown keys, so a typo is reported by name instead of silently ignored.
The one exception is the top level: MindIE's user_config files also hold the sections of other
components (`motor_controller_config`, `motor_nodemanger_config`, ...: any `motor_<name>_config`
whose name does not start with `engine_`); those are accepted and ignored
(`UserConfig.ignored_sections`, logged once by the engine server). A `motor_engine_*` key that is
not a role's section is still a typo.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from motor.errors import ConfigError
from motor.service.grpc_server import TlsFiles

ENGINE_TYPES = ("vllm", "sglang", "sim")

SECTION_BY_ROLE = {
    "prefill": "motor_engine_prefill_config",
    "decode": "motor_engine_decode_config",
    "union": "motor_engine_union_config",
}


def section_name_for(role: str, present: Collection[str]) -> str:
    """The role's own section; the union role falls back to the prefill section when it has none.

    `present` holds the names of the sections the user_config has. The returned name may be
    absent from it: then the role's section is missing."""
    name = SECTION_BY_ROLE[role]
    if name not in present and role == "union" and SECTION_BY_ROLE["prefill"] in present:
        return SECTION_BY_ROLE["prefill"]
    return name


class _Strict(BaseModel):
    # strict: "true" is not a bool and "5" is not a number; extra: typos are named.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class HealthCheckConfig(_Strict):
    """Virtual inference (probing) and status settings. Defaults follow MindIE-PyMotor."""

    enable_virtual_inference: bool = False
    # Utilization (percent) below which the accelerator counts as idle: a failed probe then
    # counts towards max_failure_count, and the interval returns to probe_interval. As in
    # MindIE, virtual inference runs only with 0 < npu_usage_threshold <= 100 (`probing`);
    # another value turns it off with a warning (`warnings`).
    npu_usage_threshold: float = 3.0
    # Timeout (seconds) of each GET /health while the engine starts (INIT).
    health_collector_timeout: float = Field(2.0, gt=0)
    max_failure_count: int = Field(6, ge=1)
    probe_interval: float = Field(5.0, gt=0)
    busy_probe_interval: float = Field(20.0, gt=0)
    # Peak utilization (percent) at or above which the engine counts as busy.
    busy_utilization: float = Field(80.0, gt=0, le=100)
    probe_timeout: float = Field(5.0, gt=0)
    # How long utilization is sampled per probe round (the peak over it decides).
    utilization_window: float = Field(3.0, gt=0)
    utilization_sample_period: float = Field(0.5, gt=0)
    # How often GET /health is tried while INIT.
    health_poll_interval: float = Field(0.5, gt=0)
    # The stall watchdog (engine_server/serving.py), on whatever enable_virtual_inference says:
    # client requests in flight and no progress (tokens, scheduler steps) for stall_timeout
    # seconds -> the engine is not serving: it leaves the routers and fails back the requests it
    # holds (503) at once. 2 s is above the chunked-prefill steps of a 70B model on a GPU up to
    # 128k-token prompts, and keeps a hang under 3 s in rotation (docs/engine-server.md).
    stall_timeout: float = Field(2.0, gt=0)
    # A stall (or failing requests) lasting this long turns the engine ABNORMAL: its node
    # manager kills it and the controller replaces it.
    stall_kill_after: float = Field(10.0, gt=0)

    @property
    def probing(self) -> bool:
        """Whether virtual inference runs: enabled, with a threshold MindIE accepts."""
        return self.enable_virtual_inference and 0 < self.npu_usage_threshold <= 100

    def warnings(self, field: str) -> list[str]:
        """Settings MindIE accepts but that change what probing does, one line each."""
        found = []
        if self.enable_virtual_inference and not self.probing:
            found.append(
                f"{field}.npu_usage_threshold: {self.npu_usage_threshold:g} is outside 0 < npu_usage_threshold "
                "<= 100: virtual inference is off"
            )
        elif self.probing and self.npu_usage_threshold > self.busy_utilization:
            found.append(
                f"{field}.npu_usage_threshold ({self.npu_usage_threshold:g}) exceeds busy_utilization "
                f"({self.busy_utilization:g}): an engine between the two counts as idle yet is probed at "
                "busy_probe_interval"
            )
        return found

    @model_validator(mode="after")
    def _coherent(self) -> HealthCheckConfig:
        if self.utilization_sample_period > self.utilization_window:
            raise ValueError(
                f"utilization_sample_period ({self.utilization_sample_period}) must not exceed "
                f"utilization_window ({self.utilization_window})"
            )
        if self.stall_kill_after < self.stall_timeout:
            raise ValueError(
                f"stall_kill_after ({self.stall_kill_after:g}) must be at least stall_timeout "
                f"({self.stall_timeout:g}): an engine leaves the routers before it is killed"
            )
        return self


class MgmtTlsConfig(_Strict):
    """TLS of the gRPC management plane. With ca_file, clients must present a certificate it signed."""

    enable_tls: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def check_files(self, field: str) -> None:
        """ConfigError naming the field when TLS is on and a file is missing or unreadable."""
        if not self.enable_tls:
            return
        for name in ("cert_file", "key_file"):
            if not getattr(self, name):
                raise ConfigError(f"{field}.{name}: required when enable_tls is true")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{field}.{name}: cannot read {path!r}")

    def server_files(self) -> TlsFiles | None:
        """The engine server's side: its certificate; with ca_file, clients must present one."""
        if not self.enable_tls:
            return None
        return TlsFiles(cert=self.cert_file, key=self.key_file, ca=self.ca_file, require_client_cert=bool(self.ca_file))


class EngineSection(_Strict):
    """One role's section of the user_config."""

    engine_type: Literal["vllm", "sglang", "sim"]
    # The engine's own arguments (model path, parallel sizes, ...), checked by the engine class.
    engine_args: dict[str, Any] = Field(default_factory=dict)
    health_check_config: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    mgmt_tls_config: MgmtTlsConfig = Field(default_factory=MgmtTlsConfig)
    # Seconds SIGTERM (and Drain without a deadline) waits for in-flight requests.
    drain_timeout: float = Field(30.0, ge=0)
    # Let the engine send usage statistics home (vLLM's usage stats, anything honouring
    # DO_NOT_TRACK). Off: fleets are often air-gapped, and a call home there only waits and fails.
    usage_stats: bool = False
    # The model name requests for this engine carry: its deployment's `model`, written here by the
    # controller. The engine server reports INIT (then, once up, failed health checks) until the
    # engine's GET /v1/models lists it, so an engine serving another name is never available.
    deployment_model: str | None = Field(None, min_length=1)


# Sections of other components in a MindIE user_config: `motor_<name>_config`, name not `engine_*`.
OTHER_COMPONENT_SECTION = re.compile(r"motor_(?!engine_)\w+_config")


class UserConfig(_Strict):
    motor_engine_prefill_config: EngineSection | None = None
    motor_engine_decode_config: EngineSection | None = None
    motor_engine_union_config: EngineSection | None = None
    # Names of the other components' sections that were present and set aside.
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _set_aside_other_components(cls, data: Any, handler: Any) -> UserConfig:
        ignored: list[str] = []
        if isinstance(data, dict):
            ignored = sorted(k for k in data if isinstance(k, str) and OTHER_COMPONENT_SECTION.fullmatch(k))
            data = {k: v for k, v in data.items() if k not in ignored}
        config = handler(data)
        config._ignored = ignored
        return config

    @property
    def ignored_sections(self) -> list[str]:
        return list(self._ignored)

    def present(self) -> list[str]:
        return [name for name in SECTION_BY_ROLE.values() if getattr(self, name) is not None]

    def section_for(self, role: str) -> tuple[str, EngineSection | None]:
        """(section name, section) a role uses; the section is None when missing."""
        name = section_name_for(role, self.present())
        return name, getattr(self, name)
