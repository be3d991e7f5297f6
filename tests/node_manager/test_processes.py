"""motor.processes with real processes and real signals: exit notice, confirmation, tree kill."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import psutil
import pytest

from motor import processes
from tests.support import async_wait_for

# A parent that starts one child in its group and one that escapes it (setsid), prints their
# pids, then sleeps: the shape of an engine server with engine-core children.
PARENT = r"""
import subprocess, sys, time
stay = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
escape = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])
print("children", stay.pid, escape.pid, flush=True)
time.sleep(600)
"""


def children_from_log(path: str) -> list[int]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("children "):
                return [int(v) for v in line.split()[1:]]
    return []


async def watch(popen=None, pid=None, started=None):
    exits = []
    w = processes.ExitWatch(pid or popen.pid, exits.append, popen=popen, started=started)
    w.start()
    return w, exits


@pytest.mark.processes
async def test_exit_code_and_signal_are_recorded(tmp_path):
    ok = processes.launch([sys.executable, "-c", "import sys; sys.exit(3)"], str(tmp_path / "a.log"))
    w, exits = await watch(ok)
    await asyncio.wait_for(w.exited.wait(), 10)
    assert exits == [processes.ExitStatus(exit_code=3)]
    assert ok.returncode == 3

    slow = processes.launch([sys.executable, "-c", "import time; time.sleep(600)"], str(tmp_path / "b.log"))
    w, exits = await watch(slow)
    os.kill(slow.pid, signal.SIGKILL)
    await asyncio.wait_for(w.exited.wait(), 10)
    assert exits == [processes.ExitStatus(signal=signal.SIGKILL)]
    assert exits[0].describe() == "killed by signal 9 (SIGKILL)"


@pytest.mark.processes
async def test_stopped_process_is_not_an_exit_and_spurious_notice_is_ignored(tmp_path):
    proc = processes.launch([sys.executable, "-c", "import time; time.sleep(600)"], str(tmp_path / "c.log"))
    w, exits = await watch(proc)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        await asyncio.sleep(0.3)
        w._readable()  # a readiness without an exit (vLLM #54184) must not count
        assert exits == [] and not w.exited.is_set()
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
    await asyncio.wait_for(w.exited.wait(), 10)
    assert exits == [processes.ExitStatus(signal=signal.SIGKILL)]


@pytest.mark.processes
async def test_adopted_process_exit_is_noticed_without_being_its_parent(tmp_path):
    # A process that is not our child (its parent is a shell we start): pidfd notice, psutil confirms.
    shell = processes.launch(
        ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(600)' & echo $! ; wait"], str(tmp_path / "d.log")
    )
    pid = await async_wait_for(lambda: [c.pid for c in psutil.Process(shell.pid).children()], timeout=10)
    pid = pid[0]
    w, exits = await watch(pid=pid, started=processes.create_time(pid))
    try:
        await asyncio.sleep(0.2)
        assert not w.exited.is_set()
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(w.exited.wait(), 10)
        assert exits == [processes.ExitStatus()]
        assert "exit code unknown" in exits[0].describe()
    finally:
        await processes.kill_tree_confirmed(processes.TreeId(shell.pid, shell.pid))
        shell.wait(5)


async def test_pid_reuse_is_not_mistaken_for_the_same_process():
    me = os.getpid()
    assert processes.same_process(me, processes.create_time(me))
    assert not processes.same_process(me, processes.create_time(me) - 100)


@pytest.mark.processes
async def test_tree_kill_finds_children_in_and_outside_the_group(tmp_path):
    log = str(tmp_path / "tree.log")
    parent = processes.launch([sys.executable, "-c", PARENT], log, token="tok-tree-1")
    w, _ = await watch(parent)
    pids = await async_wait_for(lambda: children_from_log(log), timeout=20, what="children started")
    tree = processes.TreeId(parent.pid, parent.pid, "tok-tree-1")
    found = {p.pid for p in processes.find_tree(tree)}
    assert {parent.pid, *pids} <= found
    assert os.getpid() not in found
    left = await processes.kill_tree_confirmed(tree)
    assert left == []
    await asyncio.wait_for(w.exited.wait(), 10)
    assert not any(processes.same_process(pid, None) for pid in pids)


@pytest.mark.processes
async def test_terminate_tree_is_graceful_when_the_process_exits_on_sigterm(tmp_path):
    proc = processes.launch(
        [sys.executable, "-c", "import time; time.sleep(600)"], str(tmp_path / "e.log"), token="tok-e"
    )
    w, exits = await watch(proc)
    began = time.monotonic()
    graceful, left = await processes.terminate_tree(processes.TreeId(proc.pid, proc.pid, "tok-e"), w.exited, 10)
    assert graceful and left == []
    assert exits == [processes.ExitStatus(signal=signal.SIGTERM)]
    assert time.monotonic() - began < 9  # did not wait for the deadline

    stubborn = processes.launch(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(600)",
        ],
        str(tmp_path / "f.log"),
        token="tok-f",
    )
    await async_wait_for(lambda: "ready" in open(tmp_path / "f.log").read().splitlines(), timeout=20)
    w, exits = await watch(stubborn)
    graceful, left = await processes.terminate_tree(
        processes.TreeId(stubborn.pid, stubborn.pid, "tok-f"), w.exited, 0.5
    )
    assert not graceful and left == []
    assert exits == [processes.ExitStatus(signal=signal.SIGKILL)]


# A leader that starts one child the way `mode` says, prints its pid, then exits (or stays, for
# "walk"). The child is then findable by one of find_tree's searches only:
# - group: stays in the leader's process group, without the token; the leader is gone;
# - token: leaves the group (setsid), keeps the token; the leader is gone;
# - walk: leaves the group and drops the token; the leader lives: found as its descendant;
# - remembered: leaves the group and drops the token; the leader is gone: found only because
#   it was remembered while the leader lived.
LEADER = r"""
import os, subprocess, sys, time
mode = sys.argv[1]
env = dict(os.environ)
if mode != "token":
    env.pop("MOTOR_PROCESS_TOKEN")
