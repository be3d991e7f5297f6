"""The engine server judges its own engine, not whatever answers on its port (issue 61 #2): vLLM
binds its inference port only after loading its model, and another process listening there
meanwhile answered GET /health 200, so the engine was declared NORMAL 24 s before it served."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys

import pytest

from engine_server.engines.base import EngineBackend, EngineOptions
from engine_server.server import EngineServer
from engine_server.status import Health
from motor.contract.user_config import EngineSection, HealthCheckConfig
from motor.ports import free_port, port_is_free
from tests.support import wait_for

# Another process on the port, answering every GET 200 (HTTP/1.0: it closes after each answer).
FOREIGN = """
import http.server, sys
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Answer).serve_forever()
"""


class StillLoading(EngineBackend, engine_type="sim"):
    """An engine that has not bound its port yet (vLLM loading its model)."""

    async def start(self) -> None:
        pass

    async def wait_dead(self) -> str:
        await asyncio.Event().wait()
        return ""

    async def shutdown(self) -> None:
        pass


# Started detached (forked twice, its own session): another cluster's engine is no child of ours.
DETACHED = (
    """
import os, sys
child = os.fork()
if child:
    print(child, flush=True)
    sys.exit(0)
os.setsid()
quiet = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(quiet, fd)
"""
    + FOREIGN
)


@pytest.fixture
def foreign_port():
    port = free_port()
    launched = subprocess.run([sys.executable, "-c", DETACHED, str(port)], capture_output=True, text=True, timeout=30)
    pid = int(launched.stdout)
    try:
        wait_for(lambda: not port_is_free(port, "127.0.0.1"), timeout=30, what="the foreign server to listen")
        yield port
    finally:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.processes
async def test_a_health_answer_from_another_process_on_the_port_keeps_the_engine_init(foreign_port, caplog):
    caplog.set_level(logging.INFO, logger="engine_server.server")
    options = EngineOptions(role="union", instance_id="own", dp_rank=0, host="127.0.0.1", port=foreign_port,
                            master_dp_ip="127.0.0.1")  # fmt: skip
    section = EngineSection(engine_type="sim", health_check_config=HealthCheckConfig(health_poll_interval=0.05))
    server = EngineServer(options, section, StillLoading(options))
    await server.start()
    try:
        for _ in range(40):  # 2 s of polls
            await asyncio.sleep(0.05)
            assert server.machine.state is Health.INIT, server.machine.reason
    finally:
        await server.close(engine_timeout=1)
    said = [r.getMessage() for r in caplog.records if "engine not up yet" in r.getMessage()]
    assert said and f"GET /health on port {foreign_port} was answered by another process (pid" in said[-1], said
    assert "not this engine" in said[-1]
