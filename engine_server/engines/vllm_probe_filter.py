"""Keep virtual-inference probes out of every `vllm:*` metric.

The engine server probes the engine with real completions (`X-Request-Id: {ts}-{token}_virtual`,
the token a secret of this engine server: engines.base.is_probe_request_id); an operator's
dashboards must not see them, and a client cannot hide its own requests by picking such an id. vLLM counts requests in
three places, all patched here:

API-server process (this process), `vllm.v1.engine.output_processor.OutputProcessor`:
  - `_update_stats_from_output`: per-iteration counters (prompt and generation tokens, prompt
    tokens by source, time to first token, inter-token latency, preemptions);
  - `_update_stats_from_finished`: per-request series (request_success, e2e / queue / prefill /
    decode / inference time, request prompt/generation tokens, max_tokens and n params).
  For a probe both get a throw-away `IterationStats`, so the probe's own bookkeeping (its
  RequestStateStats, LoRA tracking) runs exactly as before while nothing reaches the shared one.
  The first also counts the tokens of client requests: the engine core's progress, which is the
  CPU build's utilization figure (vllm_utilization).
  `StatLoggerManager.record` then drops an iteration's stats when only probes produced output in
  it, so `vllm:iteration_tokens_total` gets no empty observation from a probe-only step; every
  other step it records (one per engine-core step, with or without output: a prefill chunk
  too) is counted as progress.

Engine-core process, `vllm.v1.core.kv_cache_manager.KVCacheManager.record_prefix_cache_stats`:
  prefix-cache queries and hits (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`,
  `vllm:prompt_tokens_cached_by_source`); applied in the child by `vllm_engine_core`.

Gauges of what is running now (`num_requests_running`, `kv_cache_usage_perc`) do include a probe
while it runs: they describe the engine's load, which a probe is part of.

Every patch checks that the method it wraps exists with the expected parameters and raises
`VllmPatchError` at start-up otherwise (a vLLM upgrade moved it): a silent miss would let probes
leak into the metrics unnoticed.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from engine_server.engines.base import is_probe_request_id
from engine_server.engines.vllm_utilization import PROGRESS

logger = logging.getLogger(__name__)

# Marks set on the shared IterationStats of one output batch.
_REAL_SEEN = "_motor_real_output_seen"
_PROBE_SEEN = "_motor_probe_output_seen"
_PATCHED = "_motor_probe_filter"


class VllmPatchError(RuntimeError):
    """The installed vLLM does not have a method the probe filter patches."""


def is_probe_external_id(external_req_id: str | None) -> bool:
    """True for the external request id of one of our probes (`cmpl-{probe id}-0`, `{probe id}`)."""
    return is_probe_request_id(external_req_id)


def is_probe_internal_id(request_id: str | None) -> bool:
    """True for an engine-core request id: the external id plus `-<random suffix>`."""
    if not request_id:
        return False
    external, _, _suffix = request_id.rpartition("-")
    return is_probe_external_id(external)


def _check(owner: type, name: str, params: list[str]) -> Callable[..., Any]:
    method = owner.__dict__.get(name)
    where = f"{owner.__module__}.{owner.__qualname__}.{name}"
    if method is None or not callable(method):
        raise VllmPatchError(
            f"{where} is missing in the installed vLLM: the probe filter cannot keep probes out "
            "of the vllm:* metrics (this engine server supports vLLM 0.32)"
        )
    if getattr(method, _PATCHED, False):
        return method
    actual = list(inspect.signature(method).parameters)
    if actual[: len(params)] != params:
        raise VllmPatchError(
            f"{where} has parameters {actual}, expected {params}: the installed vLLM changed it, "
            "and the probe filter would count probes (this engine server supports vLLM 0.32)"
        )
    return method


def _mark(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    setattr(wrapper, _PATCHED, True)
    return wrapper


def install_api_server_patches() -> None:
    """Patch the output processor and the stat-logger manager of this process (idempotent)."""
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats

    update_from_output = _check(
        OutputProcessor,
        "_update_stats_from_output",
        ["self", "req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats"],
    )
    update_from_finished = _check(
        OutputProcessor, "_update_stats_from_finished", ["self", "req_state", "finish_reason", "iteration_stats"]
    )
    record = _check(StatLoggerManager, "record", ["self", "scheduler_stats", "iteration_stats"])
    if all(getattr(m, _PATCHED, False) for m in (update_from_output, update_from_finished, record)):
        return

    @functools.wraps(update_from_output)
    def _update_stats_from_output(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats):
        probe = is_probe_external_id(req_state.external_req_id)
        if not probe:
            PROGRESS.add(len(engine_core_output.new_token_ids or ()) or 1)
        if iteration_stats is not None:
            if probe:
                setattr(iteration_stats, _PROBE_SEEN, True)
                iteration_stats = IterationStats()
            else:
                setattr(iteration_stats, _REAL_SEEN, True)
        return update_from_output(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats)

    @functools.wraps(update_from_finished)
    def _update_stats_from_finished(self, req_state, finish_reason, iteration_stats):
        if iteration_stats is not None and is_probe_external_id(req_state.external_req_id):
            iteration_stats = IterationStats()
        return update_from_finished(self, req_state, finish_reason, iteration_stats)

    @functools.wraps(record)
    def _record(self, scheduler_stats, iteration_stats, *args, **kwargs):
        # A step in which only probes produced output: its stats are empty after the filter,
        # but recording them would still add an observation to the per-step histograms.
        if (
            iteration_stats is not None
            and getattr(iteration_stats, _PROBE_SEEN, False)
            and not getattr(iteration_stats, _REAL_SEEN, False)
        ):
            iteration_stats = None
        elif scheduler_stats is not None:
            PROGRESS.step()
        return record(self, scheduler_stats, iteration_stats, *args, **kwargs)

    OutputProcessor._update_stats_from_output = _mark(_update_stats_from_output)
    OutputProcessor._update_stats_from_finished = _mark(_update_stats_from_finished)
    StatLoggerManager.record = _mark(_record)
    logger.info("vLLM probe filter installed in the API server (this engine server's probe ids only)")


def install_engine_core_patches() -> None:
    """Patch the prefix-cache statistics of the engine-core process (idempotent)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    record = _check(KVCacheManager, "record_prefix_cache_stats", ["self", "request", "num_hits"])
    if getattr(record, _PATCHED, False):
        return

    @functools.wraps(record)
    def record_prefix_cache_stats(self, request, num_hits):
        if is_probe_internal_id(getattr(request, "request_id", None)):
            return None
        return record(self, request, num_hits)

    KVCacheManager.record_prefix_cache_stats = _mark(record_prefix_cache_stats)
    logger.info("vLLM probe filter installed in the engine core")


def check_engine_core_patches() -> None:
    """Fail in the parent, before spawning, when the engine-core seam is missing."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    _check(KVCacheManager, "record_prefix_cache_stats", ["self", "request", "num_hits"])
