"""`motorctl instances` names each engine's process (its pid, as its node reports it) and its URL:
what a walkthrough needs to kill an engine of this cluster, without pgrep and fixed ports."""

from __future__ import annotations

import json
import urllib.request

import psutil
import pytest

from tests.support import wait_for
from tests.support.controller_process import motorctl
from tests.support.process_cluster import apply, make_cluster, sim_deployment  # noqa: F401 (fixtures)

pytestmark = pytest.mark.processes


def test_engines_in_json_and_the_table_carry_the_pid_of_their_engine_server(make_cluster):  # noqa: F811
    cluster = make_cluster(nodes=1)
    apply(cluster, sim_deployment(dp=2))
    wait_for(lambda: cluster.all_ready(1), timeout=60, interval=0.2, what="instance READY")
    reply = json.loads(motorctl(cluster.controller_address, "-o", "json", "instances").stdout)
    engines = reply["instances"][0]["engines"]
    assert len(engines) == 2
    for engine in engines:
        process = psutil.Process(engine["pid"])
        command = " ".join(process.cmdline())
        assert "engine_server" in command and engine["engine_id"].split("/")[0] in command, command
        with urllib.request.urlopen(f"http://{engine['host']}:{engine['port']}/health", timeout=10) as answer:
            assert answer.status == 200
    table = motorctl(cluster.controller_address, "instances").stdout
    assert "PID" in table and str(engines[0]["pid"]) in table
