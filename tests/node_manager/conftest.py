"""Fixtures: in-process node managers on 127.0.0.1:0, a recording fake controller, sim configs.

Every engine process a test starts is killed at the end (found by the tokens in the node
managers' engine records), whatever the test did.
"""

from __future__ import annotations

import os

import pytest

from motor.service.grpc_server import TlsFiles
from node_manager.config import NodeManagerConfig
from node_manager.server import NodeManagerServer
from tests.support import require
from tests.support.node_manager_harness import (
    ENGINE_SERVER,
    FakeController,
    Node,
    _port_slices,
    kill_engines_of,
    serve_controller,
)


@pytest.fixture
async def make_node(tmp_path):
    require(os.access(ENGINE_SERVER, os.X_OK), "engine_server console script (pip install -e .)")
    made: list[Node] = []
    state_dirs: list[str] = []

    async def make(node_id: str = "node-a", client_tls: TlsFiles | None = None, **overrides) -> Node:
        """`client_tls`: how the test calls the node manager when it serves mutual TLS."""
        first = 40000 + (os.getpid() % 200) * 100 + next(_port_slices) * 20 % 100
        values = dict(
            node_id=node_id,
            listen="127.0.0.1:0",
            host="127.0.0.1",
            accelerators=[0, 1, 2, 3],
            port_range=f"{first}-{first + 19}",
            state_dir=str(tmp_path / node_id),
            heartbeat_interval=0.3,
            status_timeout=0.3,
            abnormal_threshold=3,
            startup_grace=60,
            stop_deadline=5,
            engine_command=ENGINE_SERVER,
            metrics_port=0,  # tests run side by side: a test that scrapes passes a free port
        )
        values.update(overrides)
        server = NodeManagerServer(NodeManagerConfig(**values))
        await server.start()
        node = Node(server, client_tls)
        made.append(node)
        state_dirs.append(values["state_dir"])
        return node

    yield make
    for node in made:
        await node.channel.close()
        await node.server.stop()
    for state_dir in state_dirs:
        kill_engines_of(state_dir)


@pytest.fixture
async def fake_controller():
    controller = FakeController()
    controller.server, controller.address = await serve_controller(controller)
    yield controller
    await controller.server.stop(grace=0)
