"""What clients see while an operator does the things operators do to a rollout: the sequences of
a hostile read of rollouts, spares and the front door, replayed under client load.

Each sequence gets a fresh `motorctl up` cluster (LocalCluster: a controller, two node managers
with three accelerators each, simulated union engines, the real vllm-router behind Motor's front
door, kept by motor-router-sync). Deployments of count 1 or 2, `min_ready: 3s`. Open-loop load
through the front door (--rate requests/s, each request on its own thread, 60 s client timeout;
bench/router_failover.py's Load) from before the sequence's first step until a few seconds after
its last; every request's answer is waited for.

  fix-while-paused    count 1: v2 serves; v3, whose engines crash 1.5 s after start, pauses the
                      rollout; v4, the fix (loads in 5 s), is applied while paused
  apply-mid-rollout   count 2: a new apply once the rollout is half way (one new instance serving)
  scale-down-failed   count 2, one failure allowed: union-0's engine SIGKILLed (FAILED), then 2 -> 1
  rename-model        count 2: a rollout from model sim-a to sim-b, load on sim-a until sim-b's
                      instances are READY and on sim-b from when the front door lists it, the
                      controller SIGKILLed and started again in the middle
  sync-killed         count 2: motor-router-sync (which feeds the front door) SIGKILLed half way
                      through a rollout
  killed-while-paused count 2: a bad version pauses, then a serving engine is SIGKILLed
  spares-paused       the same with spares: 1
  rename-group        count 1, rolling: the instance group renamed

Printed per sequence: requests sent, failed (not 2xx, or no answer), the longest wait, the seconds
the router had no worker for a model under load (the router's own worker list, sampled every
0.1 s; per model through the front door's /v1/models for rename-model), and the sequence's own
verdict (what the sequence must end in, checked on the controller and the router). The
controller's events of each run are written to <run dir>/events.txt (the run dir is printed).
Exit status 1 when any sequence failed a request or missed its verdict.

    .venv/bin/python bench/operator_sequences.py [--rate 10] [--sequences fix-while-paused,sync-killed]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.router_failover import Load, post  # noqa: E402
from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motor.v1 import controller_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc  # noqa: E402
from motorctl.local_cluster import LocalCluster  # noqa: E402

BAD = {"faults": {"crash_after_s": 1.5}}  # a version whose engines crash 1.5 s after start


def deployment(
    count: int,
    latency_ms: float = 20,
    model: str = "sim-tiny",
    group: str = "union",
    spares: int = 0,
    restart_policy: dict | None = None,
    **engine_args,
) -> C.Deployment:
    spec = {
        "name": "seq",
        "model": model,
        "instance_groups": [
            {"name": group, "role": "union", "count": count, "spares": spares, "accelerators_per_engine": 1}
        ],
        "engine_config": {
            "motor_engine_union_config": {
                "engine_type": "sim",
                "engine_args": {"model": model, "latency_ms": latency_ms, **engine_args},
            }
        },
        "strategy": {"type": "rolling", "min_ready": "3s"},
    }
    if restart_policy:
        spec["restart_policy"] = restart_policy
    return deployment_from_dict(spec)


class ModelLoad(Load):
    """Load's open-loop completions, naming `model`."""

    def __init__(self, url: str, rate: float, model: str):
        super().__init__(url, rate)
        self.model = model

    def one(self) -> None:
        sent = time.monotonic()
        status, _ = post(self.url + "/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": 2}, 60)
        self.results.append((sent, status, time.monotonic()))


class Verdict(Exception):
    """The sequence did not end as it must: its message is the verdict."""


