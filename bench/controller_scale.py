"""How many nodes can one controller process keep up with?

Starts a real `motor-controller` process and a simulated fleet in a separate process
(bench/fleet, Go; built on first use with bench/fleet/build.sh): every simulated node manager
registers, gets one 8-rank instance placed on it (the fleet answers StartEngine), and heartbeats
once a second on its own StreamHeartbeats stream with deltas (a full list every 30 beats), or
with unary Heartbeat calls (--transport unary). Meanwhile the fleet fails random engines
(ReportEngineEvent, --reports-per-s), which the controller restarts. The fleet is stepped up; per
step the script prints:

  - heartbeats/s answered against the rate asked for (nodes x 1/s), and the round trip the
    simulated nodes saw (p50, p99);
  - engine failure reports: round trip p99 (handled before the answer);
  - the controller process's CPU (percent of one core) and resident memory, the fleet's CPU;
  - the controller's event-loop lag p99 (its motor_event_loop_lag_seconds histogram, from just
    before to just after the window: it includes the stall of the scrapes themselves, whose time
    is printed, as /metrics renders every node and instance on the controller's loop);
  - whether the step was sustained: heartbeat p99 under --p99-ms, at least 95% of the expected
    heartbeats answered, none failed, controller CPU at most one core, RSS at most 1 GiB.

At the end, --victims nodes stop (heartbeats and node manager) and the script times until the
controller declares each LOST, against grace + 2 intervals + re-check timeout.
Everything talks to 127.0.0.1, in plaintext.

    .venv/bin/python bench/controller_scale.py                           # 1000 .. 10000 nodes
    .venv/bin/python bench/controller_scale.py --steps 100,200 --window 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from motor.ports import free_port  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc  # noqa: E402
from motor.v1 import types_pb2 as T  # noqa: E402

ENGINES_PER_NODE = 8
HERE = os.path.dirname(os.path.abspath(__file__))
FLEET = os.path.join(HERE, "fleet", "bin", "motor-fleet")


def deployment(instances: int) -> C.Deployment:
    d = C.Deployment(name="scale", model="sim-tiny")
    d.engine_config.update({"motor_engine_union_config": {"engine_type": "sim"}})
    d.instance_groups.add(name="u", role=T.ROLE_UNION, count=instances, data_parallel_size=ENGINES_PER_NODE,
                          accelerators_per_engine=1)
    d.restart_policy.scope = C.RESTART_SCOPE_RANK  # a failed rank restarts alone
    return d


def scrape(metrics_port: int, name: str) -> dict[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=60).read().decode()
    buckets = {}
    for le, value in re.findall(name + r'_bucket\{le="([^"]+)"\} (\S+)', text):
        buckets[float("inf") if le == "+Inf" else float(le)] = float(value)
    return buckets


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
    def __init__(self, controller: str, args):
        if not os.path.exists(FLEET):
            subprocess.run(["bash", os.path.join(HERE, "fleet", "build.sh")], check=True)
        self.proc = subprocess.Popen(
            [FLEET, "-controller", controller, "-transport", args.transport, "-victims", str(args.victims),
             "-reports-per-s", str(args.reports_per_s), "-conns", str(args.conns)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
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


def time_node_loss(stub, fleet: Fleet, config: dict) -> str:
    silenced = fleet.ask("silence")
    victims, began = set(silenced["victims"]), time.monotonic()
    bound = config["node_grace"] + 2 * config["heartbeat_interval"] + config["recheck_timeout"]
    lost_at: dict[str, float] = {}
    while len(lost_at) < len(victims) and time.monotonic() - began < 4 * bound + 10:
        reply = stub.ListNodes(C.ListNodesRequest(filter="state=LOST"), timeout=60)
        for node in reply.nodes:
            if node.info.node_id in victims:
                lost_at.setdefault(node.info.node_id, time.monotonic() - began)
        time.sleep(0.1)
    if len(lost_at) < len(victims):
        return f"node loss: only {len(lost_at)} of {len(victims)} silenced nodes declared LOST within {4 * bound + 10:.0f}s"
    return (f"node loss: {len(victims)} silenced nodes declared LOST after {min(lost_at.values()):.1f}-{max(lost_at.values()):.1f}s"
            f" (grace {config['node_grace']:g}s + 2 heartbeat intervals + re-check timeout = {bound:g}s; polled every 0.1s)")


def run(args) -> int:
    started_at = time.monotonic()
    work = tempfile.mkdtemp(prefix="motor-scale-")
    port, metrics_port = free_port(), free_port()
    config = {"node_grace": args.node_grace, "heartbeat_interval": 1.0, "recheck_timeout": 1.0}
    command = [
        os.path.join(os.path.dirname(sys.executable), "motor-controller"), "--listen", f"127.0.0.1:{port}",
        "--db", os.path.join(work, "controller.db"), "--heartbeat-interval", "1", "--node-grace", str(args.node_grace),
        "--recheck-timeout", "1", "--metrics-port", str(metrics_port), "--log-level", "WARNING",
        # Every simulated node's stream comes from 127.0.0.1: a plaintext caller is counted per host.
        "--max-streams-per-caller", str(2 * max(args.steps) + 100),
    ]
    print("controller:", " ".join(command[1:]))
    log = open(os.path.join(work, "controller.log"), "wb")
    controller = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc = psutil.Process(controller.pid)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 256 << 20)])
    stub = controller_pb2_grpc.ControllerServiceStub(channel)
    grpc.channel_ready_future(channel).result(timeout=30)
    fleet = Fleet(f"127.0.0.1:{port}", args)
    print(f"fleet: {FLEET} (separate process), transport {args.transport}, {args.reports_per_s:g} engine failures reported/s; "
          f"plaintext on 127.0.0.1 (the fleet does not present one certificate per node)")
    best = 0
    loss = ""
    try:
        for size in args.steps:
            began = time.monotonic()
            fleet.ask(f"grow {size}")
            stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment(size)), timeout=300)
            while fleet.ask("starts")["starts"] < size * ENGINES_PER_NODE and time.monotonic() - began < args.setup_timeout:
                time.sleep(0.5)
            setup = time.monotonic() - began
            time.sleep(args.warmup)
            scraped = time.monotonic()
            ingest_before = scrape(metrics_port, "motor_controller_heartbeat_ingest_seconds")
            scrape_s = time.monotonic() - scraped
            lag_before = scrape(metrics_port, "motor_event_loop_lag_seconds")
            time.sleep(2)  # the round trips are measured after the scrapes' own stall of the loop
            proc.cpu_percent(None)
            fleet.ps.cpu_percent(None)
            seen = fleet.ask(f"measure {args.window}")
            cpu, fleet_cpu = proc.cpu_percent(None), fleet.ps.cpu_percent(None)
            rss = proc.memory_info().rss / 2**20
            ingest_p99 = histogram_quantile(ingest_before, scrape(metrics_port, "motor_controller_heartbeat_ingest_seconds"), 0.99)
            lag_p99 = histogram_quantile(lag_before, scrape(metrics_port, "motor_event_loop_lag_seconds"), 0.99)
            ready = len(stub.ListNodes(C.ListNodesRequest(filter="state=READY"), timeout=120).nodes)
            ok = (seen["p99_ms"] < args.p99_ms and seen["rate"] >= 0.95 * size and seen["errors"] == 0
                  and cpu <= 100 and rss <= 1024)
            print(
                f"{size:>6} nodes {size * ENGINES_PER_NODE:>6} engines | setup {setup:5.1f}s"
                f" | heartbeats {seen['rate']:7.1f}/s of {size}/s ({seen['errors']} failed, {seen['delta_beats']} deltas"
                f" carrying {seen['delta_engines']} engines, {seen['full_beats']} full)"
                f" | round trip p50 {seen['p50_ms']:6.2f} ms p99 {seen['p99_ms']:7.2f} ms"
                f" | failure reports {seen['reports']} p99 {seen['report_p99_ms']:6.2f} ms"
                f" | controller CPU {cpu:5.1f}% RSS {rss:6.1f} MiB handling p99 <= {ingest_p99 * 1e3:g} ms loop lag p99 <= {lag_p99 * 1e3:g} ms"
                f" (one /metrics scrape {scrape_s:.2f}s)"
                f" | fleet CPU {fleet_cpu:5.1f}% | READY {ready}/{size} | load {os.getloadavg()[0]:.1f}"
                f" | {'sustained' if ok else 'NOT sustained'}",
                flush=True,
            )
            if ok:
                best = size
            elif seen["rate"] < 0.5 * size:
                break  # collapsed: larger fleets cannot do better
        if args.victims:
            loss = time_node_loss(stub, fleet, config)
    except grpc.RpcError as exc:
        state = "alive" if controller.poll() is None else f"exited with {controller.returncode}"
        print(f"a controller call failed ({exc.code().name}: {exc.details()}); controller {state}", flush=True)
    finally:
        fleet.stop()
        channel.close()
        os.killpg(controller.pid, signal.SIGTERM)
        try:
            controller.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(controller.pid, signal.SIGKILL)
        log.close()
        if args.keep:
            print(f"controller log and database kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    if loss:
        print(loss)
    print(f"largest fleet sustained (heartbeat p99 < {args.p99_ms:g} ms, CPU <= 1 core, RSS <= 1 GiB): {best} nodes x "
          f"{ENGINES_PER_NODE} engines ({best * ENGINES_PER_NODE} engines); goal 10000 x 8")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (controller and fleet share them)")
    print(f"run time {time.monotonic() - started_at:.0f}s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,2500,5000,7500,10000", help="fleet sizes to try, in order")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured per step")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds between a step's set-up and its window")
    parser.add_argument("--p99-ms", type=float, default=50.0, help="heartbeat p99 a sustained step stays under")
    parser.add_argument("--transport", choices=["stream", "unary"], default="stream", help="how the fleet heartbeats")
    parser.add_argument("--reports-per-s", type=float, default=2.0, help="engine failures the fleet reports per second")
    parser.add_argument("--victims", type=int, default=3, help="nodes silenced at the end to time their loss (0: none)")
    parser.add_argument("--conns", type=int, default=8, help="connections the fleet spreads its streams over")
    parser.add_argument("--setup-timeout", type=float, default=180.0, help="seconds a step may take to start its engines")
    parser.add_argument("--keep", action="store_true", help="keep the controller's log and database")
    parser.add_argument("--node-grace", type=float, default=5.0, help="controller --node-grace")
    args = parser.parse_args()
    args.steps = [int(s) for s in args.steps.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the controller and the fleet on the way out
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
