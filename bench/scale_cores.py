"""Where bench/controller_scale.py's processes run, and what the controller's CPU went to.

"own": the controller on a core of its own (the machine's last CPU), the simulated fleet, the
scraper and this script on the others, so that what is judged is the controller's own work, not
its neighbours' (the fleet does every node's side of gRPC and TLS on the same machine; on two
shared cores the failure reports' tail followed the machine's other work). "shared": all of them
on every CPU, as before: the second line of each step, printed, not judged.
"""

from __future__ import annotations

import os
import re
import urllib.request
from dataclasses import dataclass

import psutil

CORES = ("own", "shared")


def controller_cpus(cores: str) -> set[int] | None:
    """The CPUs the controller may run on (None: all of them)."""
    if cores == "shared":
        return None
    cpus = sorted(os.sched_getaffinity(0) | _all_cpus())
    if len(cpus) < 2:
        raise SystemExit("--cores own needs at least 2 CPUs: one for the controller, one for the fleet")
    return {cpus[-1]}


def _all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def place_self(cores: str) -> None:
    """This script (and so the fleet and the scraper, started after it) off the controller's core."""
    own = controller_cpus(cores)
    os.sched_setaffinity(0, _all_cpus() - own if own else _all_cpus())


def pinning(cores: str):
    """A Popen preexec_fn that puts the controller on its CPUs before it starts a thread (its threads inherit)."""
    own = controller_cpus(cores)
    return (lambda: os.sched_setaffinity(0, own)) if own else (lambda: os.sched_setaffinity(0, _all_cpus()))


class CoreOfItsOwn:
    """The controller's core cleared of every other process of the machine for a trial, as a cpuset
    or `isolcpus` would on a host of its own: each task (thread) that may run there is moved to the
    other CPUs, and put back afterwards. Tasks started meanwhile inherit their parent's placement.
    Kernel threads and tasks this user may not move stay (counted: the loop's wait for a CPU shows
    what they took)."""

    def __init__(self, cpu: int, controller_pid: int):
        self.cpu, self.controller_pid = cpu, controller_pid
        self.moved: dict[int, set[int]] = {}
        self.unmoved = 0

    def __enter__(self) -> CoreOfItsOwn:
        for task in _tasks(exclude=self.controller_pid):
            try:
                allowed = os.sched_getaffinity(task)
                if self.cpu in allowed and len(allowed) > 1:
                    os.sched_setaffinity(task, allowed - {self.cpu})
                    self.moved[task] = allowed
            except OSError:
                self.unmoved += 1
        return self

    def __exit__(self, *exc) -> None:
        for task, allowed in self.moved.items():
            try:
                os.sched_setaffinity(task, allowed)
            except OSError:
                pass  # ended meanwhile


def _tasks(exclude: int) -> list[int]:
    """Every task (thread) id of the machine's processes but `exclude`'s."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == exclude:
            continue
        try:
            found += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
    return found


def handling_cpu(metrics_port: int) -> dict[str, float]:
    """motor_controller_handling_cpu_seconds_total by call, and motor_gc_pause_seconds' sum (as "gc")."""
    url = f"http://127.0.0.1:{metrics_port}/metrics?name[]=motor_controller_handling_cpu_seconds_total"
    text = urllib.request.urlopen(url + "&name[]=motor_gc_pause_seconds_sum", timeout=60).read().decode()
    seconds = {call: float(v) for call, v in re.findall(r'handling_cpu_seconds_total\{call="(\w+)"\} (\S+)', text)}
    seconds["gc"] = sum(float(v) for v in re.findall(r"^motor_gc_pause_seconds_sum\{[^}]*\} (\S+)", text, re.M))
    return seconds


@dataclass(frozen=True)
class ThreadCpu:
    """CPU seconds of a process's event-loop thread (its main thread) and of all its other threads
    (gRPC's pollers and executor, the /metrics server)."""

    loop: float
    others: float

    @classmethod
    def read(cls, proc: psutil.Process) -> ThreadCpu:
        loop = others = 0.0
        for thread in proc.threads():
            spent = thread.user_time + thread.system_time
            if thread.id == proc.pid:
                loop += spent
            else:
                others += spent
        return cls(loop, others)

    def __sub__(self, before: ThreadCpu) -> ThreadCpu:
        return ThreadCpu(self.loop - before.loop, self.others - before.others)


@dataclass(frozen=True)
class CpuSplit:
    """A window's controller CPU per heartbeat, split: the event-loop thread (of it: Motor's own
    handling of the beats, and garbage collection) and the other threads; and per failure report,
    Motor's own handling of it."""

    per_beat_ms: float
    loop_ms: float
    handling_ms: float
    gc_ms: float
    others_ms: float
    per_report_ms: float

    @classmethod
    def of(
        cls, threads: ThreadCpu, beats: float, reports: int, handling: dict[str, float], gc_seconds: float
    ) -> CpuSplit:
        nan = float("nan")
        per = (lambda seconds: seconds / beats * 1e3) if beats else (lambda seconds: nan)
        return cls(
            per_beat_ms=per(threads.loop + threads.others),
            loop_ms=per(threads.loop),
            handling_ms=per(handling.get("heartbeat", 0.0)),
            gc_ms=per(gc_seconds),
            others_ms=per(threads.others),
            per_report_ms=handling.get("report", 0.0) / reports * 1e3 if reports else nan,
        )

    def text(self) -> str:
        grpc_loop = self.loop_ms - self.handling_ms - self.gc_ms
        return (
            f"CPU per heartbeat {self.per_beat_ms:.3f} ms = event-loop thread {self.loop_ms:.3f} (Motor's handling "
            f"{self.handling_ms:.3f}, garbage collection {self.gc_ms:.3f}, gRPC's reads and writes, the asyncio loop "
            f"and the rest {grpc_loop:.3f}) + other threads {self.others_ms:.3f} (gRPC's pollers, /metrics); "
            f"CPU per failure report (Motor's handling) {self.per_report_ms:.3f} ms"
        )
