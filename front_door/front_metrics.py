"""The front door's own series (docs/observability.md): requests by model and status, the wait
before an answer begins, time to first token, streams cut and gone on with. The per-tenant series
are front_door/tenant_metrics.py's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "motor_front_door_requests",
            'Requests through the front door, by the model named ("" none, "?" not served) and HTTP status.',
            ["model", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "motor_front_door_response_start_seconds",
            "From a request's arrival to the router's response headers (the router's time included), by the model "
            "named: the wait a client sees before its answer begins.",
            ["model"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.first_token = Histogram(
            "motor_front_door_time_to_first_token_seconds",
            "From a streamed completion's arrival to its first event written to the client, by the model named: "
            "the time to first token as the client sees it (the router's and the engine's time, queueing and "
            "prefill included; the response headers come before it).",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "motor_front_door_requests_in_flight",
            "Requests being passed to the router now; one that keeps growing means the router or its engines answer "
            "slowly.",
            registry=self.registry,
        )
        self.router_errors = Counter(
            "motor_front_door_router_errors",
            "Requests the router did not answer (no connection, or the connection broke).",
            registry=self.registry,
        )
        self.streams_cut = Counter(
            "motor_front_door_streams_cut",
            "Streamed answers the router ended before their `data: [DONE]` (their engine died): each was ended "
            "with an OpenAI error event (front_door/streams.py), by the model named.",
            ["model"],
            registry=self.registry,
        )
        self.continuations = Counter(
            "motor_front_door_continuations",
            "Streamed answers cut by their engine and gone on with on another engine (front_door/continuation.py), "
            'by the model named and why: "broken" (the connection from the engine broke), "ended" (the answer ended '
            'before `data: [DONE]`), "engine_error" (the engine sent an error event of its own).',
            ["model", "reason"],
            registry=self.registry,
        )
        self.continuation_gap = Histogram(
            "motor_front_door_continuation_gap_seconds",
            "From a stream's cut to its continuation's first event written to the client, by the model named: "
            "the pause a client sees in a stream gone on with (another engine's prefill of the prompt and the "
            "tokens sent included).",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self._counted: dict[tuple[str, int], Counter] = {}  # label lookups are the costly part

    def count(self, model: str, status: int) -> None:
        child = self._counted.get((model, status))
        if child is None:
            child = self._counted[(model, status)] = self.requests.labels(model, str(status))
        child.inc()
