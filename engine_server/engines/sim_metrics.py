"""The simulated engine's Prometheus series: its own (sim:*) and vLLM's request-level ones under
vLLM's names and labels, so that one dashboard and one set of alerts serve both engines."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Like vLLM's counters: real requests only (probes excluded).
SIM_REQUESTS = Counter("sim:request_success", "Completed simulated requests (probes excluded).", ["model"])
SIM_FAILED = Counter("sim:request_failure", "Simulated requests that failed (probes excluded).", ["model"])
SIM_PROMPT_TOKENS = Counter("sim:prompt_tokens", "Prompt tokens of simulated requests (probes excluded).", ["model"])
SIM_GENERATION_TOKENS = Counter(
    "sim:generation_tokens", "Generated tokens of simulated requests (probes excluded).", ["model"]
)
SIM_KV_LEGS = Counter(
    "sim:kv_transfer_legs",
    "Legs of the prefill/decode flow served (probes excluded): prefill computes, decode fetches the KV cache.",
    ["model", "leg"],
)
SIM_RUNNING = Gauge(
    "sim:num_requests_running",
    "Simulated requests in flight (probes excluded).",
    ["model"],
    multiprocess_mode="livesum",
)

# The request-level series of vLLM, under vLLM's names and labels (model_name, engine), so one
# dashboard and one set of alerts (deploy/) serve both engines. Probes are excluded from these, as
# the engine server's patch does for vLLM; running, waiting and KV-cache use are the capacity's
# (sim_capacity.py).
VLLM_LABELS = ["model_name", "engine"]
VLLM_TTFT = Histogram(
    "vllm:time_to_first_token_seconds",
    "Histogram of time to first token in seconds.",
    VLLM_LABELS,
    buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0],
)
VLLM_ITL = Histogram(
    "vllm:inter_token_latency_seconds",
    "Histogram of inter-token latency in seconds.",
    VLLM_LABELS,
    buckets=[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0],
)
VLLM_SUCCESS = Counter("vllm:request_success", "Count of successfully processed requests.",
                       [*VLLM_LABELS, "finished_reason"])  # fmt: skip
VLLM_PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", VLLM_LABELS)
VLLM_GENERATION_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.", VLLM_LABELS)


def count_success(model: str, vllm: tuple[str, str], prompt_tokens: int, generated: int, leg: str | None) -> None:
    """A client request answered whole (probes are not counted)."""
    SIM_REQUESTS.labels(model).inc()
    SIM_PROMPT_TOKENS.labels(model).inc(prompt_tokens)
    SIM_GENERATION_TOKENS.labels(model).inc(generated)
    VLLM_SUCCESS.labels(*vllm, "length").inc()
    VLLM_PROMPT_TOKENS.labels(*vllm).inc(prompt_tokens)
    VLLM_GENERATION_TOKENS.labels(*vllm).inc(generated)
    if leg:
        SIM_KV_LEGS.labels(model, leg).inc()
