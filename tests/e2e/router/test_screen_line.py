"""What `motorctl up`'s screen says of its router: the URL to send requests to, and its workers."""

from __future__ import annotations

from motor.v1 import types_pb2
from motorctl.router import router_line
from tests.support.engine_server_process import engine_server, sim_config  # noqa: F401 (fixtures)
from tests.support.router_process import router  # noqa: F401 (fixtures)


def test_the_screen_line_names_the_url_and_counts_the_workers(router, engine_server):
    assert router_line(router.url) == (
        f"Router (OpenAI API):  {router.url}/v1  (0 worker(s); kept by motor-router-sync)"
    )
    engine = engine_server(sim_config("union"), role="union", instance_id="u-0")
    engine.wait_status(types_pb2.HEALTH_STATUS_NORMAL)
    router.add(f"http://127.0.0.1:{engine.port}")
    assert "(1 worker(s);" in router_line(router.url)
    router.stop()
    assert "(not answering;" in router_line(router.url)
