"""/metrics listens where its service's metrics_host says; a listener beyond loopback (plaintext
HTTP: no TLS there) says so at start, naming the setting that keeps it on this host."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from controller.config import ControllerConfig
from motor.ports import free_port
from motor.service.metrics_http import ServiceTelemetry
from motorctl.local_cluster import LocalCluster
from node_manager.config import NodeManagerConfig


def serve_and_close(host: str) -> None:
    async def run() -> None:
        telemetry = ServiceTelemetry(CollectorRegistry())
        await telemetry.serve(host, free_port(), routes={"/discovery/engines": list})
        await telemetry.close()

    asyncio.run(run())


def test_a_metrics_listener_beyond_loopback_warns_that_it_is_plaintext(caplog):
    with caplog.at_level(logging.WARNING, logger="motor.service.metrics_http"):
        serve_and_close("127.0.0.1")
        assert not caplog.records
        serve_and_close("0.0.0.0")
    (record,) = caplog.records
    assert "plaintext HTTP" in record.getMessage() and "/discovery/engines" in record.getMessage()
    assert "metrics_host 127.0.0.1" in record.getMessage()


def test_both_services_take_metrics_host():
    assert ControllerConfig(metrics_host="127.0.0.1").metrics_host == "127.0.0.1"
    assert NodeManagerConfig(node_id="node-a", controller="127.0.0.1:1", metrics_host="127.0.0.1").metrics_host


def test_the_local_cluster_binds_metrics_on_loopback_unless_asked(tmp_path):
    assert LocalCluster(str(tmp_path))._metrics_args("controller", 0)[-2:] == ["--metrics-host", "127.0.0.1"]
    wide = LocalCluster(str(tmp_path), metrics_host="0.0.0.0")
    assert wide._metrics_args("node-a", 1)[-1] == "0.0.0.0"
    assert wide.metrics_urls()["node-a"].startswith("http://127.0.0.1:")
