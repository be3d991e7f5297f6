"""The autoscaler's series on the controller's /metrics (docs/autoscaling.md#seeing-it), read at
scrape time from the autoscaler (controller/capacity/autoscaler.py)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from controller.capacity.autoscaler import Autoscaler
from motor.service.scraped import ScrapedCollector


class AutoscaleCollector(ScrapedCollector):
    """The autoscaler's series, read at scrape time (registered on the controller's registry)."""

    def __init__(self, scaler: Autoscaler):
        self.scaler = scaler

    def collect(self):
        desired = GaugeMetricFamily(
            "motor_controller_autoscale_desired_instances",
            "Serving instances an autoscaled group is set to (its deployment's count).",
            labels=["deployment", "group"],
        )
        load = GaugeMetricFamily(
            "motor_controller_autoscale_in_flight_per_engine",
            "Requests in flight per serving engine of an autoscaled group over the last window (the signal "
            "compared with target_in_flight).",
            labels=["deployment", "group"],
        )
        decisions = CounterMetricFamily(
            "motor_controller_autoscale_decisions",
            "Count changes an autoscaled group's autoscaler made, by direction. Many of both directions in an "
            "hour: the target or the delay does not suit the load.",
            labels=["deployment", "group", "direction"],
        )
        deployments = self.scaler.deployments.by_name
        for (name, group), scaler in sorted(self.scaler.scalers.items()):
            count = (
                next((g.count for g in deployments[name][0].instance_groups if g.name == group), 0)
                if name in deployments
                else 0
            )
            desired.add_metric([name, group], count)
            load.add_metric([name, group], scaler.per_engine)
        for (name, group, direction), n in sorted(self.scaler.decisions.items()):
            decisions.add_metric([name, group, direction], n)
        yield desired
        yield load
        yield decisions
