"""The base of Motor's Prometheus collectors whose series are read when scraped (counts by state,
per-router and per-group figures) rather than kept up to date as they change."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric


class ScrapedCollector:
    """A collector read at scrape time: a subclass's `collect()` yields its metric families.

    `describe()` names nothing: registering it reads nothing (a registry that auto-describes
    would otherwise collect once to learn the names), and its series may vary between scrapes."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError
