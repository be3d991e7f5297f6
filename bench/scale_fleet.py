"""The simulated fleet of the controller benchmarks and what they measure the controller with.

`Fleet` drives bench/fleet (Go; built on first use with bench/fleet/build.sh): simulated node
managers that register, heartbeat and report engine failures against one controller. Beside it:
the deployment that places one 8-rank instance per simulated node, reads of the controller's
/metrics (a histogram's buckets, a gauge, a quantile between two scrapes), its event-loop
thread's scheduler times, and the time the controller takes to declare silenced nodes LOST.
Used by bench/controller_scale.py and bench/ha_failover.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request

import psutil

from controller.rules.deployment_checks import MAX_COUNT
from motor.security.identity import Identity
from motor.security.pki import CertificateAuthority
from motor.v1 import controller_pb2 as C
from motor.v1 import types_pb2 as T

ENGINES_PER_NODE = 8
HERE = os.path.dirname(os.path.abspath(__file__))
FLEET = os.path.join(HERE, "fleet", "bin", "motor-fleet")


def deployment(instances: int, name: str = "scale", prefix: str = "u") -> C.Deployment:
    """One 8-rank instance per node, in groups of at most MAX_COUNT instances (a group's limit)."""
    d = C.Deployment(name=name, model="sim-tiny")
    d.engine_config.update({"motor_engine_union_config": {"engine_type": "sim"}})
    for group, first in enumerate(range(0, instances, MAX_COUNT)):
        d.instance_groups.add(
            name=f"{prefix}{group}" if group else prefix,
            role=T.ROLE_UNION,
            count=min(MAX_COUNT, instances - first),
            data_parallel_size=ENGINES_PER_NODE,
            accelerators_per_engine=1,
        )
    d.restart_policy.scope = C.RESTART_SCOPE_RANK  # a failed rank restarts alone
    return d


def deployments(instances: int, count: int) -> list[C.Deployment]:
    """The same instances split evenly over `count` named deployments (--deployments)."""
    if count <= 1:
        return [deployment(instances)]
    sizes = [instances // count + (1 if k < instances % count else 0) for k in range(count)]
    return [deployment(n, name=f"scale-{k}", prefix=f"d{k}-u") for k, n in enumerate(sizes) if n]


def scrape(metrics_port: int, name: str) -> dict[float, float]:
    """A histogram's buckets, read alone (the fleet series are not rendered for it), summed over its
    other labels (motor_gc_pause_seconds: both walks)."""
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics?name[]={name}_bucket", timeout=60)
        .read()
        .decode()
    )
    buckets: dict[float, float] = {}
    for le, value in re.findall(name + r'_bucket\{(?:[^}]*,)?le="([^"]+)"[^}]*\} (\S+)', text):
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return buckets


def gauge(metrics_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics?name[]={name}", timeout=60).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound of the bucket holding the q-quantile of what was observed between two scrapes."""
    deltas = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = deltas[-1][1] if deltas else 0
    if total <= 0:
        return float("nan")
    for le, count in deltas:
        if count >= q * total:
            return le
    return float("inf")


class Fleet:
    def __init__(self, controller: str, args, pki_dir: str | None):
        sources = [os.path.join(HERE, "fleet", name) for name in ("main.go", "nodemanager.go", "tls.go")]
        if not os.path.exists(FLEET) or max(map(os.path.getmtime, sources)) > os.path.getmtime(FLEET):
            subprocess.run(["bash", os.path.join(HERE, "fleet", "build.sh")], check=True)
        command = [
            FLEET,
            "-controller",
            controller,
            "-transport",
            args.transport,
            "-victims",
            str(args.victims),
            "-reports-per-s",
            str(args.reports_per_s),
            "-conns",
            str(args.conns),
        ]
        if pki_dir:
            command += ["-tls-ca", os.path.join(pki_dir, "ca.crt"), "-tls-ca-key", os.path.join(pki_dir, "ca.key")]
        if args.fleet_nice:
            command = ["nice", "-n", str(args.fleet_nice)] + command  # nice execs the fleet: same pid
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ps = psutil.Process(self.proc.pid)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fleet exited ({self.proc.poll()}) on {command!r}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def make_pki(work: str) -> str:
    """A CA, the controller's certificate (127.0.0.1) and an operator's for this script's calls."""
    directory = os.path.join(work, "pki")
    ca = CertificateAuthority.create()
    ca.save(directory)
    ca.issue(Identity("controller"), hosts=["127.0.0.1", "localhost"]).save(directory, "controller")
    ca.issue(Identity("operator", "bench")).save(directory, "operator")
    return directory


def time_node_loss(stub, fleet: Fleet, grace: float, interval: float, recheck_timeout: float) -> str:
    silenced = fleet.ask("silence")
    victims, began = set(silenced["victims"]), time.monotonic()
    bound = grace + 2 * interval + recheck_timeout
    lost_at: dict[str, float] = {}
    while len(lost_at) < len(victims) and time.monotonic() - began < 4 * bound + 10:
        reply = stub.ListNodes(C.ListNodesRequest(filter="state=LOST"), timeout=60)
        for node in reply.nodes:
            if node.info.node_id in victims:
                lost_at.setdefault(node.info.node_id, time.monotonic() - began)
        time.sleep(0.1)
    if len(lost_at) < len(victims):
        within = 4 * bound + 10
        return f"node loss: only {len(lost_at)} of {len(victims)} silenced nodes declared LOST within {within:.0f}s"
    return (
        f"node loss: {len(victims)} silenced nodes declared LOST after "
        f"{min(lost_at.values()):.1f}-{max(lost_at.values()):.1f}s"
        f" (announced grace {grace:g}s + 2 x interval {interval:g}s + re-check {recheck_timeout:g}s = {bound:g}s;"
        " polled every 0.1s)"
    )


def loop_thread_schedstat(pid: int) -> tuple[float, float]:
    """Seconds the process's main thread (the controller's event loop) has run and has waited,
    runnable, for a CPU (Linux schedstat; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as stat:
            ran, waited = stat.read().split()[:2]
    except OSError:
        return float("nan"), float("nan")
    return int(ran) / 1e9, int(waited) / 1e9


def paged_nodes(stub, filter_: str):
    token = ""
    while True:
        reply = stub.ListNodes(C.ListNodesRequest(filter=filter_, page_size=1000, page_token=token), timeout=120)
        yield from reply.nodes
        token = reply.next_page_token
        if not token:
            return
