"""The prefill/decode request flow of a disaggregating router, as vLLM's KV connectors serve it.

vllm-router in P/D mode sends each request twice: to a prefill engine with
`kv_transfer_params.do_remote_decode` true and `max_tokens` 1 (the engine computes the KV cache
and answers where it can be fetched), then to a decode engine with the prefill engine's answer
as `kv_transfer_params` (`do_remote_prefill` true: it fetches the KV cache instead of computing
it, and generates). The simulated engine plays both legs, so the whole P/D path runs without a
GPU: the prefill leg pays the prompt's prefill time, the decode leg does not.
"""

from __future__ import annotations

from typing import Any

PREFILL_LEG, DECODE_LEG = "prefill", "decode"
# What a decode leg needs to find the KV cache (vLLM's NixlConnector reads the same keys).
HANDOFF_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")


def leg(body: dict[str, Any]) -> str | None:
    """Which leg of the P/D flow a request is; None for a whole request (and the decode probe's
    `do_virtual`, which asks for neither)."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    if params.get("do_remote_decode") is True:
        return PREFILL_LEG
    if params.get("do_remote_prefill") is True:
        return DECODE_LEG
    return None


def missing_handoff(body: dict[str, Any]) -> str | None:
    """The error of a decode leg that does not say where its KV cache is, else None."""
    params = body["kv_transfer_params"]
    missing = [key for key in HANDOFF_KEYS if params.get(key) in (None, "", [])]
    if missing:
        return f"kv_transfer_params: a decode leg (do_remote_prefill) needs {', '.join(missing)} from its prefill leg"
    return None


def handoff(engine_id: str, host: str, port: int, prompt_tokens: int) -> dict[str, Any]:
    """The prefill leg's answer: where the decode engine fetches the KV cache of the prompt."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(range(max(1, -(-prompt_tokens // 16)))),  # 16-token blocks
        "remote_host": host,
        "remote_port": port,
    }
