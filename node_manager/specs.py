"""Engine specs: checking a StartEngine request, comparing a repeated one, the engine's command line.

Plain functions of the spec and the node's configuration: nothing here touches a process.
"""

from __future__ import annotations

import os

from motor.contract import start_refusals
from motor.contract.engine_policy import check_engine_config, parse_config_json, within
from motor.contract.names import ROLE_NAMES, check_instance_id, check_printable, excerpt, role_name
from motor.errors import FailedPrecondition, InvalidArgument
from motor.ports import PortAllocator, port_is_free
from motor.processes import CPUS_ENV, HOLDER_ENV, NODE_ENV
from motor.v1 import types_pb2
from node_manager.config import NodeManagerConfig

# Bounds that catch nonsense in a spec (a rank far outside anything real).
MAX_DP_RANK = 4095
# Fields a repeated StartEngine may leave unset and still ask for the running engine.
FILLED_IN_AT_LAUNCH = ("port", "mgmt_port", "kv_port", "dp_rpc_port", "kv_events_port", "host", "master_dp_ip")


def check_spec(spec: types_pb2.EngineSpec, config: NodeManagerConfig) -> None:
    """Everything that can be checked without touching the running engines' resources."""
    node_id = config.node_id
    check_instance_id(spec.instance_id, "spec.instance_id")
    for name in ("host", "master_dp_ip", "config_path"):
        check_printable(getattr(spec, name), f"spec.{name}")
    if spec.role not in ROLE_NAMES:
        raise InvalidArgument(f"spec.role {spec.role} is not a role: use ROLE_PREFILL, ROLE_DECODE or ROLE_UNION")
    if spec.dp_rank > MAX_DP_RANK:
        raise InvalidArgument(f"spec.dp_rank {spec.dp_rank} is out of range (0-{MAX_DP_RANK})")
    for name in ("port", "mgmt_port", "kv_port", "dp_rpc_port", "kv_events_port"):
        if getattr(spec, name) > 65535:
            raise InvalidArgument(f"spec.{name} {getattr(spec, name)} is not a TCP port (1-65535, or 0 to allocate)")
    if not spec.single_container and (spec.kv_port or spec.dp_rpc_port):
        raise InvalidArgument("spec.kv_port and spec.dp_rpc_port are only used with spec.single_container")
    if spec.kv_events_port and not spec.kv_events:
        raise InvalidArgument("spec.kv_events_port is only used with spec.kv_events")
    given = [p for p in port_fields(spec) if getattr(spec, p)]
    if len({getattr(spec, p) for p in given}) != len(given):
        raise InvalidArgument(f"spec ports must differ: {', '.join(f'{p}={getattr(spec, p)}' for p in given)}")
    if bool(spec.config_path) == bool(spec.config_json):
        raise InvalidArgument("spec: set exactly one of config_path (a file on the node) and config_json")
    if spec.config_json:
        parsed = parse_config_json(spec.config_json, "spec.config_json")
        check_engine_config(parsed, config.model_roots, "spec.config_json")
    elif not within(spec.config_path, [config.state_dir]):
        raise InvalidArgument(
            f"spec.config_path {spec.config_path!r}: a request may name only files under the node's state directory "
            f"({os.path.abspath(config.state_dir)}); send the configuration as spec.config_json"
        )
    elif not os.path.isfile(spec.config_path):
        raise FailedPrecondition(f"spec.config_path {spec.config_path!r}: no such file on node {node_id}")
    else:  # the file's content is held to config_json's rules (the state dir holds logs and records too)
        parsed = parse_config_json(read_config_file(spec.config_path, config.max_message_bytes), "spec.config_path")
        check_engine_config(parsed, config.model_roots, "spec.config_path")
    ids = list(spec.accelerator_ids)
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"spec.accelerator_ids {ids} lists an accelerator twice")
    missing = sorted(set(ids) - set(config.accelerators))
    if missing:
        raise FailedPrecondition(
            f"spec.accelerator_ids: accelerator(s) {missing} are not on node {node_id} "
            f"(it has {config.accelerators or 'none'})"
        )


