"""The metrics every service shares (motor.service.metrics_http): gRPC calls per method and code, the
event-loop lag, and the /metrics endpoint itself, on a real gRPC server and a real HTTP port."""

from __future__ import annotations

import asyncio
import gzip
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from motor.errors import ConfigError, InvalidArgument
from motor.ports import free_port
from motor.service.grpc_server import MotorServer
from motor.service.metrics_http import GzipOffLoop, ServiceTelemetry, accepts_gzip


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_grpc_calls_are_counted_by_method_and_code():
    registry = CollectorRegistry()
    telemetry = ServiceTelemetry(registry)
    server = MotorServer("127.0.0.1:0", metrics=telemetry.grpc)

    class Failing(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):  # a domain error, mapped by the server's interceptor
            raise InvalidArgument("service: not a real service")

    # A second health service under another name, whose Check fails the way servicers fail.
    server.server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "test.Failing",
                {
                    "Check": grpc.unary_unary_rpc_method_handler(
                        Failing().Check,
                        health_pb2.HealthCheckRequest.FromString,
                        health_pb2.HealthCheckResponse.SerializeToString,
                    )
                },
            )
        ]
    )
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            failing = channel.unary_unary(
                "/test.Failing/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await failing(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # A server stream written with context.write (grpc's health Watch) still streams.
            watch = stub.Watch(health_pb2.HealthCheckRequest())
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        await server.stop(0)
    check = dict(grpc_type="unary", grpc_service="grpc.health.v1.Health", grpc_method="Check")
    assert sample(registry, "grpc_server_started_total", **check) == 2
    assert sample(registry, "grpc_server_handled_total", **check, grpc_code="OK") == 2
    assert sample(registry, "grpc_server_handling_seconds_count", **check) == 2
    failing_labels = dict(grpc_type="unary", grpc_service="test.Failing", grpc_method="Check")
    assert sample(registry, "grpc_server_handled_total", **failing_labels, grpc_code="INVALID_ARGUMENT") == 1
    watch = dict(grpc_type="server_stream", grpc_service="grpc.health.v1.Health", grpc_method="Watch")
    assert sample(registry, "grpc_server_started_total", **watch) == 1


async def test_a_blocked_loop_shows_as_lag_and_metrics_are_served():
    registry = CollectorRegistry()
    telemetry = ServiceTelemetry(registry)
    telemetry.loop_lag.interval = 0.05
    port = await telemetry.serve("127.0.0.1", free_port(), routes={"/discovery": lambda: [{"targets": ["a:1"]}]})
    try:
        await asyncio.sleep(0.2)
        time.sleep(0.4)  # blocking code on the loop, as a slow synchronous call would be
        await asyncio.sleep(0.2)
        slow = sample(registry, "motor_event_loop_lag_seconds_count") - sample(
            registry, "motor_event_loop_lag_seconds_bucket", le="0.25"
        )
        assert slow >= 1
        # A sleep on the loop is the service's own stall, not the host's: blocked too.
        blocked = sample(registry, "motor_event_loop_blocked_seconds_count") - sample(
            registry, "motor_event_loop_blocked_seconds_bucket", le="0.25"
        )
        assert blocked >= 1
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                assert response.status == 200
                names = {family.name for family in text_string_to_metric_families(await response.text())}
            async with session.get(f"http://127.0.0.1:{port}/discovery") as response:
                assert await response.json() == [{"targets": ["a:1"]}]
        assert {"motor_event_loop_lag_seconds", "grpc_server_handled"} <= names
    finally:
        await telemetry.close()


async def test_a_scrape_asking_for_named_series_gets_only_them_without_the_streamed_pieces():
    reads = []

    async def fleet_series():  # what the controller streams after its registry (per-engine series)
        reads.append(1)
        yield b'motor_controller_node_state{node_id="a",state="ready"} 1.0\n'

    registry = CollectorRegistry()
    telemetry = ServiceTelemetry(registry, fleet_series)
    port = await telemetry.serve("127.0.0.1", free_port())
    try:
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/metrics?name[]=motor_event_loop_lag_seconds_bucket"
            async with session.get(url) as response:
                text = await response.text()
            assert not reads, "the streamed per-node series were rendered for a scrape of the loop lag"
            names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
            assert names == {"motor_event_loop_lag_seconds_bucket"}
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                full = await response.text()
        assert reads == [1] and "motor_controller_node_state" in full and "motor_event_loop_blocked_seconds" in full
    finally:
        await telemetry.close()


async def test_a_scrape_asking_for_gzip_gets_the_same_exposition_compressed():
    """Prometheus asks for gzip: the controller's 40 MB of fleet series cross the network some 30
    times smaller, compressed off the loop; a scrape that does not ask gets plain text."""
    rows = [f'motor_controller_node_state{{node_id="node-{n:05d}",state="ready"}} 1\n'.encode() for n in range(60_000)]

    async def fleet_series():  # more than one batch of the compressor
        for begin in range(0, len(rows), 500):
            yield b"".join(rows[begin : begin + 500])

    telemetry = ServiceTelemetry(CollectorRegistry(), fleet_series)
    port = await telemetry.serve("127.0.0.1", free_port())
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.get(url, headers={"Accept-Encoding": "gzip"}) as response:
                assert response.headers["Content-Encoding"] == "gzip"
                packed = await response.read()
            async with session.get(url, headers={"Accept-Encoding": "identity"}) as response:
                assert "Content-Encoding" not in response.headers
                plain = await response.read()
    finally:
        await telemetry.close()
    assert len(plain) > 2 * GzipOffLoop.BATCH and b"".join(rows) in plain
    assert len(packed) < len(plain) / 10
    # The registry's series (the loop lag may have moved between the two scrapes), then the fleet's.
    text = gzip.decompress(packed)
    assert text.endswith(b"".join(rows)) and plain.endswith(b"".join(rows))
    assert {f.name for f in text_string_to_metric_families(text.decode())} == {
        f.name for f in text_string_to_metric_families(plain.decode())
    }


@pytest.mark.parametrize(
    "header, takes",
    [
        ("gzip", True),
        ("gzip, deflate", True),
        ("deflate, GZIP;q=0.5", True),
        ("*", True),
        ("", False),
        ("identity", False),
        ("deflate", False),
        ("gzip;q=0", False),
        ("gzip;q=0.0", False),
    ],
)
def test_accept_encoding_is_read_as_http_says(header, takes):
    assert accepts_gzip(header) is takes


async def test_a_taken_port_is_a_config_error_and_zero_turns_metrics_off():
    taken = ServiceTelemetry(CollectorRegistry())
    port = await taken.serve("127.0.0.1", free_port())
    try:
        other = ServiceTelemetry(CollectorRegistry())
        with pytest.raises(ConfigError, match="metrics_port"):
            await other.serve("127.0.0.1", port)
        await other.close()
        off = ServiceTelemetry(CollectorRegistry())
        assert await off.serve("127.0.0.1", 0) == 0
        await off.close()
    finally:
        await taken.close()


@pytest.mark.processes
def test_the_engine_server_cli_loads_no_prometheus_client_before_its_multiprocess_dir():
    """prometheus_client picks its storage at import: imported before the engine server sets
    PROMETHEUS_MULTIPROC_DIR, every engine's /metrics came back empty."""
    import subprocess
    import sys

    from tests.support import REPO_ROOT

    code = "import sys, engine_server.cli; sys.exit('prometheus_client' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": REPO_ROOT, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr or "engine_server.cli imported prometheus_client"


def test_the_time_a_thread_waited_for_a_cpu_is_readable_and_never_goes_back():
    from motor.service.loop_lag import cpu_wait

    before = cpu_wait()
    assert before is not None and before >= 0  # Linux with schedstat (every CI and dev machine here)
    assert cpu_wait() >= before
