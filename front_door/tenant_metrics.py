"""The front door's per-tenant series (docs/observability.md): counted in plain dicts as requests
pass (one dict update each: the door is one thread, and a prometheus_client child's locked
increment costs about ten times more) and exported when scraped. Their cardinality is bounded:
tenants come from the operator's key file, and those past the first MAX_TENANT_SERIES are
counted as "other"."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

MAX_TENANT_SERIES = 200
BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TenantSeries:
    def __init__(
        self,
        registry: CollectorRegistry,
        in_flight: Callable[[], dict[str, int]],
        keys: Callable[[], int],
        reload_failures: Callable[[], int],
    ) -> None:
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (tenant, code)
        self.tokens: dict[tuple[str, str], int] = defaultdict(int)  # (tenant, "prompt" | "completion")
        self.rejections: dict[tuple[str, str], int] = defaultdict(int)  # (tenant, reason)
        self.latency: dict[str, list[float]] = {}  # tenant -> a count per bucket (and +Inf), then the sum
        self.named: set[str] = set()
        self.in_flight, self.keys, self.reload_failures = in_flight, keys, reload_failures
        registry.register(self)

    def label(self, tenant: str) -> str:
        if tenant in self.named or not tenant:
            return tenant
        if len(self.named) >= MAX_TENANT_SERIES:
            return "other"
        self.named.add(tenant)
        return tenant

    def observe(self, tenant: str, seconds: float) -> None:
        counts = self.latency.get(tenant)
        if counts is None:
            counts = self.latency[tenant] = [0.0] * (len(BUCKETS) + 2)
        counts[bisect_left(BUCKETS, seconds)] += 1
        counts[-1] += seconds

    def collect(self):
        requests = counter_family(
            "motor_front_door_tenant_requests",
            "Requests of each tenant (its key found) by HTTP status; tenants past the first "
            f'{MAX_TENANT_SERIES} are counted as "other".',
            ["tenant", "code"],
            self.requests,
        )
        tokens = counter_family(
            "motor_front_door_tenant_tokens",
            'Tokens of each tenant\'s answers, "prompt" and "completion", as answered (front_door/usage.py).',
            ["tenant", "kind"],
            self.tokens,
        )
        rejections = counter_family(
            "motor_front_door_tenant_rejections",
            'Requests refused by the door\'s keys and limits: reason "no_key", "bad_key" (tenant ""), "model" (a '
            'model the tenant may not use), "requests", "tokens", "concurrency" (its limits: 429).',
            ["tenant", "reason"],
            self.rejections,
        )
        latency = HistogramMetricFamily(
            "motor_front_door_tenant_response_start_seconds",
            "From a tenant's request's arrival to the router's response headers.",
            labels=["tenant"],
        )
        for tenant, counts in self.latency.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts[:-1]):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([tenant], buckets, counts[-1])
        in_flight = GaugeMetricFamily(
            "motor_front_door_tenant_requests_in_flight",
            "Each tenant's requests being answered now (its concurrent_requests limit counts these).",
            labels=["tenant"],
        )
        for tenant, count in self.in_flight().items():
            in_flight.add_metric([self.label(tenant)], count)
        yield from (requests, tokens, rejections, latency, in_flight)
        yield GaugeMetricFamily(
            "motor_front_door_api_keys",
            "API keys the door has loaded now, from its key file (--api-keys).",
            value=self.keys(),
        )
        yield CounterMetricFamily(
            "motor_front_door_api_key_reload_failures",
            "Times the key file changed and did not load (the keys stayed as they were).",
            value=self.reload_failures(),
        )


def counter_family(name: str, documentation: str, labels: list[str], values: dict) -> CounterMetricFamily:
    """A counter family of `values` (label values -> count), as a scrape reads it."""
    family = CounterMetricFamily(name, documentation, labels=labels)
    for label_values, value in values.items():
        family.add_metric(label_values, value)
    return family