class Run:
    def __init__(self, args, name: str, base_port: int):
        self.args, self.name = args, name
        self.cluster = LocalCluster(
            tempfile.mkdtemp(prefix=f"operator-{name}-"),
            nodes=2,
            heartbeat_interval=1.0,
            accelerators_per_node=3,  # count 2 + a surge instance + a spare
            engine_port_base=base_port,
            router_port=0,
            metrics_port=0,
        )
        self.loads: dict[str, ModelLoad] = {}
        self.senders: list[threading.Thread] = []
        self.samples: list[tuple[float, int | None, set[str] | None]] = []  # (when, workers, models listed)
        self.sampling = threading.Event()

    # The controller --------------------------------------------------------------------------

    def call(self, method: str, request, timeout: float = 30):
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            return getattr(controller_pb2_grpc.ControllerServiceStub(channel), method)(request, timeout=timeout)

    def apply(self, spec: C.Deployment) -> int:
        return self.call("ApplyDeployment", C.ApplyDeploymentRequest(deployment=spec)).revision

    def summary(self) -> C.DeploymentSummary:
        return self.call("ListDeployments", C.ListDeploymentsRequest(), 10).deployments[0]

    def instances(self) -> list[C.Instance]:
        return list(self.call("ListInstances", C.ListInstancesRequest(), 10).instances)

    def events(self) -> list[C.Event]:
        with grpc.insecure_channel(self.cluster.controller_address) as channel:
            stream = controller_pb2_grpc.ControllerServiceStub(channel).WatchEvents(C.WatchEventsRequest(), timeout=5)
            return list(next(iter(stream)).snapshot.recent_events)

    def workers(self) -> set[str]:
        status, text = post(self.cluster.router_url + "/list_workers", None, 5, method="GET")
        return set(json.loads(text)["urls"]) if status == 200 else set()

    def serving(self) -> list[C.Instance]:
        """READY instances that are not spares and whose engines the router holds."""
        workers = self.workers()
        return [
            i
            for i in self.instances()
            if i.state == C.INSTANCE_STATE_READY
            and not i.spare
            and all(f"http://{e.host}:{e.port}" in workers for e in i.engines)
        ]

    def settled(self, revision: int, count: int, spares: int = 0) -> bool:
        """COMPLETE on `revision`, every instance READY on it, the router holding exactly the serving ones."""
        mine, workers = self.instances(), self.workers()
        urls = {f"http://{e.host}:{e.port}" for i in mine if not i.spare for e in i.engines}
        return (
            self.summary().rollout_state == C.ROLLOUT_STATE_COMPLETE
            and len(mine) == count + spares
            and all(i.revision == revision and i.state == C.INSTANCE_STATE_READY for i in mine)
            and workers == urls
            and len(urls) == count
        )

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not (result := predicate()):
            if time.monotonic() > deadline:
                raise Verdict(f"not within {timeout:g}s: {what}")
            time.sleep(0.2)
        return result

    def engine_pid(self, engine: C.InstanceEngine) -> int:
        with grpc.insecure_channel(f"127.0.0.1:{self.cluster.node_ports[engine.node_id]}") as channel:
            node = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            return node.GetEngine(node_manager_pb2.GetEngineRequest(engine_id=engine.engine_id), timeout=5).engine.pid

    # Load and what the front door holds ------------------------------------------------------

    def load(self, model: str = "sim-tiny") -> None:
        load = self.loads[model] = ModelLoad(self.cluster.router_url, self.args.rate, model)
        self.senders.append(threading.Thread(target=load.run, daemon=True))
        self.senders[-1].start()
        if len(self.loads) == 1:
            threading.Thread(target=self.sample, daemon=True).start()

    def sample(self) -> None:
        admin = self.cluster.router_admin_url + "/list_workers"  # the router itself, up while the sync is not
        while not self.sampling.wait(0.1):
            status, text = post(admin, None, 2, method="GET")
            workers = len(json.loads(text)["urls"]) if status == 200 else None
            status, text = post(self.cluster.router_url + "/v1/models", None, 2, method="GET")
            models = {m["id"] for m in json.loads(text)["data"]} if status == 200 else None
            self.samples.append((time.monotonic(), workers, models))

    def stop_load(self, model: str = "sim-tiny") -> None:
        self.loads[model].stopping.set()

    def finish(self) -> dict:
        for load in self.loads.values():
            load.stopping.set()
        for sender in self.senders:
            sender.join()
        for load in self.loads.values():
            for thread in load.threads:
                thread.join(timeout=65)
        self.sampling.set()
        results = [r for load in self.loads.values() for r in load.results]
        return {
            "requests": len(results),
            "failed": sum(1 for r in results if not 200 <= r[1] < 300),
            "codes": Counter(r[1] for r in results if not 200 <= r[1] < 300),
            "longest_s": max((r[2] - r[0] for r in results), default=0.0),
            "no_worker_s": self.no_worker_seconds(),
        }

    def no_worker_seconds(self) -> float:
        """Seconds, while load ran, with no worker in the router (one model loaded) or, with
        several loaded, the longest time one model under load was not listed by the front door."""
        if len(self.loads) == 1:
            return sum(
                later[0] - now[0] for now, later in zip(self.samples, self.samples[1:]) if now[1] == 0
            )  # unknown (the router not answering) is not counted as none
        gaps = []
        for model, load in self.loads.items():
            sent = [r[0] for r in load.results]
            if not sent:
                continue
            first, last = min(sent), max(sent)
            gaps.append(
                sum(
                    later[0] - now[0]
                    for now, later in zip(self.samples, self.samples[1:])
                    if first <= now[0] <= last and now[2] is not None and model not in now[2]
                )
            )
        return max(gaps, default=0.0)

    def run(self, sequence) -> dict:
        self.cluster.start(timeout=90)
        try:
            try:
                verdict = sequence(self)
            except Verdict as exc:
                verdict = f"WRONG: {exc}"
            row = self.finish()
            with open(os.path.join(self.cluster.run_dir, "events.txt"), "w") as out:
                for event in self.events():
                    out.write(
                        f"{event.time.ToJsonString()} {C.EventType.Name(event.type)} {event.instance_id} "
                        f"{event.message}\n"
                    )
            return {**row, "verdict": verdict}
        finally:
            for load in self.loads.values():
                load.stopping.set()
            self.sampling.set()
            self.cluster.stop()


# The sequences: each returns its verdict, or raises Verdict -------------------------------------


def fix_while_paused(run: Run) -> str:
    run.apply(deployment(1, 20))
    good = run.apply(deployment(1, 25))
    run.wait(lambda: run.settled(good, 1), 120, "v2 serving")
    (kept,) = run.instances()
    run.load()
    time.sleep(3)
    run.apply(deployment(1, 25, **BAD))
    run.wait(lambda: run.summary().rollout_state == C.ROLLOUT_STATE_PAUSED, 60, "the bad version paused")
    fix = run.apply(deployment(1, 30, load_s=5))
    lowest = 1
    deadline = time.monotonic() + 90
    while not run.settled(fix, 1):
        lowest = min(lowest, len(run.workers()))
        if time.monotonic() > deadline:
            raise Verdict(f"the fix not serving in 90s: {run.summary().rollout_reason}")
        time.sleep(0.2)
    time.sleep(3)
    if lowest == 0:
        raise Verdict(f"the router had no worker before the fix served ({kept.instance_id} served v2)")
    return "the fix serves; the v2 instance served until it did"


def apply_mid_rollout(run: Run) -> str:
    first = run.apply(deployment(2, 20))
    run.wait(lambda: run.settled(first, 2), 120, "v1 serving")
    run.load()
    time.sleep(3)
    second = run.apply(deployment(2, 25))
    run.wait(lambda: any(i.revision == second for i in run.serving()), 60, "half way: one v2 instance serving")
    third = run.apply(deployment(2, 30))
    lowest = 2
    deadline = time.monotonic() + 120
    while not run.settled(third, 2):
        lowest = min(lowest, len(run.serving()))
        if time.monotonic() > deadline:
            raise Verdict(f"v3 not complete in 120s: {run.summary().rollout_reason}")
        time.sleep(0.2)
    time.sleep(3)
    if lowest < 2:
        raise Verdict(f"{lowest} instance(s) served at one point, count 2")
    return "v3 complete; 2 served throughout"


