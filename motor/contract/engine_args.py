"""The engine_args of the engines Motor defines itself (the simulated engine, SGLang's launcher),
as pydantic models: the engine server reads a section with them at start-up, and the controller
checks a deployment with them at apply (controller/rules/engine_sections.py), so a typo is refused before
it becomes a revision. vLLM's arguments are vLLM's own (motor/contract/vllm_request_args.py)."""

from __future__ import annotations

import sys

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

VLLM_MAX_NUM_SEQS = 256  # vLLM's default --max-num-seqs, the simulated engine's too


class SimFaults(BaseModel):
    """Fault knobs; POST /sim/faults takes any subset of these keys."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    crash: bool = False
    crash_after_s: float | None = Field(None, gt=0)
    hang: bool = False
    hang_inference: bool = False
    fail_inference: bool = False
    latency_ms: float = Field(0.0, ge=0)
    utilization: float = Field(0.0, ge=0, le=100)


class SimArgs(BaseModel):
    """engine_args of the simulated engine."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str = "sim-tiny"
    # Base latency and utilization (the same knobs as in faults; faults win when both are set).
    latency_ms: float = Field(0.0, ge=0)
    utilization: float = Field(0.0, ge=0, le=100)
    # Prefill time per prompt token (words). One prefill runs at a time, as one batch holds a
    # real engine: a long prompt keeps later requests and probes waiting while its steps
    # (every SIM_STEP_S) show the engine making progress.
    prefill_ms_per_token: float = Field(0.0, ge=0)
    # A prefix cache of this many blocks of 16 tokens (0: none), least recently used evicted: the
    # prefill pays only for the prompt's tokens not cached (sim_prefix_cache.py).
    kv_cache_blocks: int = Field(0, ge=0)
    # Publish the cache's KV events (vLLM's ZMQ format) on this port (0: not published).
    kv_events_port: int = Field(0, ge=0, le=65535)
    # Seconds the simulated model takes to load: /health and completions answer 503 "loading"
    # meanwhile, so the engine server reports INIT, then NORMAL. `startup_delay_s` is its older name.
    load_s: float = Field(0.0, ge=0, validation_alias=AliasChoices("load_s", "startup_delay_s"))
    # Time to make each generated token: a stream sends a chunk per token as it is made, a whole
    # answer comes after all of them, the engine's progress moving with each token. 0: every
    # token at once (after latency_ms), as before.
    decode_ms_per_token: float = Field(0.0, ge=0)
    max_tokens_default: int = Field(16, ge=1)
    # Requests served at once (vLLM's --max-num-seqs); the rest wait (sim_capacity.py).
    max_num_seqs: int = Field(VLLM_MAX_NUM_SEQS, ge=1)
    faults: SimFaults = Field(default_factory=SimFaults)


class SglangArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model_path: str = Field(min_length=1)
    served_model_name: str | None = None
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    context_length: int | None = Field(None, ge=1)
    trust_remote_code: bool = False
    transfer_backend: str | None = None
    extra_args: list[str] = Field(default_factory=list)
    launcher: list[str] = Field(default_factory=lambda: [sys.executable, "-m", "sglang.launch_server"], min_length=1)
    # Seconds between SIGTERM and SIGKILL of the SGLang process group at shutdown.
    stop_timeout: float = Field(10.0, ge=0)
