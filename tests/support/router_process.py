"""The real vllm-router (or SGLang's router) as a process and its fixtures, and a module fixture's body
for a local cluster started and stopped leaving nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from motor.ports import free_port
from motorctl.local_cluster import LocalCluster
from motorctl.router import ROUTER_ENV, ROUTING_POLICY
from tests.support import require, wait_for
from tests.support.local_cluster import started
from tests.support.open_load import http

# The routers Motor's sync is tested against: the vLLM project's, and SGLang's gateway (another
# admin API dialect: router_sync/admin.py). name -> (program, its first arguments).
ROUTERS = {"vllm-router": ["vllm-router"], "sglang-router": ["sglang-router", "launch"]}


def router_program(name: str) -> str:
    local = os.path.join(os.path.dirname(sys.executable), name)
    return local if os.access(local, os.X_OK) else (shutil.which(name) or name)


class RouterProcess:
    """One router (vllm-router unless `kind` names another of ROUTERS) on a free port of
    127.0.0.1, with no workers until told."""

    def __init__(self, log_dir, port: int | None = None, extra=(), kind: str = "vllm-router"):
        program = router_program(ROUTERS[kind][0])
        require(os.access(program, os.X_OK), f"{kind} (requirements/dev.txt)")
        self.kind, self.command = kind, [program, *ROUTERS[kind][1:]]
        self.gateway = kind == "sglang-router"  # lists and adds at /workers
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"router-{self.port}.log")
        self.extra = list(extra)
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> RouterProcess:
        argv = [
            *self.command,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.policy(),
            "--worker-startup-timeout-secs",
            "2",
            "--worker-startup-check-interval",
            "1",
            "--prometheus-port",
            str(free_port()),
            *self.extra,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, **ROUTER_ENV)
            )
        wait_for(self._answers, timeout=30, interval=0.1, what=f"{self.kind} on port {self.port}")
        return self

    def policy(self) -> list[str]:
        """Motor's routing policy in the mode Motor runs the router in (--enable-igw), so the
        front door's guarantees are tested under it. The plain mode, where the sync is tested
        against the router's other admin API, keeps round robin: vllm-router 0.1.17 refuses to
        start power_of_two there with fewer than 2 workers (measured)."""
        return ROUTING_POLICY if "--enable-igw" in self.extra else ["--policy", "round_robin"]

    def _answers(self) -> bool:
        assert self.process.poll() is None, (
            f"{self.kind} exited: {open(self.log_path, errors='replace').read()[-2000:]}"
        )
        try:
            return http("GET", self.url + ("/workers" if self.gateway else "/list_workers"), timeout=1)[0] == 200
        except OSError:
            return False

    def workers(self) -> set[str]:
        status, text = http("GET", self.url + ("/workers" if self.gateway else "/list_workers"))
        assert status == 200, text
        body = json.loads(text)
        return {w["url"] for w in body["workers"]} if self.gateway else set(body["urls"])

    def add(self, url: str) -> None:
        if self.gateway:
            status, text = http("POST", self.url + "/workers", {"url": url})
            assert status == 202, text
            wait_for(lambda: url in self.workers(), timeout=15, interval=0.1, what=f"{url} added")
        else:
            status, text = http("POST", f"{self.url}/add_worker?url={url}")
            assert status == 200, text

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def router(tmp_path):
    started = RouterProcess(str(tmp_path))
    yield started
    started.stop()


@pytest.fixture(params=sorted(ROUTERS))
def any_router(request, tmp_path):
    """Each router Motor's sync supports, in turn."""
    started = RouterProcess(str(tmp_path), kind=request.param)
    yield started
    started.stop()


def running(local):
    """A module fixture's body: the local cluster started, yielded, then stopped leaving nothing
    behind (nothing killed or left over; its front door, router and sync ended too)."""
    yield from started(local)
    for front in (p for p in local.processes if p.name in ("router", "router-sync", "front-door")):
        assert front.process.poll() is not None, f"{front.name} left running"


def routed_cluster(tmp_path_factory, name: str, **options):
    """A module fixture's body: `running` on a two-node local cluster with its router (and the
    router's sync and front door), heartbeats every second; `options` for the rest of LocalCluster."""
    local = LocalCluster(str(tmp_path_factory.mktemp(name)), nodes=2, heartbeat_interval=1.0, router_port=0, **options)
    yield from running(local)
