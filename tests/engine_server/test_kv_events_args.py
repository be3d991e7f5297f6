"""--kv-events-port as the engine's own arguments: the simulated engine's kv_events_port, vLLM's
--kv-events-config (its port less the data-parallel rank, which vLLM adds back); other engines
refused, naming the setting."""

from __future__ import annotations

import pytest
import zmq

from engine_server.kv_events_args import with_kv_events
from motor.errors import ConfigError


def test_the_simulated_engine_publishes_on_the_port_given_over_its_own():
    assert with_kv_events("sim", {"model": "sim-tiny", "kv_events_port": 1}, 5600, 0) == {
        "model": "sim-tiny",
        "kv_events_port": 5600,
    }


def test_vllm_gets_its_zmq_publisher_on_the_port_less_its_rank():
    config = with_kv_events("vllm", {"model": "/m"}, 5600, 3)["kv_events_config"]
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5600"}
    ranked = with_kv_events("vllm", {"model": "/m", "data_parallel_size": 4}, 5600, 3)
    assert ranked["kv_events_config"]["endpoint"] == "tcp://*:5597"


def test_vllm_publishes_on_the_engine_servers_own_ipv4_address_alone():
    """vLLM binds only endpoints with `*` or `::` in them: an IPv4 host is given IPv4-mapped, which
    ZMQ binds on that address alone (checked with a real ZMQ socket here; a real vLLM engine's
    publisher in tests/vllm/test_vllm_kv_routing.py); other hosts keep `*`."""
    config = with_kv_events("vllm", {"model": "/m"}, 5600, 0, "127.0.0.1")["kv_events_config"]
    assert config["endpoint"] == "tcp://[::ffff:127.0.0.1]:5600"
    for host in ("0.0.0.0", "node-a", "::1"):
        assert with_kv_events("vllm", {"model": "/m"}, 5600, 0, host)["kv_events_config"]["endpoint"] == "tcp://*:5600"
    publisher = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = publisher.bind_to_random_port("tcp://[::ffff:127.0.0.1]")
        assert publisher.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"
    finally:
        publisher.close(linger=0)


def test_an_engine_that_publishes_none_is_refused():
    with pytest.raises(ConfigError, match="--kv-events-port: the sglang engine publishes no KV events"):
        with_kv_events("sglang", {}, 5600, 0)
