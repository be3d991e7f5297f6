"""The engine server's user_config JSON: typed, validated at start-up, errors naming the field.

Shape (one section per role; see examples/user_config.json):

    {
      "motor_engine_prefill_config": {"engine_type": "sim", "engine_args": {...},
                                      "health_check_config": {...}, "mgmt_tls_config": {...},
                                      "drain_timeout": 30},
      "motor_engine_decode_config": {...},
      "motor_engine_union_config": {...}      # optional: the union role falls back to prefill's
    }

Every model forbids unknown keys, so a typo is reported by name instead of silently ignored.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from motor import config as motor_config
from motor.errors import ConfigError
from motor.user_config import SECTION_BY_ROLE
from motor.user_config import section_name_for as _section_name_for

ENGINE_TYPES = ("vllm", "sglang", "sim")


class _Strict(BaseModel):
    # strict: "true" is not a bool and "5" is not a number; extra: typos are named.
    model_config = ConfigDict(extra="forbid", strict=True)


class HealthCheckConfig(_Strict):
    """Virtual inference (probing) and status settings. Defaults follow MindIE-PyMotor."""

    enable_virtual_inference: bool = False
    # Utilization (percent) below which the accelerator counts as idle: only then a failed probe
    # counts towards max_failure_count, and the interval returns to probe_interval.
    npu_usage_threshold: float = Field(3.0, gt=0, le=100)
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

    @model_validator(mode="after")
    def _coherent(self) -> "HealthCheckConfig":
        if self.npu_usage_threshold > self.busy_utilization:
            raise ValueError(
                f"npu_usage_threshold ({self.npu_usage_threshold}) must not exceed busy_utilization "
                f"({self.busy_utilization})"
            )
        if self.utilization_sample_period > self.utilization_window:
            raise ValueError(
                f"utilization_sample_period ({self.utilization_sample_period}) must not exceed "
                f"utilization_window ({self.utilization_window})"
            )
        return self


class MgmtTlsConfig(_Strict):
    """TLS of the gRPC management plane. With ca_file, clients must present a certificate it signed."""

    enable_tls: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None


class EngineSection(_Strict):
    """One role's section of the user_config."""

    engine_type: Literal["vllm", "sglang", "sim"]
    # The engine's own arguments (model path, parallel sizes, ...), checked by the engine class.
    engine_args: dict[str, Any] = Field(default_factory=dict)
    health_check_config: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    mgmt_tls_config: MgmtTlsConfig = Field(default_factory=MgmtTlsConfig)
    # Seconds SIGTERM (and Drain without a deadline) waits for in-flight requests.
    drain_timeout: float = Field(30.0, ge=0)


class UserConfig(_Strict):
    motor_engine_prefill_config: EngineSection | None = None
    motor_engine_decode_config: EngineSection | None = None
    motor_engine_union_config: EngineSection | None = None


def _check_tls_files(tls: MgmtTlsConfig, field: str) -> None:
    if not tls.enable_tls:
        return
    for name in ("cert_file", "key_file"):
        if not getattr(tls, name):
            raise ConfigError(f"{field}.{name}: required when enable_tls is true")
    for name in ("cert_file", "key_file", "ca_file"):
        path = getattr(tls, name)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{field}.{name}: cannot read {path!r}")


def section_name_for(role: str, config: UserConfig) -> str:
    """The section a role uses: its own; the union role falls back to the prefill section."""
    return _section_name_for(role, [name for name in SECTION_BY_ROLE.values() if getattr(config, name) is not None])


def load_section(path: str, role: str) -> tuple[str, EngineSection]:
    """Load and validate the whole file, then return (section name, section) for `role`.

    Raises ConfigError naming the field; engine_args are checked by the engine class."""
    from engine_server.engines import engine_class  # the engines import this module

    data = motor_config.read_document(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the user_config must be a JSON object with motor_engine_*_config sections")
    config = motor_config.validate(UserConfig, data, source=path)
    for name in SECTION_BY_ROLE.values():
        section = getattr(config, name)
        if section is not None:
            _check_tls_files(section.mgmt_tls_config, f"{name}.mgmt_tls_config")
    name = section_name_for(role, config)
    section = getattr(config, name)
    if section is None:
        hint = " (or motor_engine_prefill_config, which union falls back to)" if role == "union" else ""
        raise ConfigError(f"{path}: {name}: missing; the {role} role needs this section{hint}")
    section.engine_args = engine_class(section.engine_type).check_args(section.engine_args, f"{name}.engine_args")
    return name, section