def scale_down_failed(run: Run) -> str:
    once = {"max_failures": 1}
    first = run.apply(deployment(2, restart_policy=once))
    run.wait(lambda: run.settled(first, 2), 120, "two instances serving")
    run.load()
    time.sleep(3)
    victim, healthy = sorted(run.instances(), key=lambda i: i.instance_id)
    os.kill(run.engine_pid(victim.engines[0]), signal.SIGKILL)
    run.wait(
        lambda: any(
            i.instance_id == victim.instance_id and i.state == C.INSTANCE_STATE_FAILED for i in run.instances()
        ),
        30,
        f"{victim.instance_id} FAILED",
    )
    time.sleep(2)
    scaled = run.apply(deployment(1, restart_policy=once))
    run.wait(lambda: run.settled(scaled, 1), 60, "scaled down to one serving instance")
    time.sleep(3)
    left = [i.instance_id for i in run.instances()]
    if left != [healthy.instance_id]:
        raise Verdict(f"{left} left, the serving {healthy.instance_id} expected")
    return f"{victim.instance_id} (FAILED) removed, {healthy.instance_id} kept serving"


def mid_rollout(run: Run, what: str) -> None:
    if run.summary().rollout_state != C.ROLLOUT_STATE_PROGRESSING:
        raise Verdict(f"{what} came after the rollout: {C.RolloutState.Name(run.summary().rollout_state)}")


def rename_model(run: Run) -> str:
    first = run.apply(deployment(2, model="sim-a"))
    run.wait(lambda: run.settled(first, 2), 120, "sim-a serving")
    run.load("sim-a")
    time.sleep(3)
    renamed = run.apply(deployment(2, model="sim-b"))

    def listed() -> set[str]:
        status, text = post(run.cluster.router_url + "/v1/models", None, 5, method="GET")
        return {m["id"] for m in json.loads(text)["data"]} if status == 200 else set()

    run.wait(lambda: "sim-b" in listed(), 60, "sim-b listed by the front door")
    run.load("sim-b")  # clients of the new name start when the front door lists it
    time.sleep(1)
    mid_rollout(run, "the controller's restart")
    controller = run.cluster.process("controller").process
    os.killpg(controller.pid, signal.SIGKILL)
    controller.wait(timeout=10)
    run.cluster.launch_controller(0)
    run.cluster.wait_serving(run.cluster.controller_address, 30, run.cluster.credentials())
    run.wait(
        lambda: sum(i.revision == renamed and i.state == C.INSTANCE_STATE_READY for i in run.instances()) == 2,
        90,
        "both sim-b instances READY",
    )
    run.stop_load("sim-a")  # the old name's clients are gone once the new instances are all up
    run.wait(lambda: run.settled(renamed, 2), 60, "the rollout to sim-b complete")
    time.sleep(3)
    if listed() != {"sim-b"}:
        raise Verdict(f"the front door lists {sorted(listed())} at the end")
    return "sim-b complete through a controller restart; the front door lists sim-b only"


def sync_killed(run: Run) -> str:
    first = run.apply(deployment(2, 20))
    run.wait(lambda: run.settled(first, 2), 120, "v1 serving")
    run.load()
    time.sleep(3)
    second = run.apply(deployment(2, 30))
    run.wait(lambda: any(i.revision == second for i in run.serving()), 60, "half way: one v2 instance serving")
    mid_rollout(run, "the kill of the sync")
    sync = run.cluster.process("router-sync").process
    os.killpg(sync.pid, signal.SIGKILL)
    sync.wait(timeout=10)
    run.wait(lambda: run.cluster.process("router-sync").process.pid != sync.pid, 30, "the sync started again")
    run.wait(lambda: run.settled(second, 2), 120, "v2 complete and the router holding its engines only")
    time.sleep(3)
    return "the sync restarted; v2 complete; the router holds v2's engines only"


