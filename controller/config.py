"""The controller's settings: command-line flags, optionally a YAML/JSON file (--config).

Flags given on the command line win over the file. Every error names the setting to change.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from controller.rules.deployment_checks import MAX_ENGINES_PER_DEPLOYMENT
from controller.rules.node_reports import MAX_ENGINES_PER_NODE
from controller.store.etcd_client import parse_etcd_url
from motor.errors import ConfigError
from motor.ports import CONTROLLER_METRICS_PORT
from motor.security.security_config import SecuritySettings
from motor.service.config import HostPort
from motor.service.event_loop import EventLoop
from motor.service.logs import LogFormat, LogLevel


class ControllerConfig(SecuritySettings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # "nan" fails every bound: say what is wrong

    # "host:port" the gRPC server binds; port 0 picks a free one (written to <db dir>/controller.port).
    listen: HostPort = "0.0.0.0:50051"
    # SQLite file holding the desired deployment, assignments, node generations, restart counters.
    db: str = "./.state/controller.db"
    # Deployment file applied at start-up when it differs from the stored one.
    deployment: str | None = None
    # Interval node managers are told to heartbeat at (seconds).
    heartbeat_interval: float = Field(1.0, ge=0.05, le=60)  # below, the node monitor spins (it wakes every interval/2)
    # Silence after which a node is suspect and re-checked directly (seconds), at the configured
    # interval; scaled with the announced interval (controller/fleet/heartbeat_budget.py).
    node_grace: float = Field(5.0, gt=0, le=3600)
    # Heartbeats a second the whole fleet may send: past heartbeat_interval x this many nodes the
    # announced interval grows (live nodes / this); 0: always heartbeat_interval.
    max_heartbeats_per_second: float = Field(2000.0, ge=0)
    # Deadline of the direct re-check of a suspect node (seconds).
    recheck_timeout: float = Field(1.0, gt=0, le=60)
    # Share of nodes silent at once above which the controller suspects its own network.
    silent_share_alarm: float = Field(0.5, gt=0, le=1)
    # Engine reschedules (moves off lost nodes) allowed per second; the burst is the same size.
    reschedule_rate: float = Field(10.0, gt=0)
    # Prometheus /metrics (and /discovery/engines) port; 0 turns the endpoint off.
    metrics_port: int = Field(CONTROLLER_METRICS_PORT, ge=0, le=65535)
    # Address /metrics and /discovery/engines listen on: plaintext HTTP, read-only (docs/security.md);
    # every address by default, for a Prometheus on another host; 127.0.0.1 keeps them on this one.
    metrics_host: str = "0.0.0.0"
    # After a restart, how long to wait for node managers to report before reconciling
    # (seconds); default: node_grace.
    startup_grace: float | None = Field(None, ge=0, le=3600)
    # Engines publish their KV cache events, each on a port its node manager picks, listed in
    # WatchEndpoints for a front door that routes by KV cache (docs/router.md, "KV routing").
    kv_events: bool = False
    # Time a node manager gets to stop an engine gracefully before SIGKILL (seconds).
    stop_deadline: float = Field(5.0, ge=0)
    log_level: LogLevel = "INFO"
    # The event loop: uvloop spent less CPU on a plaintext heartbeat than asyncio's own loop in
    # every paired run (docs/benchmarks.md, "Judged on a core of its own"); asyncio rules it out.
    event_loop: EventLoop = "uvloop"
    # An unreadable --db file is moved aside (<db>.unreadable-<time>) and the controller starts
    # empty; without it the controller stops with exit code 2.
    discard_unreadable_db: bool = False
    # text, or json: one JSON object per line with the ids and the reason (docs/observability.md).
    log_format: LogFormat = "text"
    # Engines (instances x data-parallel ranks) one deployment may ask for.
    max_engines_per_deployment: int = Field(MAX_ENGINES_PER_DEPLOYMENT, ge=1)
    # Engines one node may report (RegisterNode, a heartbeat): a node runs one engine per
    # accelerator or so, plus old copies being stopped; far beyond is a broken or hostile node.
    max_engines_per_node: int = Field(MAX_ENGINES_PER_NODE, ge=1)
    # Where the state lives: "sqlite:///path" (the default, the --db file) or
    # "etcd://host:port[,host:port...][/prefix]" with leader election among controllers (docs/ha.md).
    store: str | None = None
    # host:port other controllers, node managers and motorctl reach this controller on (etcd
    # store: shown to clients as the leader's address); default: the listen address, with
    # 0.0.0.0 replaced by this host's name.
    advertise: HostPort | None = None
    # Time to live of the leader's etcd lease (whole seconds): a dead leader is replaced after it.
    lease_ttl: int = Field(2, ge=1, le=60)
    # Deadline of each etcd call (seconds).
    etcd_timeout: float = Field(2.0, gt=0, le=60)
    # How long a change may wait for etcd to commit it before the call answers UNAVAILABLE (s).
    commit_timeout: float = Field(5.0, gt=0, le=300)
    # At start-up, how long etcd is read again (members still starting) before the controller
    # exits with an error naming the settings to check (s).
    etcd_startup_wait: float = Field(30.0, ge=0, le=3600)
    # TLS to etcd: the CA of the members' certificates; a client certificate and key for etcd's
    # --client-cert-auth.
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    # TLS to several etcd members: the name every member's certificate is valid for (one
    # channel walks them all, so one name is checked); default: the first endpoint's host.
    etcd_server_name: str | None = None

    @field_validator("node_grace")
    @classmethod
    def _check_node_grace(cls, value: float, info: ValidationInfo) -> float:
        # Within one interval every node would turn SUSPECT (and be re-checked) between two beats.
        interval = info.data.get("heartbeat_interval")
        if interval is not None and value <= interval:
            raise ValueError(
                f"must be more than heartbeat_interval ({interval:g}s): a few intervals, so that a "
                "node is suspected only after missed heartbeats"
            )
        return value

    @field_validator("max_heartbeats_per_second")
    @classmethod
    def _check_heartbeat_budget(cls, value: float) -> float:
        # Below one a second the announced interval grows past anything useful (1e-14 overflowed it).
        if 0 < value < 1:
            raise ValueError("must be 0 (off) or at least 1 (heartbeats a second for the whole fleet)")
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str | None) -> str | None:
        if value is None or value.startswith("sqlite:///"):
            return value
        if value.startswith("etcd://"):
            try:
                parse_etcd_url(value, setting="etcd address")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            return value
        raise ValueError("must be sqlite:///path or etcd://host:port[,host:port...][/prefix]")

    @property
    def uses_etcd(self) -> bool:
        return bool(self.store and self.store.startswith("etcd://"))

    @property
    def sqlite_path(self) -> str:
        return self.store[len("sqlite://") :] if self.store and self.store.startswith("sqlite:///") else self.db
