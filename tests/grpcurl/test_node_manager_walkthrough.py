"""docs/clients.md, node manager section: each documented grpcurl command against a real,
standalone node manager that launches real sim engine servers."""

from __future__ import annotations

import pytest

from motorctl.cluster_processes import stop_node_engines
from tests.support.grpcurl_services import start_node_manager
from tests.support.grpcurl_walkthrough import load_steps, run_step

STEPS = [step for step in load_steps() if step.section == "node"]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    service, address = start_node_manager(str(tmp_path_factory.mktemp("node")))
    try:
        yield {"node": address}
    finally:
        try:
            stop_node_engines(address)  # those a failed step left running
        finally:
            service.stop()


@pytest.mark.parametrize("step", STEPS, ids=[step.id for step in STEPS])
def test_documented_node_manager_command(node, step):
    run_step(step, node)
