"""Fixtures of the compose tests: the image (built once per session) and one running stack."""

from __future__ import annotations

import os
import sys
import time

import pytest

from motor.ports import free_port
from tests.support import require
from tests.support.compose_stack import (
    BASE_IMAGE,
    ETCD_IMAGE,
    PROJECT_PREFIX,
    PROMETHEUS_IMAGE,
    TEST_IMAGE,
    TIMINGS,
    ComposeStack,
    _remove_leftover_projects,
    _timed,
    compose_command,
    docker_engine_running,
)


@pytest.fixture(scope="session")
def compose() -> list[str]:
    require(docker_engine_running(), "a running docker engine (start one as root with scripts/docker-engine.sh)")
    command = compose_command()
    require(command is not None, "docker compose or docker-compose (scripts/docker-engine.sh installs docker-compose)")
    return command


@pytest.fixture(scope="session")
def motor_image(compose: list[str]) -> str:
    """Builds the base, Prometheus and etcd images (once per machine), the wheelhouse and the
    image, as a user does.

    MOTOR_TEST_IMAGE=<tag> tests an image built beforehand instead (no build)."""
    if PROMETHEUS_IMAGE == "motor-prometheus:bookworm":
        _timed(
            "prometheus image (debootstrap + import; 0 when present)",
            ["bash", "scripts/build-base-image.sh", PROMETHEUS_IMAGE],
            timeout=900,
            env=dict(os.environ, DEBIAN_PACKAGES="prometheus"),
        )
    if ETCD_IMAGE == "motor-etcd:bookworm":
        _timed(
            "etcd image (debootstrap + import; 0 when present)",
            ["bash", "scripts/build-base-image.sh", ETCD_IMAGE],
            timeout=900,
            env=dict(os.environ, DEBIAN_PACKAGES="etcd-server,etcd-client"),
        )
    if os.environ.get("MOTOR_TEST_IMAGE"):
        return os.environ["MOTOR_TEST_IMAGE"]
    if BASE_IMAGE == "motor-base:bookworm":
        _timed(
            "base image (debootstrap + import; 0 when present)",
            ["bash", "scripts/build-base-image.sh", BASE_IMAGE],
            timeout=900,
        )
    venv = os.path.dirname(os.path.dirname(sys.executable))
    _timed("wheelhouse", ["bash", "scripts/build-wheelhouse.sh"], timeout=600, env=dict(os.environ, VENV=venv))
    stack = ComposeStack(compose, f"{PROJECT_PREFIX}build", TEST_IMAGE, BASE_IMAGE, controller_port=0)
    # compose.yaml's build section (every service shares the image: building one builds it).
    _timed("image build (compose build)", [*compose, "build", "controller"], timeout=900, env=stack.env)
    return TEST_IMAGE


@pytest.fixture(scope="module")
def stack(compose: list[str], motor_image: str, tmp_path_factory):
    _remove_leftover_projects()
    stack = ComposeStack(
        compose,
        f"{PROJECT_PREFIX}{os.getpid()}",
        motor_image,
        BASE_IMAGE,
        controller_port=free_port(),
        prometheus_image=PROMETHEUS_IMAGE,
        prometheus_port=free_port(),
        etcd_image=ETCD_IMAGE,
        controller_b_port=free_port(),
        router_port=free_port(),
    )
    started = time.monotonic()
    rules: list[list[str]] = []
    try:
        up = stack.compose_run("up", "-d", "--no-build", timeout=300, check=False)
        assert up.returncode == 0, (
            f"compose up failed:\n{up.stdout}\n{up.stderr}\n{stack.health_report()}\n{stack.logs(60)}"
        )
        TIMINGS["compose up -d (containers started)"] = time.monotonic() - started
        rules = stack.isolate_networks()
        stack.fetch_pki(str(tmp_path_factory.mktemp("compose-pki")))
        yield stack
    finally:
        stack.remove_rules(rules)
        # Idempotent: the last test takes the stack down itself and checks what is left.
        stack.compose_run("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300, check=False)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.section("compose timings (seconds)")
        for name, seconds in TIMINGS.items():
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
