"""docs/router.md's second-model walkthrough, run as written (the ports made free ones: tests run
side by side): `motorctl up` with no router flag, `motorctl apply -f examples/second-model.yaml`,
then requests through the front door by model, OpenAI's model list, a request without `model`,
and `motorctl delete`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from motor.ports import free_port
from tests.support import REPO_ROOT, wait_for
from tests.support.motorctl_up import assert_nothing_left, motorctl_up_argv, start_motorctl_up
from tests.support.open_load import http


def motorctl(*args: str, controller: int) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "motorctl.cli", "--controller", f"127.0.0.1:{controller}", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def models(door: str) -> list[str] | None:
    try:
        status, text = http("GET", door + "/v1/models", timeout=3)
    except OSError:
        return None
    return [m["id"] for m in json.loads(text)["data"]] if status == 200 else None


def complete(door: str, body: dict) -> tuple[int, dict]:
    status, text = http("POST", door + "/v1/completions", body)
    return status, json.loads(text)


def test_the_second_model_walkthrough_runs_as_written(tmp_path):
    controller, router = free_port(), free_port()
    door = f"http://127.0.0.1:{router}"
    up = start_motorctl_up(
        motorctl_up_argv(
            tmp_path / "run",
            *("--controller-port", str(controller), "--router-port", str(router), "--metrics-port", str(free_port())),
            deployment="examples/local-deployment.yaml",
            nodes=2,
        )
    )
    try:
        wait_for(lambda: models(door) == ["sim-tiny"], timeout=120, interval=0.3, what="sim-tiny through the door")
        # one model served: a request without `model` is served by it, as by a single engine
        status, answer = complete(door, {"prompt": "hi", "max_tokens": 4})
        assert (status, answer.get("model")) == (200, "sim-tiny"), answer

        assert "applied" in motorctl("apply", "-f", "examples/second-model.yaml", controller=controller)
        wait_for(lambda: models(door) == ["sim-small", "sim-tiny"], timeout=120, interval=0.3, what="both models")
        for model in ("sim-small", "sim-tiny") * 6:  # never another model's engine (it would answer 404)
            status, answer = complete(door, {"model": model, "prompt": "hi", "max_tokens": 4})
            assert (status, answer.get("model")) == (200, model), answer
        status, answer = complete(door, {"prompt": "hi", "max_tokens": 4})
        assert status == 400 and "sim-small, sim-tiny" in answer["error"]["message"]

        motorctl("delete", "small-sim", controller=controller)
        wait_for(lambda: models(door) == ["sim-tiny"], timeout=60, interval=0.3, what="sim-small gone from the list")
        status, answer = complete(door, {"model": "sim-small", "prompt": "hi"})
        assert status == 404 and answer["error"]["message"].endswith("Valid aliases: sim-tiny.")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
            deadline = time.monotonic() + 60
            while up.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        assert_nothing_left(tmp_path / "run")
