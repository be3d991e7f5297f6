"""Failover of a SIGKILLed engine: the node manager vs supervisord, side by side in one run.

Runs the simulated engine (`engine_server`, engine_type sim) under
- Motor's node manager (the NodeManager class in this process). The node manager itself never
  restarts an engine (the controller decides); here a hook on its WatchEngines feed
  (`NodeManager.watch()`, what the WatchEngines RPC streams) starts the replacement with a higher
  generation as soon as the engine is reported FAILED, as the controller would;
- supervisord (PyPI `supervisor`) with autorestart, the same command and config.
Kills alternate between the two, each engine killed with SIGKILL once it is NORMAL and idle.

Prints median and p99 of
- exit noticed: SIGKILL -> the supervisor knows (node manager: its pidfd reader fired and waitid
  confirmed; supervisord: the time on its "exited:" log line, millisecond resolution);
- replacement running: SIGKILL -> a new engine process exists (node manager: StartEngine of the
  replacement returned, the process exec'd; supervisord: a new child seen by a 1 ms poll);
- replacement NORMAL: SIGKILL -> the new engine answers NORMAL (node manager: its state is
  RUNNING, seen on the watch feed; supervisord has no health notion: a 10 ms GetStatus poll);
and the ratio supervisord / node manager; then the kernel's floor for the same kill (a bare pidfd
and select(), no supervisor); then starts the real `motor-node-manager` with 8 engines and prints
its idle CPU and memory.

    .venv/bin/python bench/node_manager_failover.py [--kills 20] [--idle-seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from motor import processes  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motor.service.grpc_server import aio_channel  # noqa: E402
from motor.v1 import engine_pb2, engine_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc, types_pb2  # noqa: E402
from node_manager.config import NodeManagerConfig  # noqa: E402
from node_manager.manager import NodeManager  # noqa: E402

BIN = os.path.dirname(sys.executable)
ENGINE_SERVER = os.path.join(BIN, "engine_server")
USER_CONFIG = {
    "motor_engine_prefill_config": {
        "engine_type": "sim",
        "engine_args": {"model": "sim-tiny"},
        "health_check_config": {"enable_virtual_inference": True},
    }
}
RUNNING, FAILED = types_pb2.ENGINE_STATE_RUNNING, types_pb2.ENGINE_STATE_FAILED


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


async def is_normal(stub, timeout: float = 0.5) -> bool:
    try:
        reply = await stub.GetStatus(engine_pb2.GetStatusRequest(), timeout=timeout)
        return reply.status.status == types_pb2.HEALTH_STATUS_NORMAL
    except grpc.aio.AioRpcError:
        return False


async def wait_until(predicate, timeout: float, interval: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class NodeManagerSide:
    """The node manager with a restart hook on its watch feed."""

    def __init__(self, workdir: str, config_path: str):
        self.config = NodeManagerConfig(
            node_id="bench",
            listen="127.0.0.1:0",
            state_dir=os.path.join(workdir, "nm"),
            accelerators=[0],
            port_range="47000-47099",
            engine_command=ENGINE_SERVER,
        )
        self.manager = NodeManager(self.config)
        self.spec = types_pb2.EngineSpec(
            instance_id="bench-0", role=types_pb2.ROLE_PREFILL, config_path=config_path, accelerator_ids=[0]
        )
        self.generation = 0
        self.restarted_at: dict[int, float] = {}  # failed generation -> its replacement launched
        self.normal_at: dict[int, float] = {}  # generation -> RUNNING seen
        self.results: dict[str, list[float]] = {"noticed": [], "running": [], "normal": []}

    async def start(self) -> None:
        await self.manager.start()
        self._hook = asyncio.get_running_loop().create_task(self._restart_hook())
        await self._launch()

    async def _launch(self) -> types_pb2.EngineSpec:
        self.generation += 1
        spec = types_pb2.EngineSpec()
        spec.CopyFrom(self.spec)
        spec.generation = self.generation
        return await self.manager.start_engine(spec)

    async def _restart_hook(self) -> None:
        # What a controller does on an ENGINE_FAILED report, without the network hop.
        async for engine, snapshot in self.manager.watch():
            if engine.state == FAILED and not snapshot:
                await self._launch()
                self.restarted_at[engine.spec.generation] = time.monotonic()
            elif engine.state == RUNNING:
                self.normal_at.setdefault(engine.spec.generation, time.monotonic())

    def current(self):
        return self.manager.records["bench-0/rank0"]

    async def kill_once(self) -> None:
        record = self.current()
        generation = record.generation
        await wait_until(lambda: generation in self.normal_at, 60, 0.01, "engine RUNNING")
        await asyncio.sleep(0.5)  # idle
        killed = time.monotonic()
        os.kill(record.pid, signal.SIGKILL)
        await wait_until(lambda: generation in self.restarted_at, 30, 0.001, "replacement launched")
        await wait_until(lambda: generation + 1 in self.normal_at, 60, 0.005, "replacement RUNNING")
        self.results["noticed"].append(record.watch.noticed_at - killed)
        self.results["running"].append(self.restarted_at[generation] - killed)
        self.results["normal"].append(self.normal_at[generation + 1] - killed)

    async def close(self) -> None:
        self._hook.cancel()
        for record in self.manager.active_engines():
            await self.manager.stop_engine(record.engine_id, deadline=5)
        await self.manager.close()


class SupervisordSide:
    """supervisord supervising the same engine command with autorestart."""

    def __init__(self, workdir: str, config_path: str):
        self.dir = os.path.join(workdir, "supervisord")
        os.makedirs(self.dir)
        self.log = os.path.join(self.dir, "supervisord.log")
        self.mgmt_port = free_port()
        command = (
            f"{ENGINE_SERVER} --dp-rank 0 --instance-id sup-0 --role prefill --host 127.0.0.1 "
            f"--port {free_port()} --mgmt-port {self.mgmt_port} --master-dp-ip 127.0.0.1 "
            f"--config-path {config_path}"
        )
        self.conf = os.path.join(self.dir, "supervisord.conf")
        with open(self.conf, "w") as handle:
            handle.write(f"""[supervisord]
