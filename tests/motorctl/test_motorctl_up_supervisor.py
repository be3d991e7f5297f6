"""motorctl up's front-door supervisor (motorctl/supervise.py): a router or sync that exits is
started again with a doubling delay, and left stopped after too many exits in a window; its
state machine driven by hand, on a clock moved by hand."""

from __future__ import annotations

import signal

from motorctl.supervise import BACKOFF, FATAL, RUNNING, Supervisor


class FakeProcess:
    def __init__(self):
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def supervised(clock: Clock, **options):
    supervisor = Supervisor(clock, backoff_base=0.5, backoff_cap=4.0, max_restarts=3, window=60.0, **options)
    started: list[FakeProcess] = []

    def start() -> FakeProcess:
        started.append(FakeProcess())
        return started[-1]

    supervisor.watch("router-sync", start(), start)
    return supervisor, started


def test_a_killed_sync_is_started_again_after_the_backoff_and_said_meanwhile():
    clock = Clock()
    supervisor, started = supervised(clock)
    supervisor.tick()
    assert supervisor.describe("router-sync") == "" and supervisor.running("router-sync")
    started[0].code = -signal.SIGKILL
    supervisor.tick()
    assert supervisor.supervised["router-sync"].state == BACKOFF
    assert supervisor.describe("router-sync") == "router-sync killed by SIGKILL, starting again in 0.5s"
    assert not supervisor.running("router-sync")
    clock.now += 0.4
    supervisor.tick()
    assert len(started) == 1, "not before its delay"
    clock.now += 0.2
    supervisor.tick()
    assert len(started) == 2 and supervisor.running("router-sync")
    assert supervisor.describe("router-sync") == "router-sync restarted 1 time(s), last killed by SIGKILL"


def test_the_delay_doubles_with_the_exits_and_too_many_leave_it_stopped():
    clock = Clock()
    supervisor, started = supervised(clock)
    delays = []
    for _ in range(3):
        started[-1].code = 1
        supervisor.tick()
        one = supervisor.supervised["router-sync"]
        delays.append(one.retry_at - clock.now)
        clock.now = one.retry_at
        supervisor.tick()
        assert one.state == RUNNING
    assert delays == [0.5, 1.0, 2.0]
    started[-1].code = 1
    supervisor.tick()
    assert supervisor.supervised["router-sync"].state == FATAL
    clock.now += 100
    supervisor.tick()
    assert len(started) == 4, "a process that keeps exiting is not started again for ever"
    assert supervisor.describe("router-sync") == "router-sync exited with code 1 4 times within 60s: not started again"


def test_exits_older_than_the_window_are_forgotten():
    clock = Clock()
    supervisor, started = supervised(clock)
    for _ in range(6):
        started[-1].code = 1
        supervisor.tick()
        clock.now = supervisor.supervised["router-sync"].retry_at + 61
        supervisor.tick()
    assert supervisor.supervised["router-sync"].state == RUNNING and len(started) == 7


def test_the_screen_stops_saying_kept_by_the_sync_while_it_is_down(tmp_path):
    from motorctl.local_cluster import LocalCluster

    clock = Clock()
    cluster = LocalCluster(str(tmp_path), front_door=Supervisor(clock, backoff_base=0.5))
    sync, router = FakeProcess(), FakeProcess()
    cluster.front_door.watch("router", router, FakeProcess)
    cluster.front_door.watch("router-sync", sync, FakeProcess)
    cluster.front_door.tick()
    assert cluster.front_door_state() == "kept by motor-router-sync"
    sync.code = -signal.SIGKILL
    cluster.front_door.tick()
    assert cluster.front_door_state() == "NOT kept: router-sync killed by SIGKILL, starting again in 0.5s"
    clock.now += 1
    cluster.front_door.tick()
    assert cluster.front_door_state() == (
        "kept by motor-router-sync; router-sync restarted 1 time(s), last killed by SIGKILL"
    )
