"""`make run` sets up only what the simulated engine needs; a deployment that asks for vLLM where
it is missing is refused by `motorctl up` at once, saying how to install it."""

from __future__ import annotations

import importlib.util

from motorctl import up
from tests.support.controller_harness import EXAMPLE

VLLM_FILE = """name: tiny
model: tiny
instance_groups: [{name: u, role: union}]
engine_config:
  motor_engine_prefill_config: {engine_type: vllm, engine_args: {model: /models/tiny}}
"""


def test_a_vllm_deployment_without_vllm_installed_says_how_to_get_it(tmp_path, monkeypatch):
    path = tmp_path / "vllm.yaml"
    path.write_text(VLLM_FILE)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    message = up.vllm_missing(str(path))
    assert message and "engine_type vllm" in message and "`make setup`" in message
    assert up.vllm_missing(EXAMPLE) is None  # the simulated engine needs no vLLM
