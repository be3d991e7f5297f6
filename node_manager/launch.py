"""Launching one engine server: its accelerators and ports taken, its config written, its command run.

The node manager (manager.py) decides when to launch and supervises what this starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid

from motor.clock import Clock
from motor.contract import start_refusals
from motor.contract.names import engine_id as make_engine_id
from motor.errors import FailedPrecondition
from motor.ports import PortAllocator
from motor.v1 import types_pb2
from node_manager import specs
from node_manager.config import NodeManagerConfig
from node_manager.engine import STARTING, EngineRecord, RecordStore, termination_path
from node_manager.process_identity import state_dir_id
from node_manager.process_ops import Launched, ProcessOps

logger = logging.getLogger(__name__)


def launch_engine(
    requested: types_pb2.EngineSpec,
    active: list[EngineRecord],
    config: NodeManagerConfig,
    engine_command: list[str],
    ports: PortAllocator,
    store: RecordStore,
    ops: ProcessOps,
    clock: Clock,
) -> tuple[EngineRecord, Launched]:
    """Allocate accelerators and ports, write the config, exec the engine server.

    `active`: the engines running on this node, whose accelerators and ports are taken;
    `engine_command`: the engine server command the spec's arguments are added to."""
    engine_id = make_engine_id(requested.instance_id, requested.dp_rank)
    busy = {a: r.engine_id for r in active for a in r.spec.accelerator_ids}
    taken = sorted(a for a in requested.accelerator_ids if a in busy)
    if taken:
        raise start_refusals.accelerators_held(taken, sorted({busy[a] for a in taken}))
    spec = types_pb2.EngineSpec()
    spec.CopyFrom(requested)
    spec.host = spec.host or config.host
    spec.master_dp_ip = spec.master_dp_ip or spec.host
    reserved: list[int] = []  # every port of the engine, released when it ends
    try:
        in_use = {p: r.engine_id for r in active for p in specs.ports_of(r.spec)}
        specs.reserve_ports(spec, in_use, ports, config.node_id, reserved)
        engine_dir = os.path.abspath(store.engine_dir(spec))
        if spec.config_json:
            spec.config_path = os.path.join(engine_dir, "user_config.json")
            with open(spec.config_path, "w", encoding="utf-8") as handle:
                handle.write(spec.config_json)
        else:
            spec.config_path = os.path.abspath(spec.config_path)
        log_path = specs.log_path(config, spec)
        message_path = termination_path(log_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(message_path)  # a previous copy's: must not be taken for this one's
        argv = specs.engine_argv(engine_command, spec, message_path)
        token = uuid.uuid4().hex
        try:
            # Run in the engine's own directory: files it writes relative to its working
            # directory (engine_server_log/, core dumps) stay with the engine's state.
            child = ops.launch(
                argv,
                log_path,
                specs.engine_env(
                    spec, dict(os.environ), config.node_id, state_dir_id(config.state_dir), config.accelerator_type
                ),
                token,
                engine_dir,
            )
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot launch the engine command {argv[0]!r} (--engine-command): {exc.strerror or exc}"
            ) from None
    except BaseException:
        for port in reserved:
            ports.release(port)
        raise
    now = clock.time()
    record = EngineRecord(
        spec=spec,
        requested=requested,
        log_path=log_path,
        token=token,
        state=STARTING,
        state_reason=f"launched pid {child.pid}",
        state_changed_at=now,
        started_at=now,
        pid=child.pid,
        pgid=child.pid,
        process_started=ops.create_time(child.pid),
        allocated_ports=reserved,
    )
    logger.info("engine %s: launched pid %d: %s (log %s)", engine_id, child.pid, " ".join(argv), log_path)
    return record, child