def killed_while_paused(run: Run, spares: int) -> str:
    """A bad version paused, then a serving engine of the good one SIGKILLed: the good version
    serves the count again (its killed instance restarted on its own spec) and, with a spare,
    nothing of the bad version is promoted into service. (Without a spare the paused rollout's
    own new instance, restarted by its restart policy, is routed while it is up, as before the
    kill: not counted here.)"""
    first = run.apply(deployment(2, 20, spares=spares))
    run.wait(lambda: run.settled(first, 2, spares=spares), 120, f"two serving and {spares} READY spare(s)")
    run.load()
    time.sleep(3)
    run.apply(deployment(2, 25, spares=spares, **BAD))
    run.wait(lambda: run.summary().rollout_state == C.ROLLOUT_STATE_PAUSED, 60, "the bad version paused")
    victim = next(i for i in run.serving() if i.revision == first)
    os.kill(run.engine_pid(victim.engines[0]), signal.SIGKILL)
    bad_served, crashed = set(), set()
    deadline = time.monotonic() + 15  # a bad engine in service crashes within this (1.5 s after start)
    while time.monotonic() < deadline:
        bad_served |= {i.instance_id for i in run.serving() if i.revision != first}
        # Only the killed engine's restart is expected of the good version.
        crashed |= {
            i.instance_id
            for i in run.instances()
            if i.revision == first and i.restarts > (1 if i.instance_id == victim.instance_id else 0)
        }
        time.sleep(0.2)
    wrong = []
    if bad_served and spares:
        wrong.append(f"{sorted(bad_served)} of the paused bad version served")
    if crashed:
        wrong.append(f"{sorted(crashed)} of the good version crashed again")
    if len(run.serving()) < 2:  # 3 while the rollout's surge place is held by an old instance
        wrong.append(f"{len(run.serving())} serving 15 s after the kill, count 2")
    if wrong:
        raise Verdict("; ".join(wrong))
    return "2 of the good version serve after the kill; nothing of the bad one"


def rename_group(run: Run) -> str:
    first = run.apply(deployment(1, 20))
    run.wait(lambda: run.settled(first, 1), 120, "one instance serving")
    run.load()
    time.sleep(3)
    renamed = run.apply(deployment(1, 20, group="renamed"))
    lowest = 1
    deadline = time.monotonic() + 60
    while not run.settled(renamed, 1):
        lowest = min(lowest, len(run.serving()))
        if time.monotonic() > deadline:
            raise Verdict(f"the renamed group not complete in 60s: {run.summary().rollout_reason}")
        time.sleep(0.2)
    time.sleep(3)
    if lowest < 1:
        raise Verdict("nothing served during the rename")
    return "the renamed group serves; the old one served until it did"


SEQUENCES = {
    "fix-while-paused": fix_while_paused,
    "apply-mid-rollout": apply_mid_rollout,
    "scale-down-failed": scale_down_failed,
    "rename-model": rename_model,
    "sync-killed": sync_killed,
    "killed-while-paused": lambda run: killed_while_paused(run, spares=0),
    "spares-paused": lambda run: killed_while_paused(run, spares=1),
    "rename-group": rename_group,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second (default 10)")
    parser.add_argument("--sequences", default=",".join(SEQUENCES), help=f"comma-separated, of {', '.join(SEQUENCES)}")
    args = parser.parse_args()
    chosen = [s for s in args.sequences.split(",") if s]
    unknown = [s for s in chosen if s not in SEQUENCES]
    if unknown or not chosen:
        parser.error(f"--sequences: unknown {', '.join(unknown) or 'none given'} (known: {', '.join(SEQUENCES)})")
    print(f"{'sequence':<19} {'requests':>8} {'failed':>7} {'longest':>8} {'no worker':>10}  verdict", flush=True)
    wrong = 0
    for name in chosen:
        run = Run(args, name, 46000 + 1000 * list(SEQUENCES).index(name))
        row = run.run(SEQUENCES[name])
        wrong += row["failed"] > 0 or row["verdict"].startswith("WRONG")
        codes = ", ".join(f"{n} x {code or 'no answer'}" for code, n in sorted(row["codes"].items()))
        print(
            f"{name:<19} {row['requests']:>8} {row['failed']:>7} {row['longest_s']:>7.2f}s "
            f"{row['no_worker_s']:>9.1f}s  {row['verdict']}{f' (failed: {codes})' if codes else ''}  "
            f"({run.cluster.run_dir})",
            flush=True,
        )
    print(f"load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
