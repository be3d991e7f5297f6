"""The walkthrough in docs/clients.md covers every service's API, and its checker can fail."""

from __future__ import annotations

import re

import pytest

from motor.v1 import controller_pb2, engine_pb2, node_manager_pb2
from tests.support.grpcurl_walkthrough import DOC, Step, load_steps, run_step

SERVICES = {
    "engine": engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
    "node": node_manager_pb2.DESCRIPTOR.services_by_name["NodeManagerService"],
    "controller": controller_pb2.DESCRIPTOR.services_by_name["ControllerService"],
}


@pytest.mark.parametrize("section", list(SERVICES))
def test_each_service_section_covers_the_api(section):
    service = SERVICES[section]
    commands = [step.command for step in load_steps((DOC,)) if step.section == section]
    assert commands, f"docs/clients.md has no walkthrough for {section}"
    variable = "$" + {"engine": "ENGINE", "node": "NODE", "controller": "CONTROLLER"}[section]
    missing = []
    if not any(re.search(rf"grpcurl -plaintext \{variable} list$", c) for c in commands):
        missing.append("list (reflection)")
    if not any(f"describe {service.full_name}" in c for c in commands):
        missing.append(f"describe {service.full_name}")
    if not any("grpc.health.v1.Health/Check" in c for c in commands):
        missing.append("the health check")
    if not any("-proto motor/v1/" in c and variable in c for c in commands):
        missing.append("a call without reflection (-import-path proto -proto ...)")
    for method in service.methods:
        called = [c for c in commands if f"{service.full_name}/{method.name}" in c]
        if method.server_streaming:
            if not any("-max-time" in c for c in called):
                missing.append(f"the stream {method.name} (with -max-time)")
        elif not any(" -d " in c for c in called):
            missing.append(f"{method.name} with a JSON body (-d)")
    assert not missing, f"docs/clients.md, {section} walkthrough lacks: {', '.join(missing)}"


def test_the_checker_fails_on_output_that_differs_from_the_document():
    with pytest.raises(AssertionError, match="not found"):
        run_step(Step("engine", 1, "echo one; echo two", ["two", "one"]), {})
    with pytest.raises(AssertionError, match="the command failed"):
        run_step(Step("engine", 1, "echo 'ERROR' >&2; exit 3", []), {})
    with pytest.raises(AssertionError, match="expected the command to fail"):
        run_step(Step("engine", 1, "echo 'ERROR:'", ["ERROR:"]), {})
    assert "two" in run_step(Step("engine", 1, "echo one; echo two", ["one", "two"]), {})
