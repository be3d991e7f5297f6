"""Streams that survive their engine: what clients of the front door see when the engine serving
their streamed answer dies mid-answer (front_door/streams.py; `motor-front-door
--stream-continuations N` continues such a stream on another engine, token for token).

One `motorctl up` cluster (LocalCluster: a controller, a node manager with two accelerators, two
engines of one model behind the front door and the real vllm-router). `--engine vllm` (default):
real vLLM CPU engines of the tiny model (motorctl tiny-model); `--engine sim`: the simulated
engine, streaming a token every `--ms-per-token` (SimArgs decode_ms_per_token, where the sim has it).

Each fault row: `--streams` K identical greedy streamed completions of `--tokens` tokens in
flight, then the fault on the engine holding the most of them (its in-flight count, from its
management plane): `sigkill` (its engine server), `sigstop` (its EngineCore, vLLM only: Motor's
stall watchdog takes it out of the router and Motor kills it), `scale_down` (the deployment 2 -> 1
instances: the engine leaving drains for its drain_timeout, then is killed). Every stream is read
to its end, then the cluster is let return to two routed engines. Printed per row: streams, broken
(an error event, no [DONE], or the connection broken; goal 0), token-exact (text, and token ids,
equal to an uninterrupted reference read first; goal all), and the resume gap p50/p99 over the
streams the fault cut (the longest wait between two events after the fault, as the client sees
it: from the last event before the cut to the first after it).

Then the cost of asking engines for token ids when nothing fails: rounds of `--seconds` of K
closed-loop streams, the door restarted between rounds with `--stream-continuations 0` and with
its default, alternated: completion tokens/s of each (median over `--rounds`), side by side.
A door without the flag (before the continuation work) runs both as it is, and says so.

    .venv/bin/python bench/stream_continuation.py [--engine vllm|sim] [--streams 4] [--tokens 300]
        [--faults sigkill,sigstop] [--rounds 3] [--seconds 15] [--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from motor.contract.deployment_file import deployment_from_dict  # noqa: E402
from motor.contract.engine_args import SimArgs  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402
from motorctl.tiny_model import ensure_tiny_model  # noqa: E402
from tests.support.sse_stream import Streamed, stream  # noqa: E402
from tests.support.stream_faults import (  # noqa: E402
    all_routed,
    door_series,
    engines,
    routed_to,
    router_decisions,
    total,
)
from tests.support.vllm_engines import engine_core_of, offline_vllm_env, vllm_cluster, vllm_config  # noqa: E402

FAULTS = ("sigkill", "sigstop", "scale_down")
FLAG = "--stream-continuations"


def door_has_flag() -> bool:
    help_text = subprocess.run([sys.executable, "-m", "front_door.cli", "--help"], capture_output=True, text=True)
    return FLAG in help_text.stdout


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def section(args, model_dir: str) -> dict:
    if args.engine == "vllm":
        name = os.path.basename(model_dir)
        return vllm_config(
            model_dir, health={"enable_virtual_inference": False}, served_model_name=name, max_model_len=512
        )["motor_engine_prefill_config"]
    engine_args = {"model": "sim-tiny", "max_tokens_default": args.tokens}
    if "decode_ms_per_token" in SimArgs.model_fields:
        engine_args["decode_ms_per_token"] = args.ms_per_token
    else:  # a sim without per-token streaming: the answer's whole time, its chunks at its end
        engine_args["latency_ms"] = args.ms_per_token * args.tokens
    return {"engine_type": "sim", "engine_args": engine_args, "drain_timeout": 10}


class Fleet:
    """K identical streams at once, each on its own thread."""

    def __init__(self, url: str, body: dict, count: int):
        self.results: list[Streamed | None] = [None] * count
        self.events = [0] * count
        self.threads = [threading.Thread(target=self._one, args=(url, body, i), daemon=True) for i in range(count)]

    def _one(self, url: str, body: dict, i: int) -> None:
        def seen(index: int, event: object) -> None:
            self.events[i] = index + 1

        self.results[i] = stream(url, "/v1/completions", body, on_event=seen, timeout=300)

    def start(self) -> Fleet:
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> list[Streamed]:
        for thread in self.threads:
            thread.join(timeout=600)
        return [r for r in self.results if r is not None]


def inject(fault: str, local, stub, deployment: dict, decided: dict[str, float]) -> tuple[float, list]:
    """The fault on the engine the router sent the most of the streams to (since `decided`); (when,
    processes to let go of at the end)."""
    victim = routed_to(local, stub, decided, only=False)
    left: list = []
    if fault == "sigkill":
        os.kill(victim.pid, signal.SIGKILL)
    elif fault == "sigstop":
        core = engine_core_of(victim.pid)
        os.kill(core.pid, signal.SIGSTOP)
        left.append(core)
    elif fault == "scale_down":
        changed = {**deployment, "instance_groups": [{**deployment["instance_groups"][0], "count": 1}]}
        stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment_from_dict(changed)), timeout=10)
    return time.monotonic(), left


def measure(streams: list[Streamed], reference: Streamed, fault_at: float) -> dict:
    broken = [s for s in streams if s.errors or not s.done or s.broken]
    exact = [s for s in streams if s.text == reference.text and s.token_ids == reference.token_ids]
    gaps = []
    for s in streams:
        before = [b - a for (a, _), (b, _) in zip(s.events, s.events[1:]) if b < fault_at]
        after = [b - a for (a, _), (b, _) in zip(s.events, s.events[1:]) if b >= fault_at]
        usual = statistics.median(before) if before else 0.0
        if after and not (s.errors or s.broken) and max(after) > max(0.3, 10 * usual):
            gaps.append(max(after))
    return {"streams": len(streams), "broken": len(broken), "exact": len(exact), "gaps": gaps}


def fault_rows(args, local, stub, deployment: dict, body: dict, reference: Streamed) -> list[tuple]:
    rows = []
    for fault in args.faults:
        if fault == "sigstop" and args.engine != "vllm":
            continue
        all_routed(local, stub, 2)
        before = door_series(local.router_url, "motor_front_door_")
        decided = router_decisions(local)
        fleet = Fleet(local.router_url, body, args.streams).start()
        if args.engine == "vllm" or "decode_ms_per_token" in SimArgs.model_fields:
            wait_until(lambda: min(fleet.events) >= args.tokens // 5, 120)
        else:  # the sim's answer comes whole at its end: the fault halfway through its time
            time.sleep(args.ms_per_token * args.tokens / 2000)
        fault_at, left = inject(fault, local, stub, deployment, decided)
        streams = fleet.join()
        for process in left:
            try:
                process.send_signal(signal.SIGCONT)
            except Exception:  # noqa: BLE001 - already killed by Motor
                pass
        after = door_series(local.router_url, "motor_front_door_")
        figures = measure(streams, reference, fault_at)
        continued = total(after, "motor_front_door_continuations_total") - total(
            before, "motor_front_door_continuations_total"
        )
        cut = total(after, "motor_front_door_streams_cut_total") - total(before, "motor_front_door_streams_cut_total")
        rows.append((fault, figures, continued, cut))
        if fault == "scale_down":
            stub.ApplyDeployment(C.ApplyDeploymentRequest(deployment=deployment_from_dict(deployment)), timeout=10)
        wait_until(lambda: len(engines(stub)) == 2, 300)
    return rows


def wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s")
        time.sleep(0.05)


def restart_door(local, continuations: int | None) -> None:
    """The door started again (by motorctl up's supervisor, same socket) with `continuations`
    (None: its default): its argv is the list the supervisor starts it with."""
    door = [p for p in local.processes if p.name == "front-door"][-1].process
    argv = door.args
    if FLAG in argv:
        del argv[argv.index(FLAG) : argv.index(FLAG) + 2]
    if continuations is not None:
        argv += [FLAG, str(continuations)]
    door.kill()
    door.wait()
    wait_until(lambda: [p for p in local.processes if p.name == "front-door"][-1].process is not door, 30)
    wait_until(lambda: door_series_or_none(local) is not None, 60)


def door_series_or_none(local):
    try:
        return door_series(local.router_url, "motor_front_door_")
    except (AssertionError, OSError):
        return None


def throughput(args, local, body: dict, flagged: bool) -> dict[str, list[float]]:
    """Completion tokens/s of K closed-loop streams, per door setting, rounds alternated."""
    rates: dict[str, list[float]] = {"0": [], "default": []}
    for _ in range(args.rounds):
        for setting in rates:
            if flagged:
                restart_door(local, 0 if setting == "0" else None)
            tokens, stop = [0], time.monotonic() + args.seconds

            def loop() -> None:
                while time.monotonic() < stop:
                    got = stream(local.router_url, "/v1/completions", body, timeout=300)
                    if got.done and time.monotonic() <= stop:
                        tokens[0] += (got.usage or {}).get("completion_tokens", 0)

            started = time.monotonic()
            threads = [threading.Thread(target=loop, daemon=True) for _ in range(args.streams)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rates[setting].append(tokens[0] / (time.monotonic() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    parser.add_argument("--streams", type=int, default=None, help="K streams in flight (vllm 4, sim 16)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per answer (vllm 300, sim 400)")
    parser.add_argument("--ms-per-token", type=float, default=10.0, help="sim: decode time per token")
    parser.add_argument("--faults", default="sigkill,sigstop", help=f"comma-separated, of {','.join(FAULTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per door setting (0: none)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of a throughput round")
    parser.add_argument("--quick", action="store_true", help="sigkill only, one 8 s throughput round each")
    args = parser.parse_args()
    args.streams = args.streams or (4 if args.engine == "vllm" else 16)
    args.tokens = args.tokens or (300 if args.engine == "vllm" else 400)
    args.faults = ["sigkill"] if args.quick else [f for f in args.faults.split(",") if f]
    if args.quick:
        args.rounds, args.seconds = 1, 8.0
    assert set(args.faults) <= set(FAULTS), args.faults
    flagged = door_has_flag()

    work = tempfile.mkdtemp(prefix="motor-bench-continue-")
    model_dir = ensure_tiny_model(os.path.join(work, "tiny-llama")) if args.engine == "vllm" else work + "/none"
    engine_section = section(args, model_dir)
    model = engine_section["engine_args"].get("served_model_name") or engine_section["engine_args"]["model"]
    deployment = {
        "name": "vllm",
        "model": model,
        "engine_config": {"motor_engine_prefill_config": engine_section},
        "instance_groups": [{"name": "prefill", "role": "prefill", "count": 2}],
    }
    body = {
        "model": model,
        "prompt": "Motor is a control plane for",
        "max_tokens": args.tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    env = {**offline_vllm_env(work), "TMPDIR": work}
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    started = time.monotonic()
    with vllm_cluster(
        model_dir if args.engine == "vllm" else os.path.join(work, "sim-tiny"),
        env,
        os.path.join(work, "run"),
        engine_section,
        lambda local, stub: all_routed(local, stub, 2),
        node_id_prefix="bcont",
        engine_port_base=39400,
        engines=2,
        router=True,
    ) as (local, stub):
        print(f"cluster up in {time.monotonic() - started:.0f} s ({args.engine} engines); door {FLAG}: {flagged}")
        reference = stream(local.router_url, "/v1/completions", body, timeout=300)
        assert reference.done and len(reference.token_ids or reference.texts()) >= 1, reference.events[-2:]
        rows = fault_rows(args, local, stub, deployment, body, reference)
        rates = throughput(args, local, body, flagged) if args.rounds else {}
    report(args, rows, rates, flagged)


def report(args, rows: list[tuple], rates: dict[str, list[float]], flagged: bool) -> None:
    print(f"\n{args.engine} engines, {args.streams} streams of {args.tokens} tokens in flight at each fault")
    head = (
        f"{'fault':<11}{'streams':>8}{'broken':>8}{'exact':>7}{'cut':>6}{'continued':>10}{'gap p50':>9}{'gap p99':>9}"
    )
    print(head)
    for fault, f, continued, cut in rows:
        p50 = f"{pct(f['gaps'], 0.5):.2f}s" if f["gaps"] else "-"
        p99 = f"{pct(f['gaps'], 0.99):.2f}s" if f["gaps"] else "-"
        print(
            f"{fault:<11}{f['streams']:>8}{f['broken']:>8}{f['exact']:>7}{cut:>6.0f}{continued:>10.0f}{p50:>9}{p99:>9}"
        )
    print("(broken: goal 0; exact: goal all; cut/continued: the door's streams_cut/continuations counters)")
    if rates:
        zero, default = statistics.median(rates["0"]), statistics.median(rates["default"])
        print(
            f"\nno fault, {args.streams} streams, median of {args.rounds} x {args.seconds:.0f} s, completion tokens/s"
        )
        print(
            f"{FLAG} 0: {zero:.0f}   default: {default:.0f}   cost: {100 * (zero - default) / zero:+.1f}% (goal < 2%)"
        )
        if not flagged:
            print(f"(this door has no {FLAG}: both columns are the same door, the noise between rounds)")


if __name__ == "__main__":
    main()