def read_config_file(path: str, limit: int) -> str:
    """A config_path file's text, at most `limit` bytes (what a request's config_json may carry)."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise InvalidArgument(f"spec.config_path {excerpt(path)}: larger than {limit} bytes (max_message_bytes)")
    return data.decode("utf-8", errors="replace")


def port_fields(spec: types_pb2.EngineSpec) -> list[str]:
    """The port fields an engine of this spec uses (a KV-events publisher's too, when asked for)."""
    single = ["kv_port", "dp_rpc_port"] if spec.single_container else []
    return ["port", "mgmt_port", *single] + (["kv_events_port"] if spec.kv_events else [])


def ports_of(spec: types_pb2.EngineSpec) -> list[int]:
    return [p for p in (spec.port, spec.mgmt_port, spec.kv_port, spec.dp_rpc_port, spec.kv_events_port) if p]


def same_request(launched: types_pb2.EngineSpec, requested: types_pb2.EngineSpec) -> bool:
    """A repeated StartEngine asks for the running engine: unset ports, host and config match."""
    wanted = types_pb2.EngineSpec()
    wanted.CopyFrom(requested)
    for name in FILLED_IN_AT_LAUNCH:
        if not getattr(wanted, name):
            setattr(wanted, name, getattr(launched, name))
    if wanted.config_json and not wanted.config_path:
        wanted.config_path = launched.config_path
    elif wanted.config_path:
        wanted.config_path = os.path.abspath(wanted.config_path)
    return wanted == launched


def engine_argv(base: list[str], spec: types_pb2.EngineSpec, termination_path: str) -> list[str]:
    """The engine server's command line: `base` (--engine-command) and the spec as flags; the
    engine server writes its cause of exit to `termination_path` (motor.contract.termination)."""
    argv = [
        *base,
        "--dp-rank",
        str(spec.dp_rank),
        "--instance-id",
        spec.instance_id,
        "--role",
        role_name(spec.role),
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--mgmt-port",
        str(spec.mgmt_port),
        "--master-dp-ip",
        spec.master_dp_ip,
        "--config-path",
        spec.config_path,
        "--termination-message-path",
        termination_path,
    ]
    if spec.single_container:
        argv += ["--kv-port", str(spec.kv_port), "--dp-rpc-port", str(spec.dp_rpc_port)]
    if spec.kv_events:
        argv += ["--kv-events-port", str(spec.kv_events_port)]
    return argv


def engine_env(
    spec: types_pb2.EngineSpec, base: dict[str, str], node_id: str, holder: str = "", accelerator_type: str = ""
) -> dict[str, str]:
    """The engine's environment: `base` with its accelerators made visible and its node named
    (a node manager taking the node id over finds what a gone holder left on the host by it).
    On a `cpu` node the accelerators are CPU cores: the engine's process and its OpenMP threads are
    bound to its own, so that two vLLM CPU engines of one host (an old one serving, a new one
    loading) do not compete for the same cores."""
    env = dict(base)
    env[NODE_ENV] = node_id
    if holder:
        env[HOLDER_ENV] = holder
    visible = ",".join(str(a) for a in spec.accelerator_ids)
    if accelerator_type == "cpu":
        if visible:
            env[CPUS_ENV] = visible
            env["VLLM_CPU_OMP_THREADS_BIND"] = visible
        return env
    env["CUDA_VISIBLE_DEVICES"] = visible
    env["ASCEND_RT_VISIBLE_DEVICES"] = visible
    return env


def log_path(config: NodeManagerConfig, spec: types_pb2.EngineSpec) -> str:
    return os.path.abspath(os.path.join(config.logs_dir, "engines", f"{spec.instance_id}_rank{spec.dp_rank}.log"))


def reserve_ports(
    spec: types_pb2.EngineSpec, in_use: dict[int, str], allocator: PortAllocator, node_id: str, reserved: list[int]
) -> None:
    """Check the spec's given ports free (`in_use`: port -> engine id of the running engines), allocate
    the others; each one is appended to `reserved`, so the caller can release them if the launch fails."""
    for name in port_fields(spec):
        port = getattr(spec, name)
        if port:
            if port in in_use:
                raise start_refusals.port_held(name, port, in_use[port])
            if not port_is_free(port, spec.host):
                raise FailedPrecondition(f"spec.{name} {port} is already in use on {spec.host}")
            if not allocator.reserve(port):
                raise FailedPrecondition(
                    f"spec.{name} {port} is reserved by another node manager on this host (--port-lock-dir)"
                )
        else:
            try:
                port = allocator.allocate()
            except RuntimeError as exc:
                raise FailedPrecondition(f"spec.{name}: {exc} on node {node_id}") from None
            setattr(spec, name, port)
        reserved.append(port)