nodaemon=true
logfile={self.log}
pidfile={self.dir}/supervisord.pid
loglevel=info

[unix_http_server]
file={self.dir}/supervisor.sock

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[program:engine]
command={command}
autorestart=true
startsecs=0
startretries=100000
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={self.dir}/engine.log
""")
        self.results: dict[str, list[float]] = {"noticed": [], "running": [], "normal": []}

    async def start(self) -> None:
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "supervisord"), "-c", self.conf],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.channel = aio_channel(f"127.0.0.1:{self.mgmt_port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        await wait_until(self.child, 30, 0.01, "supervisord's child")

    def child(self) -> int | None:
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        alive = [c.pid for c in children if c.status() != psutil.STATUS_ZOMBIE]
        return alive[0] if alive else None

    def exit_logged_at(self, after: float) -> float | None:
        """Wall time of the first 'exited: engine' line logged after `after`."""
        with open(self.log, encoding="utf-8") as handle:
            for line in handle:
                match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ exited: engine", line)
                if match:
                    at = time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000
                    if at >= after - 0.002:  # the log truncates to milliseconds
                        return at
        return None

    async def kill_once(self) -> None:
        await wait_until(lambda: is_normal(self.stub), 60, 0.01, "supervised engine NORMAL")
        await asyncio.sleep(0.5)
        old = self.child()
        killed_wall, killed = time.time(), time.monotonic()
        os.kill(old, signal.SIGKILL)
        await wait_until(lambda: (self.child() or old) != old, 30, 0.001, "supervisord's replacement")
        running = time.monotonic()
        await wait_until(lambda: is_normal(self.stub, 0.2), 60, 0.01, "replacement NORMAL")
        normal = time.monotonic()
        logged = await wait_until(lambda: self.exit_logged_at(killed_wall), 10, 0.05, "supervisord exit log")
        self.results["noticed"].append(max(0.0, logged - killed_wall))
        self.results["running"].append(running - killed)
        self.results["normal"].append(normal - killed)

    async def close(self) -> None:
        await self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            processes.kill_tree(processes.TreeId(self.proc.pid, self.proc.pid))


async def failover(kills: int, workdir: str) -> None:
    config_path = os.path.join(workdir, "user_config.json")
    with open(config_path, "w") as handle:
        json.dump(USER_CONFIG, handle)
    nm, sup = NodeManagerSide(workdir, config_path), SupervisordSide(workdir, config_path)
    await nm.start()
    await sup.start()
    try:
        for i in range(kills):
            await nm.kill_once()
            await sup.kill_once()
            print(
                f"  kill {i + 1}/{kills}: node manager noticed {nm.results['noticed'][-1] * 1000:.2f} ms, "
                f"supervisord {sup.results['noticed'][-1] * 1000:.0f} ms",
                flush=True,
            )
    finally:
        await nm.close()
        await sup.close()
    print(f"\nSIGKILL of an idle simulated engine, {kills} kills each (times from the SIGKILL):")
    print(f"{'':22}{'node manager':>26}{'supervisord':>26}{'supervisord / node manager':>28}")
    print(f"{'':22}{'median':>13}{'p99':>13}{'median':>13}{'p99':>13}{'median':>14}{'p99':>14}")
    labels = {"noticed": "exit noticed", "running": "replacement running", "normal": "replacement NORMAL"}
    for key, label in labels.items():
        a, b = nm.results[key], sup.results[key]
        print(
            f"{label:22}{statistics.median(a) * 1000:10.2f} ms{pct(a, 99) * 1000:10.2f} ms"
            f"{statistics.median(b) * 1000:10.1f} ms{pct(b, 99) * 1000:10.1f} ms"
            f"{statistics.median(b) / statistics.median(a):13.1f}x{pct(b, 99) / pct(a, 99):13.1f}x"
        )
    goals = {"noticed": 0.005, "running": 0.150}
    for key, goal in goals.items():
        verdict = "met" if pct(nm.results[key], 99) < goal else "NOT met"
        print(f"goal: {labels[key]} p99 < {goal * 1000:g} ms: {verdict}")


def kernel_floor(samples: int, workdir: str) -> None:
    """The same SIGKILL seen by a bare pidfd + select() and nothing else: what the kernel takes to
    tear the engine process down (the pidfd turns readable only once it has fully exited)."""
    import select

    config_path = os.path.join(workdir, "user_config.json")
    results: dict[str, list[float]] = {}
    port, mgmt = free_port(), free_port()
    commands = {
        "engine_server (sim)": [
            ENGINE_SERVER,
            "--dp-rank",
            "0",
            "--instance-id",
            "floor-0",
            "--role",
            "prefill",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--mgmt-port",
            str(mgmt),
            "--master-dp-ip",
            "127.0.0.1",
            "--config-path",
            config_path,
        ],
        "python -c sleep": [sys.executable, "-c", "import time; time.sleep(600)"],
    }
    for name, argv in commands.items():
        results[name] = []
        for _ in range(samples):
            proc = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=workdir
            )
            time.sleep(1.5 if "engine" in name else 0.3)
            fd = os.pidfd_open(proc.pid)
            began = time.perf_counter()
            os.kill(proc.pid, signal.SIGKILL)
            select.select([fd], [], [])
            results[name].append(time.perf_counter() - began)
            os.close(fd)
            proc.wait()
    print(f"\nfloor: SIGKILL -> pidfd readable with a bare select() and no supervisor, {samples} kills each:")
    for name, values in results.items():
        print(f"  {name:22} median {statistics.median(values) * 1000:6.2f} ms   p99 {pct(values, 99) * 1000:6.2f} ms")


async def idle_usage(engines: int, seconds: float, workdir: str) -> None:
    state_dir = os.path.join(workdir, "idle")
    argv = [
        os.path.join(BIN, "motor-node-manager"),
        "--node-id",
        "idle",
        "--listen",
        "127.0.0.1:0",
        "--accelerators",
        ",".join(str(i) for i in range(engines)),
        "--port-range",
        "47100-47199",
        "--state-dir",
        state_dir,
        "--engine-command",
        ENGINE_SERVER,
        "--log-level",
        "WARNING",
        "--metrics-port",
        "0",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    port_file = os.path.join(state_dir, "node_manager.port")
    try:
        await wait_until(lambda: os.path.exists(port_file) and open(port_file).read().strip(), 30, 0.05, "port file")
        async with aio_channel(f"127.0.0.1:{int(open(port_file).read())}") as channel:
            stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            config = json.dumps(USER_CONFIG)
            for rank in range(engines):
                spec = types_pb2.EngineSpec(
                    instance_id="idle-0",
                    dp_rank=rank,
                    role=types_pb2.ROLE_PREFILL,
                    config_json=config,
                    accelerator_ids=[rank],
                )
                await stub.StartEngine(node_manager_pb2.StartEngineRequest(spec=spec))

            async def all_running():
                reply = await stub.ListEngines(node_manager_pb2.ListEnginesRequest())
                return all(e.state == RUNNING for e in reply.engines)

            await wait_until(all_running, 120, 0.2, "all engines RUNNING")
            await asyncio.sleep(3)  # let start-up settle
            me = psutil.Process(proc.pid)
            cpu0, t0 = me.cpu_times(), time.monotonic()
            await asyncio.sleep(seconds)
            cpu1, t1 = me.cpu_times(), time.monotonic()
            used = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
            rss = me.memory_info().rss / 2**20
            print(
                f"\nnode manager idle with {engines} NORMAL engines (heartbeat interval 1 s, probe streams open), "
                f"over {seconds:g} s: CPU {100 * used / (t1 - t0):.2f}% of one core, RSS {rss:.0f} MiB"
            )
            for rank in range(engines):
                await stub.StopEngine(node_manager_pb2.StopEngineRequest(engine_id=f"idle-0/rank{rank}"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per supervisor (default 20)")
    parser.add_argument("--floor-kills", type=int, default=10, help="kills for the kernel floor (default 10)")
    parser.add_argument("--idle-engines", type=int, default=8)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="motor-bench-") as workdir:
        began = time.monotonic()
        await failover(args.kills, workdir)
        kernel_floor(args.floor_kills, workdir)
        await idle_usage(args.idle_engines, args.idle_seconds, workdir)
        print(
            f"\n(total {time.monotonic() - began:.0f} s on {psutil.cpu_count()} CPUs, Python {sys.version.split()[0]})"
        )


if __name__ == "__main__":
    asyncio.run(main())
