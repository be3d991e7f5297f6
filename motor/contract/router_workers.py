"""How an engine is spelled among a router's workers: the contract between motor-router-sync
(which files engines in the router) and the controller (which reads the router's worker list in
the sync's reports, controller/routing/door_reports.py)."""

from __future__ import annotations

from urllib.parse import quote


def adapter_worker_url(url: str, adapter: str) -> str:
    """The router worker URL an engine is filed under for one of its LoRA adapters. vllm-router
    0.1.17 keeps one model per worker URL (a second add of a URL replaces its model), so each
    adapter gets its own spelling of the engine's address: the adapter's name as the URL's user
    (`http://sql-lora@10.0.0.5:8000`). The router keys workers by that string and connects to the
    same host and port (docs/router.md: the engine also receives a Basic Authorization header
    naming the adapter, which an engine without an API key ignores)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{quote(adapter, safe='')}@{rest}"
