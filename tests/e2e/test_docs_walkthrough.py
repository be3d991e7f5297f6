"""docs/local-cluster.md's "Things to try", run as written, line by line, against the cluster
`make run` starts (on free ports: MOTOR_CONTROLLER names its controller and the front door's
address stands for 127.0.0.1:8080, as `make run PORT=...` on a shared host): find an engine with
motorctl, kill it, inject a fault, follow the events, then the second model beside the first,
listed by the front door."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from motorctl.local_cluster import LocalCluster
from tests.support import REPO_ROOT, wait_for

pytestmark = pytest.mark.processes

DOC = os.path.join(REPO_ROOT, "docs", "local-cluster.md")
DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")


def walkthrough() -> list[str]:
    text = open(DOC).read()
    block = re.search(r"## Things to try.*?```sh\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


@pytest.fixture
def cluster(tmp_path):
    local = LocalCluster(
        str(tmp_path / "run"), nodes=2, deployment_path=DEPLOYMENT, engine_port_base=35000, router_port=0
    )
    try:
        local.start(timeout=90)
        yield local
    finally:
        local.stop()


def test_the_fault_and_second_model_walkthrough_runs_as_written(cluster):
    env = dict(
        os.environ,
        MOTOR_CONTROLLER=cluster.controller_address,
        PATH=os.path.join(REPO_ROOT, ".venv", "bin") + os.pathsep + os.environ["PATH"],
    )
    defined: list[str] = []  # the shell functions the block defines, for the lines after them

    def shell(line: str, timeout: float = 60) -> subprocess.CompletedProcess:
        script = "\n".join([*defined, line])
        return subprocess.run(
            ["bash", "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )

    def ready() -> bool:
        out = shell("motorctl instances").stdout
        return out.count(" READY ") >= 2 and out.count("RUNNING  NORMAL") >= 3

    wait_for(ready, timeout=120, interval=0.5, what="the example deployment serving")
    pid_before = None
    for line in walkthrough():
        command = line.split("  #")[0].strip().replace("127.0.0.1:8080", cluster.router_url.split("://")[-1])
        if re.match(r"\w+\(\) \{", command):
            defined.append(command)
            continue
        if "events --follow" in command:
            follow_until(env, defined, command, ["ENGINE_FAILED", "signal 9", "abnormal"])
            continue
        if command.startswith("kill -9"):
            pid_before = int(shell("pid_of decode-0").stdout)
        if "--model sim-small" in command:  # its engines start after the apply: ask again until they serve
            wait_for(lambda: "small-" in shell(command).stdout, timeout=90, interval=0.5, what=command)
            continue
        if command.endswith("/v1/models"):  # the sync files the new engines a moment after they serve
            wait_for(
                lambda: "sim-small" in (out := shell(command).stdout) and "sim-tiny" in out, timeout=30, what=command
            )
            continue
        result = shell(command)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        if "/sim/faults" in command:
            assert "fail_inference" in result.stdout, result.stdout
        if "instances --filter instance_id=decode-0" in command:
            assert "PID" in result.stdout and "decode-0/rank0" in result.stdout, result.stdout
        if command == "motorctl deployments":
            assert "local-sim" in result.stdout and "small-sim" in result.stdout, result.stdout
        if command.startswith("motorctl delete"):
            assert "deleted" in result.stdout
    assert pid_before is not None
    wait_for(
        lambda: shell("pid_of decode-0").stdout.strip() not in ("", "0", str(pid_before)),
        timeout=90,
        interval=0.5,
        what="decode-0 running again under a new pid",
    )


def follow_until(env: dict, defined: list[str], command: str, words: list[str], timeout: float = 120) -> None:
    """Run `events --follow` until every word has appeared (the kill, then the fault's failure)."""
    process = subprocess.Popen(
        ["bash", "-c", "\n".join([*defined, command])],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = ""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not all(word in seen for word in words):
            line = process.stdout.readline()
            if not line:
                break
            seen += line
    finally:
        os.killpg(process.pid, 9)
        process.wait(10)
    assert all(word in seen for word in words), seen[-3000:]
