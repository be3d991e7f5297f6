"""Process supervision shared by the node manager and the engine server's child engines.

- `launch`: exec a command in its own session/process group with output to a log file, tagged
  with a token in its environment so that its descendants can be found later.
- `ExitWatch`: notices a process's exit without polling (pidfd + event-loop reader) and
  confirms it (waitid on the pidfd for a child, psutil for a process adopted after a restart)
  before calling back with the exit code or signal. A readiness that is not a confirmed exit is
  ignored (vLLM #54184: a spurious sentinel must not kill a healthy engine).
- `find_tree` / `kill_tree_confirmed` / `terminate_tree`: the whole tree of a launched process: its process
  group, its live descendants, processes carrying its token (children that escaped the group
  with setsid keep their environment) and descendants remembered earlier (children re-parented
  to init after their parent died).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from motor.contract.exits import describe_exit
from motor.service.logs import launch_line
from motor.service.tasks import set_within

logger = logging.getLogger(__name__)

# Environment variable carrying a launched process's token; inherited by its descendants.
TOKEN_ENV = "MOTOR_PROCESS_TOKEN"
# Environment variable naming the node an engine was launched for (by whichever node manager).
NODE_ENV = "MOTOR_NODE_ID"
# The state-directory id of the node manager that launched the engine: a takeover kills only
# what the replaced holder left, never the engines of another cluster on this host with the same node id.
HOLDER_ENV = "MOTOR_NODE_STATE_DIR_ID"
# The CPU cores an engine on a `cpu` node owns (comma-separated): the engine server binds its whole
# process to them before anything else runs (engine_server.cli.bind_to_own_cores).
CPUS_ENV = "MOTOR_ENGINE_CPUS"
# psutil create times are rounded (clock ticks); two readings of one process agree within this.
CREATE_TIME_TOLERANCE_S = 0.05


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: an exit code, a signal, or unknown (a process that is not our child)."""

    exit_code: int | None = None
    signal: int | None = None

    def describe(self) -> str:
        if self.signal is None and self.exit_code is None:
            return "exited (exit code unknown: not a child of this process)"
        return describe_exit(self.exit_code, self.signal)


def launch(
    argv: list[str],
    log_path: str,
    env: dict[str, str] | None = None,
    token: str | None = None,
    cwd: str | None = None,
) -> subprocess.Popen:
    """Exec `argv` in a new session (its own process group), stdout and stderr appended to `log_path`.

    Raises OSError (e.g. FileNotFoundError for a missing command) with the command named.
    """
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    if token:
        child_env[TOKEN_ENV] = token
    with open(log_path, "ab", buffering=0) as log:
        log.write((launch_line(argv) + "\n").encode())
        # exec, never a bare fork: gRPC state does not survive fork().
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )


def create_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), or None when it does not exist."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def same_process(pid: int, started: float | None) -> bool:
    """True when `pid` is alive (not a zombie) and is the process that started at `started`
    (guards against pid reuse)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < CREATE_TIME_TOLERANCE_S
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


class ExitWatch:
    """Calls `on_exit(ExitStatus)` once, from the event loop, when process `pid` has exited.

    `popen` given: the process is our child; the exit is confirmed and reaped with waitid on its
    pidfd and the code or signal recorded (and `popen.returncode` set). Otherwise (a process
    adopted after a restart) the exit is confirmed with psutil and the code is unknown.
    """

    def __init__(
        self,
        pid: int,
        on_exit: Callable[[ExitStatus], None],
        popen: subprocess.Popen | None = None,
        started: float | None = None,
    ):
        self.pid = pid
        self.on_exit = on_exit
        self.popen = popen
        self.started = started
        self.status: ExitStatus | None = None
        self.noticed_at: float | None = None  # time.monotonic() when the exit was noticed and confirmed
        self.exited = asyncio.Event()
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            # Already gone (and reaped, or never ours): confirm on the next loop turn.
            self._loop.call_soon(self._readable)
            return
        self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        if self.status is not None:
            return
        status = self.confirm()
        if status is None:
            logger.warning("pid %d: exit notice without a confirmed exit; still watching", self.pid)
            return
        self.status, self.noticed_at = status, time.monotonic()
        self.close()
        self.exited.set()
        self.on_exit(status)

    def confirm(self) -> ExitStatus | None:
        """The exit status when the process has really exited, None while it runs."""
        if self.popen is not None:
            try:
                if self._fd is not None:
                    result = os.waitid(os.P_PIDFD, self._fd, os.WEXITED | os.WNOHANG)
                else:
                    result = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                # Reaped by someone else (e.g. Popen.poll): use what Popen recorded, if anything.
                code = self.popen.returncode
                if code is None:
                    return ExitStatus()
                return ExitStatus(signal=-code) if code < 0 else ExitStatus(exit_code=code)
            if result is None:
                return None
            if result.si_code == os.CLD_EXITED:
                status = ExitStatus(exit_code=result.si_status)
                self.popen.returncode = result.si_status
            else:
                status = ExitStatus(signal=result.si_status)
                self.popen.returncode = -result.si_status
            return status
        return None if same_process(self.pid, self.started) else ExitStatus()

    def close(self) -> None:
        if self._fd is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class TreeId:
    """What identifies the processes of one launched command."""

    pid: int
    pgid: int
    token: str | None = None
    # Create time of the launched process: its descendants are younger, so older processes'
    # environments need not be read (keeps a scan well under a millisecond on a busy host).
    started: float | None = None


def _proc_key(proc: psutil.Process) -> tuple[int, float] | None:
    try:
        return proc.pid, proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def descendants(pid: int) -> list[tuple[int, float]]:
    """(pid, create time) of the live descendants of `pid`, to remember for a later tree kill."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
    return [key for key in map(_proc_key, children) if key is not None]


