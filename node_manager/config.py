"""Node manager configuration: command-line flags and/or a YAML file, validated by pydantic.

Flags override the file; every error names the field to change (the CLI exits with 2).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from motor.contract.names import IdSetting
from motor.errors import ConfigError
from motor.leader import parse_addresses
from motor.ports import NODE_MANAGER_METRICS_PORT
from motor.security.security_config import SecuritySettings
from motor.service.config import AbsoluteCommand, HostPort, split_host_port
from motor.service.logs import LogFormat, LogLevel
from node_manager import accelerators as host_accelerators
from node_manager.engine_tls import engine_tls_paths
from node_manager.port_locks import DEFAULT_DIR as PORT_LOCK_DIR


class NodeManagerConfig(SecuritySettings):
    """Everything `motor-node-manager` can be told (same names as the flags, with '_'); the TLS
    settings (SecuritySettings) also secure the controller link and the engines it launches."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # "nan" fails every bound: say what is wrong

    node_id: IdSetting
    listen: HostPort = "0.0.0.0:50052"
    advertise_address: HostPort | None = None
    controller: str | None = None  # host:port, or several comma-separated (HA controllers)
    host: str = "127.0.0.1"
    accelerators: list[int] = Field(default_factory=list)
    # nvidia, ascend, cpu, sim; auto: this host's GPUs, else its CPU cores; gpu: this host's GPUs, and
    # an error when it has none (node_manager/accelerators.py)
    accelerator_type: str = "sim"
    port_range: str = "20000-29999"
    # Where node managers of this host hold a lock per port they hand out (node_manager/port_locks.py).
    port_lock_dir: str = PORT_LOCK_DIR
    state_dir: str = "./.state/node"
    log_dir: str | None = None
    heartbeat_interval: float = Field(1.0, ge=0.05, le=3600)  # below, status checks and beats spin
    # The longest heartbeat interval this node follows when the controller announces a longer
    # one (its heartbeat rate budget at a large fleet): beyond it, it heartbeats at this cap.
    max_heartbeat_interval: float = Field(30.0, gt=0, le=3600)
    abnormal_threshold: int = Field(5, ge=1, le=1000)
    startup_grace: float = Field(600.0, ge=0)
    stop_deadline: float = Field(10.0, ge=0)
    status_timeout: float = Field(1.0, gt=0)
    # Prometheus /metrics port; 0 turns it off. Node managers sharing a host need one each.
    metrics_port: int = Field(NODE_MANAGER_METRICS_PORT, ge=0, le=65535)
    # Address /metrics listens on: plaintext HTTP, read-only (docs/security.md); every address by
    # default, for a Prometheus on another host; 127.0.0.1 keeps it on this one.
    metrics_host: str = "0.0.0.0"
    engine_command: str = "engine_server"
    # SGLang's launcher for every sglang engine of this node (a wrapper, a container entry point);
    # None: `python -m sglang.launch_server`. Only this setting chooses it, never a request.
    sglang_launcher: AbsoluteCommand | None = None
    # Folders engines may read models (and other files named in a request) from; none by default.
    model_roots: list[str] = Field(default_factory=list)
    log_level: LogLevel = "INFO"
    # text, or json (its engines log the same way).
    log_format: LogFormat = "text"

    @field_validator("controller")
    @classmethod
    def _check_controllers(cls, value: str | None) -> str | None:
        if value is not None:
            parse_addresses(value, "controller")  # several, comma-separated: the HA controllers
        return value

    @field_validator("accelerators", mode="before")
    @classmethod
    def _split_accelerators(cls, value: Any) -> Any:
        if isinstance(value, str):
            items = [v.strip() for v in value.split(",") if v.strip()]
            if not all(v.isdigit() for v in items):
                raise ValueError("must be a comma-separated list of accelerator numbers (e.g. 0,1,2,3)")
            return [int(v) for v in items]
        if isinstance(value, int):
            return [value]
        return value

    @field_validator("accelerators")
    @classmethod
    def _check_accelerators(cls, value: list[int]) -> list[int]:
        if any(v < 0 for v in value):
            raise ValueError("accelerator numbers must be >= 0")
        if len(set(value)) != len(value):
            raise ValueError("accelerator numbers must be unique")
        return value

    @field_validator("port_range")
    @classmethod
    def _check_port_range(cls, value: str) -> str:
        match = re.fullmatch(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*", value)
        if not match or not 0 < int(match[1]) <= int(match[2]) <= 65535:
            raise ValueError("must be START-END within 1-65535 with START <= END (e.g. 20000-29999)")
        return value

    @field_validator("engine_command")
    @classmethod
    def _check_engine_command(cls, value: str) -> str:
        if not shlex.split(value):
            raise ValueError("must name the engine server command (e.g. engine_server)")
        return value

    @field_validator("model_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        return [v for v in value.split(",") if v] if isinstance(value, str) else value

    @field_validator("model_roots")
    @classmethod
    def _check_roots(cls, value: list[str]) -> list[str]:
        for root in value:
            if not os.path.isabs(root) or not os.path.isdir(root):
                raise ValueError(f"{root!r} is not an existing absolute folder")
        return value

    @model_validator(mode="after")
    def _resolve_auto_accelerators(self) -> NodeManagerConfig:
        """`auto`: the host's GPUs when it has any (type nvidia), else its CPU cores (type cpu);
        `gpu`: the host's GPUs, refused when it has none (a GPU node whose devices did not reach
        the node manager must not serve on its CPU cores instead); accelerators given explicitly
        are kept, only their type is chosen."""
        if self.accelerator_type in ("auto", "gpu"):
            kind = self.accelerator_type
            try:
                found = host_accelerators.detect(kind)
            except ConfigError as exc:
                raise ValueError(f"accelerator_type {kind}: {exc}") from None
            self.accelerator_type = found.type
            self.accelerators = self.accelerators or list(found.ids)
        return self

    @field_validator("max_heartbeat_interval")
    @classmethod
    def _check_max_interval(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value < interval:
            raise ValueError(f"must be at least heartbeat_interval ({interval:g}s)")
        return value

    @field_validator("status_timeout")
    @classmethod
    def _check_status_timeout(cls, value: float, info: ValidationInfo) -> float:
        # A status call longer than the interval would stretch the hang-detection bound.
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value > interval:
            raise ValueError(f"must not exceed heartbeat_interval ({interval:g}s)")
        return value

    # Derived values -------------------------------------------------------------------------

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    @property
    def port_range_bounds(self) -> tuple[int, int]:
        start, end = (int(v) for v in self.port_range.split("-"))
        return start, end

    @property
    def engines_dir(self) -> str:
        return os.path.join(self.state_dir, "engines")

    @property
    def logs_dir(self) -> str:
        return self.log_dir or os.path.join(self.state_dir, "logs")

    def engine_argv(self) -> list[str]:
        """The engine command as argv; a bare name is looked up on PATH, then next to this Python
        (a virtual environment's bin/ need not be on PATH). Engines serve with a copy of this
        node's TLS files and let only this node's manager drain, sleep or wake them, with this node manager's
        reflection and limits settings, and SGLang's launcher if one is set."""
        argv = shlex.split(self.engine_command)
        if os.sep not in argv[0] and shutil.which(argv[0]) is None:
            beside = os.path.join(os.path.dirname(sys.executable), argv[0])
            if os.access(beside, os.X_OK):
                argv[0] = beside
        if self.log_format != "text":
            argv += ["--log-format", self.log_format]
        argv += ["--owner-node", self.node_id]
        if self.tls_enabled:
            copy = engine_tls_paths(self.state_dir)  # the files this node manager uses (node_manager/engine_tls.py)
            argv += [
                "--tls-cert",
                copy["cert"],
                "--tls-key",
                copy["key"],
                "--tls-ca",
                copy["ca"],
                "--trust-domain",
                self.trust_domain,
            ]
        elif self.insecure:
            argv.append("--insecure")
        if not self.reflection:
            argv.append("--no-reflection")
        argv += [
            "--max-message-bytes",
            str(self.max_message_bytes),
            "--max-streams-per-caller",
            str(self.max_streams_per_caller),
        ]
        if self.sglang_launcher:
            argv += ["--sglang-launcher", self.sglang_launcher]
        return argv
