"""The router of `motorctl up`: one vllm-router on loopback and its motor-router-sync (docs/router.md).

The router starts with no workers; the sync adds every engine Motor lists and keeps the list
true. Bound to 127.0.0.1, like the rest of a local cluster: its admin API (add/remove workers)
is reachable only from this machine. vllm-router 0.1.17's --api-key does not guard that API
(measured: an add without the key succeeds), so binding is the protection (docs/router.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request

ROUTER_PORT = 8080
# vllm-router renames its process with setproctitle, which by default writes over the environment
# too, and with it the run tag that `motorctl down` and the guardian find processes by:
# SPT_NOENV keeps the environment.
ROUTER_ENV = {"SPT_NOENV": "1"}
# The router's mode whose admin API takes a worker's model and type (vllm-router 0.1.17's
# --enable-igw), always: every engine is filed under its deployment's model (and each loaded
# adapter under its own name), so a request reaches only engines of the model it names, however
# many models the cluster serves. The front door in the sync's process (router_sync/front.py)
# listens on the published port and gives OpenAI's /v1/models, a 404 naming the served models for
# one that is not, and the one model to a request without `model`; the router listens on a
# private port of loopback. Prefill/decode (`--router-pd`): prefill and decode engines are typed
# workers, and each request goes to a prefill engine, then to a decode engine with the prefill's
# KV handoff; the sync runs with --pd.
TYPED_WORKER_FLAGS = ["--enable-igw"]


def router_binary() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return local if os.path.exists(local) else (shutil.which("vllm-router") or "vllm-router")


def router_command(port: int, metrics_port: int) -> list[str]:
    argv = [
        router_binary(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        # Its Prometheus exporter is on by default, on 29000: two routers on a machine clash.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        # An add waits for the worker's /health: Motor adds only engines that serve already.
        "--worker-startup-timeout-secs",
        "10",
        "--worker-startup-check-interval",
        "1",
        *TYPED_WORKER_FLAGS,
    ]
    return argv


def sync_command(
    controllers: list[str], router_url: str, front_door: str, tls: list[str], pd: bool = False
) -> list[str]:
    """The sync, serving the front door on `front_door` (HOST:PORT) in front of `router_url`."""
    return [
        sys.executable,
        "-m",
        "router_sync",
        "--controller",
        ",".join(controllers),
        "--router",
        router_url,
        "--front-door",
        front_door,
        *(["--pd"] if pd else []),
        *tls,
    ]


def router_workers(url: str, timeout: float = 2.0) -> list[str] | None:
    """The router's worker URLs (through the front door too), or None when it does not answer. An
    engine with loaded adapters is one worker per name it serves (router_sync/sync.py)."""
    try:
        with urllib.request.urlopen(url + "/list_workers", timeout=timeout) as reply:
            return list(json.loads(reply.read())["urls"])
    except (OSError, ValueError, KeyError, urllib.error.HTTPError):
        return None


def router_line(url: str) -> str:
    workers = router_workers(url)
    # one engine per address: an adapter's worker is the engine's address with a user part
    engines = None if workers is None else {w.split("://", 1)[-1].rpartition("@")[2] for w in workers}
    state = "not answering" if engines is None else f"{len(engines)} worker(s)"
    return f"Router (OpenAI API):  {url}/v1  ({state}; kept by motor-router-sync)"