def find_tree(tree: TreeId, remembered: Iterable[tuple[int, float]] = ()) -> list[psutil.Process]:
    """Every live (non-zombie) process of the tree, never this process or its own group."""
    me, my_group = os.getpid(), os.getpgid(0)
    found: dict[int, psutil.Process] = {}

    def add(proc: psutil.Process) -> None:
        try:
            if proc.pid != me and proc.status() != psutil.STATUS_ZOMBIE:
                found.setdefault(proc.pid, proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass

    for proc in psutil.process_iter():
        try:
            if tree.pgid > 0 and tree.pgid != my_group and os.getpgid(proc.pid) == tree.pgid:
                add(proc)
            elif (
                tree.token
                and (tree.started is None or proc.create_time() >= tree.started - CREATE_TIME_TOLERANCE_S)
                and proc.environ().get(TOKEN_ENV) == tree.token
            ):
                add(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    for pid, started in remembered:
        if same_process(pid, started):
            add(psutil.Process(pid))
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                add(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return list(found.values())


def node_tokens(node_id: str, holder: str = "") -> set[str]:
    """Tokens of the live processes launched for `node_id` on this host (as far as this process
    can see: another container's processes are not visible)."""
    tokens: set[str] = set()
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ProcessLookupError):
            continue
        # Engines without a holder id come from an older node manager: the node id alone decides.
        if (
            env.get(NODE_ENV) == node_id
            and env.get(TOKEN_ENV)
            and (not holder or env.get(HOLDER_ENV, holder) == holder)
        ):
            tokens.add(env[TOKEN_ENV])
    return tokens


def kill_tree(
    tree: TreeId, sig: int = signal.SIGKILL, remembered: Iterable[tuple[int, float]] = ()
) -> list[psutil.Process]:
    """Send `sig` to the whole tree; returns the processes signalled."""
    # Members are signalled one by one (no killpg): a group id can be reused once the group is
    # empty, and find_tree has checked each member.
    procs = find_tree(tree, remembered)
    for proc in procs:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return procs


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


async def wait_gone(procs: Iterable[psutil.Process], timeout: float, interval: float = 0.01) -> list[psutil.Process]:
    """Wait until none of `procs` is alive; returns those still alive after `timeout`."""
    left = [p for p in procs if _alive(p)]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        await asyncio.sleep(interval)
        left = [p for p in left if _alive(p)]
    return left


async def kill_tree_confirmed(
    tree: TreeId, remembered: Iterable[tuple[int, float]] = (), timeout: float = 10.0
) -> list[psutil.Process]:
    """SIGKILL the whole tree until nothing of it is left (new members found are killed too).

    Returns the processes still alive after `timeout` (empty on success)."""
    deadline = time.monotonic() + timeout
    remembered = list(remembered)
    while True:
        procs = await asyncio.to_thread(kill_tree, tree, signal.SIGKILL, remembered)
        left = await wait_gone(procs, max(0.0, deadline - time.monotonic()))
        if left:
            return left
        # A member may have forked between the scan and the kill: scan again.
        if not await asyncio.to_thread(find_tree, tree, remembered) or time.monotonic() >= deadline:
            return await asyncio.to_thread(find_tree, tree, remembered)


async def terminate_tree(
    tree: TreeId,
    exited: asyncio.Event,
    deadline: float,
    remembered: Iterable[tuple[int, float]] = (),
    kill_timeout: float = 10.0,
) -> tuple[bool, list[psutil.Process]]:
    """Graceful stop: SIGTERM to the leader (it shuts its own children down), up to `deadline`
    seconds for the whole tree to exit, then SIGKILL of whatever is left of it.

    `exited` is set when the leader's exit is confirmed (ExitWatch.exited). Returns
    (True when nothing needed SIGKILL, processes still alive at the end: empty on success)."""
    remembered = list(remembered) + descendants(tree.pid)
    end = time.monotonic() + max(0.0, deadline)
    try:
        os.kill(tree.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if await set_within(exited, max(0.0, end - time.monotonic())):
        rest = await asyncio.to_thread(find_tree, tree, remembered)
        rest = await wait_gone(rest, max(0.0, end - time.monotonic()))
        if not rest:
            return True, []
    left = await kill_tree_confirmed(tree, remembered, timeout=kill_timeout)
    return False, left
