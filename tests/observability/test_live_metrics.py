"""Every service's /metrics in a live `make run`-style cluster (motorctl.local_cluster.LocalCluster: a
controller, two node managers, sim engine servers): `promtool check metrics` finds nothing to say
about any Motor series, and every metric the shipped dashboard and alert rules query exists. The
cluster logs in JSON (--log-format json): every line of every service is one JSON object."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from motorctl.door_access import DoorAccess
from tests.support import REPO_ROOT, require, wait_for
from tests.support.keyed_door import key_file
from tests.support.local_cluster import example_cluster, started

pytestmark = [pytest.mark.processes, pytest.mark.slow]

KEY = {"acme": "sk-motor-live-metrics-0123456789"}
DEPLOYMENT = os.path.join(REPO_ROOT, "examples", "local-deployment.yaml")
DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana", "motor.json")
RULE_FILES = sorted(glob.glob(os.path.join(REPO_ROOT, "deploy", "prometheus", "*.yaml")))
# Our series: Motor's own and the gRPC server series every service exports (vLLM's are not ours).
OURS = re.compile(r"^(motor_|grpc_server_)")
# Metric names in PromQL: identifiers that are neither functions, keywords nor label names; vLLM's
# request series too (the simulated engine exports them under vLLM's names).
METRIC_IN_QUERY = re.compile(r"(?<!\")\b((?:motor|grpc_server|vllm:)[a-z0-9_:]*)\b(?!\s*(?:=~|!~|!=|=(?!=)|\())")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = example_cluster(
        tmp_path_factory,
        "cluster",
        engine_port_base=33000,
        extra_controller_args=["--log-format", "json"],
        extra_node_args=["--log-format", "json"],
        router_port=0,  # a router and its sync: the controller's motor_front_door_* series
        # API keys at the door: its per-tenant series (then on its private table port)
        door_access=DoorAccess(api_keys=key_file(tmp_path_factory.mktemp("keys") / "keys.yaml", {"acme": {}}, KEY)),
    )
    yield from started(local)


@pytest.fixture(scope="module")
def scraped(cluster) -> dict[str, str]:
    """Target name -> its /metrics text, once every engine is NORMAL and has probed."""
    assert set(cluster.metrics_urls()) == {"controller", "node-a", "node-b", "router", "front-door"}

    def engine_bodies():
        """Every NORMAL engine's /metrics once all three have probed (asked again each time: an
        engine restarted meanwhile has a new address)."""
        with grpc.insecure_channel(cluster.controller_address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            found = stub.ListEndpoints(controller_pb2.ListEndpointsRequest(role=types_pb2.ROLE_UNSPECIFIED), timeout=5)
        bodies = {e.engine_id: _get(f"{e.url}/metrics") for e in found.endpoints}
        probed = len(bodies) == 3 and all(
            "motor_engine_server_probe_latency_seconds_count" in b for b in bodies.values()
        )
        return bodies if probed else None

    bodies = wait_for(engine_bodies, 180, 0.5, "three NORMAL engines that have probed")
    controller = cluster.metrics_urls()["controller"]
    wait_for(lambda: "motor_front_door_up{" in _get(controller), 30, 0.2, "the router's sync reporting")
    # One completion through the front door: its per-model series have a line once a model was asked for.
    completion = json.dumps({"model": "sim-tiny", "prompt": "hi", "max_tokens": 2}).encode()
    keyed = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY['acme']}"}
    asked = urllib.request.Request(f"{cluster.router_url}/v1/completions", completion, keyed)
    wait_for(lambda: urllib.request.urlopen(asked, timeout=10).status == 200, 30, 0.5, "a completion through the door")
    # And one streamed: the time to first token the client sees is measured on streams.
    streamed = json.dumps({"model": "sim-tiny", "prompt": "hi", "max_tokens": 2, "stream": True}).encode()
    with urllib.request.urlopen(
        urllib.request.Request(f"{cluster.router_url}/v1/completions", streamed, keyed),
        timeout=10,
    ) as answer:
        assert answer.read().rstrip().endswith(b"data: [DONE]")
    with pytest.raises(urllib.error.HTTPError, match="401"):  # a refusal: the rejections' series
        urllib.request.urlopen(urllib.request.Request(f"{cluster.router_url}/v1/models"), timeout=10)
    urls = dict(cluster.metrics_urls())
    _get(urls.pop("router"))  # vllm-router's own /metrics answers; its series are the router's, not Motor's
    bodies.update({name: _get(url) for name, url in urls.items()})
    return bodies


def _ours(text: str) -> str:
    """The exposition of our families only, HELP and TYPE lines included."""
    keep = []
    for line in text.splitlines():
        name = (
            line.split()[2]
            if line.startswith("# ") and len(line.split()) > 2
            else re.split(r"[{ ]", line, maxsplit=1)[0]
        )
        if OURS.match(name):
            keep.append(line)
    return "\n".join(keep) + "\n"


def test_promtool_check_metrics_passes_for_every_motor_series(scraped):
    promtool = shutil.which("promtool")
    require(promtool is not None, "promtool (scripts/prometheus-tools.sh installs it)")
    for target, body in scraped.items():
        ours = _ours(body)
        # (the front door's loop is the relay's own: it keeps no lag series)
        assert target == "front-door" or "motor_event_loop_lag_seconds" in ours, f"{target} has no event-loop lag"
        result = subprocess.run([promtool, "check", "metrics"], input=ours, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
            f"{target}: promtool check metrics:\n{result.stdout}{result.stderr}"
        )


def _sample_names(scraped: dict[str, str]) -> set[str]:
    """Names of the samples scraped, and of the gauges declared with no line now (the controller's
    nodes not READY and groups not ready have lines only while there are some)."""
    names = set()
    for body in scraped.values():
        for family in text_string_to_metric_families(body):
            names |= {sample.name for sample in family.samples}
            if family.type == "gauge":
                names.add(family.name)
    return names


def _queries_of_dashboard() -> list[str]:
    with open(DASHBOARD) as f:
        dashboard = json.load(f)  # valid JSON, or this fails
    queries = []
    for panel in dashboard["panels"]:
        queries += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if isinstance(variable.get("query"), dict):
            queries.append(variable["query"]["query"])
    return queries


def _rules() -> list[dict]:
    rules = []
    for path in RULE_FILES:
        with open(path) as f:
            rules += [rule for group in yaml.safe_load(f)["groups"] for rule in group["rules"]]
    return rules


def _missing(queries: list[str], live: set[str]) -> dict[str, set[str]]:
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    missing = {}
    for query in queries:
        names = set(METRIC_IN_QUERY.findall(query))
        assert names, f"no Motor metric recognised in {query!r}"
        absent = {n for n in names if n not in live and n not in recorded}
        if absent:
            missing[query] = absent
    return missing


def test_every_dashboard_query_uses_metrics_a_live_cluster_exports(scraped):
    queries = _queries_of_dashboard()
    assert len(queries) >= 15
    assert _missing(queries, _sample_names(scraped)) == {}


def test_every_rule_uses_metrics_a_live_cluster_exports(scraped):
    queries = [rule["expr"] for rule in _rules() if "up{" not in rule["expr"]]
    assert _missing(queries, _sample_names(scraped)) == {}


def test_every_motor_series_has_help_that_says_what_it_is_for(scraped):
    """HELP is what an operator reads first: a sentence, not a label (the wording is reviewed)."""
    short = set()
    for body in scraped.values():
        for family in text_string_to_metric_families(body):
            if OURS.match(family.name) and len(family.documentation.split()) < 8:
                short.add(f"{family.name}: {family.documentation!r}")
    assert not short, "\n".join(sorted(short))


def _json_lines(path: str) -> list[dict]:
    lines = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break  # the process is writing this line now
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                raise AssertionError(f"{path}:{number} is not one JSON object: {line!r}") from None
    return lines


def test_every_service_logs_one_json_object_per_line_with_its_ids(cluster, scraped):
    logs = os.path.join(cluster.run_dir, "logs")
    controller = _json_lines(os.path.join(logs, "controller.log"))
    assert {line["service"] for line in controller} == {"controller"}
    registered = [line for line in controller if line.get("event") == "node_registered"]
    assert {line["node_id"] for line in registered} == {"node-a", "node-b"}
    assert all(line["reason"].startswith(f"node {line['node_id']} registered") for line in registered)
    for node_id in ("node-a", "node-b"):
        node = _json_lines(os.path.join(logs, f"{node_id}.log"))
        assert {line["node_id"] for line in node} == {node_id}
    # Engines inherit the format from their node manager; each line names its engine.
    engine_logs = glob.glob(os.path.join(cluster.run_dir, "node-*", "logs", "engines", "*.log"))
    engines = {}
    for path in engine_logs:
        lines = _json_lines(path)
        # The node manager's line before each launch (a restart appends another), in its JSON format.
        launches = [line for line in lines if line["message"].startswith("--- launching: ")]
        assert launches and launches[0] == lines[0] and {line["service"] for line in launches} == {"node_manager"}
        for line in lines:
            if line not in launches:
                engines.setdefault(line["engine_id"], set()).add((line["service"], line["instance_id"]))
    assert engines == {
        "prefill-0/rank0": {("engine_server", "prefill-0")},
        "prefill-0/rank1": {("engine_server", "prefill-0")},
        "decode-0/rank0": {("engine_server", "decode-0")},
    }
