"""The router of `motorctl up`: one vllm-router on loopback and its motor-router-sync (docs/router.md).

The router starts with no workers; the sync adds every engine Motor lists and keeps the list
true. Bound to 127.0.0.1, like the rest of a local cluster: its admin API (add/remove workers)
is reachable only from this machine; under --tls it also takes an API key, which only the sync
is given.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import urllib.error
import urllib.request

ROUTER_PORT = 8080


def router_binary() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return local if os.path.exists(local) else (shutil.which("vllm-router") or "vllm-router")


def router_command(port: int, api_key_file: str | None) -> list[str]:
    argv = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            # An add waits for the worker's /health: Motor adds only engines that serve already.
            "--worker-startup-timeout-secs", "10", "--worker-startup-check-interval", "1"]
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as handle:
            argv += ["--api-key", handle.read().strip()]
    return argv


def sync_command(controllers: list[str], router_url: str, api_key_file: str | None, tls: list[str]) -> list[str]:
    return [sys.executable, "-m", "router_sync", "--controller", ",".join(controllers), "--router", router_url,
            *(["--api-key-file", api_key_file] if api_key_file else []), *tls]


def write_api_key(path: str) -> str:
    """A fresh random key, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return path


def router_workers(url: str, api_key_file: str | None = None, timeout: float = 2.0) -> list[str] | None:
    """The router's worker URLs, or None when it does not answer."""
    headers = {}
    if api_key_file:
        with open(api_key_file, encoding="utf-8") as handle:
            headers["Authorization"] = f"Bearer {handle.read().strip()}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/list_workers", headers=headers), timeout=timeout) as reply:
            return list(json.loads(reply.read())["urls"])
    except (OSError, ValueError, KeyError, urllib.error.HTTPError):
        return None


def router_line(url: str, api_key_file: str | None = None) -> str:
    workers = router_workers(url, api_key_file)
    state = "not answering" if workers is None else f"{len(workers)} worker(s)"
    return f"Router (OpenAI API):  {url}/v1  ({state}; kept by motor-router-sync)"