escape = "os.setsid(); " if mode != "group" else ""
code = f"import os, time; {escape}print('ready', flush=True); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", code], env=env)
print("children", child.pid, flush=True)
if mode in ("walk", "remembered"):
    time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["group", "token", "walk", "remembered"])
@pytest.mark.processes
async def test_each_search_of_a_tree_finds_what_only_it_can(tmp_path, mode):
    log = str(tmp_path / "leader.log")
    token = f"tok-{mode}"
    leader = processes.launch([sys.executable, "-c", LEADER, mode], log, token=token)
    tree = processes.TreeId(leader.pid, leader.pid, token, processes.create_time(leader.pid))
    (child,) = await async_wait_for(lambda: children_from_log(log), timeout=20, what="the child started")
    try:
        await async_wait_for(lambda: "ready" in open(log).read().split(), timeout=20, what="the child set up")
        remembered = processes.descendants(leader.pid) if mode == "remembered" else []
        if mode == "remembered":
            assert child in [pid for pid, _ in remembered]
        if mode in ("group", "token", "remembered"):
            os.kill(leader.pid, signal.SIGKILL)
            leader.wait(10)
            assert psutil.Process(child).ppid() != leader.pid  # re-parented: no walk reaches it
        # The child is what the mode says (so that only one search can find it).
        in_group = os.getpgid(child) == leader.pid
        has_token = psutil.Process(child).environ().get(processes.TOKEN_ENV) == token
        assert (in_group, has_token) == (mode == "group", mode == "token")

        assert child in {p.pid for p in processes.find_tree(tree, remembered)}
        assert await processes.kill_tree_confirmed(tree, remembered) == []
        assert not processes.same_process(child, None)
    finally:
        for pid in (child, leader.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leader.wait(10)
