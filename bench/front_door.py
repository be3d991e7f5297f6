"""What the front door (front_door/policy.py) costs: the same load straight to vllm-router and through
the front door in front of it, side by side.

Two simulated engine servers of one model behind a real vllm-router (--enable-igw, as Motor starts
it), the sync keeping it in this process, and the front door in its own (front_door/cli.py), given
the sync's table as motor-router-sync pushes it.
For each target: closed-loop clients (`--concurrency`) for `--seconds`: requests/s, latency p50
and p99 of a completion; then the latency at a fixed open rate low enough for neither to queue.

    .venv/bin/python bench/front_door.py [--rounds 3] [--seconds 8] [--concurrency 32] [--nginx] [--own-core]

`--own-core` runs the door (and nginx) on CPU 1 and everything else (load generator, router,
engines) on CPU 0: the door as a process of its own with a core of its own, as it is deployed;
does it then cap the rate the router alone reaches on the other core?

`--nginx` adds a third target: nginx (one worker, keep-alive to the router, no buffering) as a
plain reverse proxy in front of the same router, the cheapest hop there is: what any layer in
front of the router costs on this machine, whatever it is written in.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from motor.ports import free_port  # noqa: E402
from motor.v1 import controller_pb2, types_pb2  # noqa: E402
from motorctl.router import ROUTER_ENV, router_command  # noqa: E402
from router_sync.admin import RouterAdmin  # noqa: E402
from router_sync.sync import RouterSync  # noqa: E402
from tests.support.engine_server_process import EngineServerProcess, sim_config  # noqa: E402

BODY = {"model": "sim-tiny", "prompt": "hello there", "max_tokens": 4}

NGINX_CONF = """
worker_processes 1;
master_process off;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-body;
  proxy_temp_path {work}/nginx-proxy;
  fastcgi_temp_path {work}/nginx-fastcgi;
  uwsgi_temp_path {work}/nginx-uwsgi;
  scgi_temp_path {work}/nginx-scgi;
  upstream router {{ server 127.0.0.1:{router_port}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port}{ssl} backlog=1024;{certificates}
    location / {{
      proxy_pass http://router;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


def start_nginx(
    work: str, router_port: int, tls: tuple[str, str] | None = None, name: str = "nginx"
) -> tuple[subprocess.Popen, str]:
    """nginx as a plain reverse proxy in front of the router: the reference hop. One process
    (no master), so that its CPU time is that process's; `tls` (certificate, key): HTTPS."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(binary):
        raise SystemExit("--nginx: no nginx binary (apt-get install nginx-light)")
    port = free_port()
    work = os.path.join(work, name)
    os.makedirs(work, exist_ok=True)
    conf = os.path.join(work, "nginx.conf")
    ssl, certificates = "", ""
    if tls:
        ssl = " ssl"
        certificates = f"\n    ssl_certificate {tls[0]};\n    ssl_certificate_key {tls[1]};"
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(work=work, router_port=router_port, port=port, ssl=ssl, certificates=certificates))
    process = subprocess.Popen([binary, "-c", conf, "-p", work], stderr=subprocess.DEVNULL)
    return process, f"{'https' if tls else 'http'}://127.0.0.1:{port}"


async def closed_loop(url: str, seconds: float, concurrency: int) -> tuple[float, list[float], int]:
    """(requests/s, latencies, failures) of `concurrency` clients sending back to back."""
    latencies, failures = [], 0
    end = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client():
            nonlocal failures
            while time.monotonic() < end:
                began = time.monotonic()
                async with session.post(url + "/v1/completions", json=BODY) as reply:
                    await reply.read()
                    if reply.status != 200:
                        failures += 1
                latencies.append(time.monotonic() - began)

        began = time.monotonic()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return len(latencies) / (time.monotonic() - began), latencies, failures


async def open_rate(url: str, rate: float, seconds: float) -> list[float]:
    latencies = []
    async with aiohttp.ClientSession() as session:

        async def one():
            began = time.monotonic()
            async with session.post(url + "/v1/completions", json=BODY) as reply:
                await reply.read()
            latencies.append(time.monotonic() - began)

        tasks = []
        for _ in range(int(rate * seconds)):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
    return latencies


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children so far."""
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
        return total
    except psutil.Error:
        return 0.0


def pct(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


async def main(args) -> None:
    work = tempfile.mkdtemp(prefix="front-door-bench-")
    if args.own_core:
        os.sched_setaffinity(0, {0})  # this process and every process it starts from here on
    from pathlib import Path

    engines = [
        EngineServerProcess(Path(work), sim_config("union", {"latency_ms": 0}), role="union", instance_id=f"u-{i}")
        for i in range(2)
    ]
    router_port = free_port()
    log = open(os.path.join(work, "router.log"), "wb")
    router = subprocess.Popen(
        router_command(router_port, free_port()),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, **ROUTER_ENV),
    )
    router_url = f"http://127.0.0.1:{router_port}"
    admin = RouterAdmin(router_url)
    sync = RouterSync(admin, print, by_model=True)
    door_port = free_port()
    try:
        for engine in engines:
            engine.wait_status(types_pb2.HEALTH_STATUS_NORMAL)
        await asyncio.sleep(1)
        task = asyncio.create_task(sync.run())
        sync.apply(
            controller_pb2.WatchEndpointsResponse(
                snapshot=True,
                added=[
                    controller_pb2.Endpoint(
                        instance_id=f"u-{i}",
                        engine_id=f"u-{i}/rank0",
                        role=types_pb2.ROLE_UNION,
                        url=f"http://127.0.0.1:{e.port}",
                        models=["sim-tiny"],
                    )
                    for i, e in enumerate(engines)
                ],
            )
        )
        while "sim-tiny" not in sync.served():
            await asyncio.sleep(0.05)
        # The front door's own process (front_door/cli.py), as `motorctl up` and compose run it,
        # given the sync's table as motor-router-sync pushes it.
        table = f"127.0.0.1:{free_port()}"
        door_args = ["--listen", f"127.0.0.1:{door_port}", "--router", router_url, "--table", table]
        door = subprocess.Popen(
            [sys.executable, "-m", "front_door.cli", *door_args]
            if args.door_loop == "product"
            else [sys.executable, "-c", DOOR_PROCESS, args.door_loop, *door_args],
            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        door_url = f"http://127.0.0.1:{door_port}"
        if args.own_core:
            os.sched_setaffinity(door.pid, {1})
        await asyncio.sleep(1.5)
        async with aiohttp.ClientSession() as session:
            async with session.put(f"http://{table}/served", json={"served": sync.served()}) as reply:
                assert reply.status == 204, await reply.text()
        parts = {"router": [router.pid], "door": [door.pid], "engines": [e.process.pid for e in engines]}
        targets = {"router alone": router_url, "front door + router": door_url}
        nginx = None
        if args.nginx:
            nginx, targets["nginx + router"] = start_nginx(work, router_port)
            parts["nginx"] = [nginx.pid]
            if args.own_core:
                os.sched_setaffinity(nginx.pid, {1})
            await asyncio.sleep(0.5)
        rates = {name: [] for name in targets}
        latencies = {name: [] for name in targets}
        cpu = {name: dict.fromkeys(parts, 0.0) for name in targets}
        failed = dict.fromkeys(targets, 0)
        for url in targets.values():
            await closed_loop(url, 2, args.concurrency)  # warm up
        # Rounds alternate the two targets: the shared machine's load changes by the minute.
        for _ in range(args.rounds):
            for name, url in targets.items():
                before = {part: sum(cpu_seconds(pid) for pid in pids) for part, pids in parts.items()}
                rate, seen, failures = await closed_loop(url, args.seconds, args.concurrency)
                for part, pids in parts.items():
                    cpu[name][part] += sum(cpu_seconds(pid) for pid in pids) - before[part]
                rates[name].append(rate)
                latencies[name] += seen
                failed[name] += failures
        light = {name: await open_rate(url, args.light_rate, 10) for name, url in targets.items()}
        print(f"\n{'target':<22}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'light p50':>11}{'light p99':>11}{'failed':>8}")
        for name in targets:
            print(
                f"{name:<22}{statistics.median(rates[name]):>8.0f}{pct(latencies[name], 50):>9.2f}"
                f"{pct(latencies[name], 99):>9.2f}{pct(light[name], 50):>11.2f}{pct(light[name], 99):>11.2f}"
                f"{failed[name]:>8}"
            )
        alone = statistics.median(rates["router alone"])
        for name in list(targets)[1:]:
            ratios = ", ".join(f"{r / a:.0%}" for r, a in zip(rates[name], rates["router alone"], strict=True))
            print(f"{name} / router alone: {statistics.median(rates[name]) / alone:.0%} (by round: {ratios})")
        for name in targets:
            count = len(latencies[name])
            per = "  ".join(f"{part} {1e6 * used / count:.0f}" for part, used in cpu[name].items())
            print(f"{name}: req/s per round {', '.join(f'{r:.0f}' for r in rates[name])}; CPU µs per request: {per}")
        print(
            f"(closed loop: {args.concurrency} clients, {args.rounds} x {args.seconds:g} s per target, median "
            f"req/s; light: {args.light_rate:g} req/s open loop, 10 s)"
        )
        door.terminate()
        door.wait()
        if nginx is not None:
            nginx.terminate()
            nginx.wait()
        task.cancel()
    finally:
        await admin.close()
        router.kill()
        for engine in engines:
            engine.stop()


# The front door's process on another event loop than its own default (--door-loop).
DOOR_PROCESS = """
import asyncio, sys
from front_door import cli as door
args = door.parse(sys.argv[2:])
if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(door.serve(args))
else:
    asyncio.run(door.serve(args))
"""


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8, help="seconds of each closed-loop round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--door-loop",
        choices=("product", "asyncio", "uvloop"),
        default="product",
        help="the door's event loop: its own default (product), or one forced",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--nginx", action="store_true", help="also nginx as a plain proxy in front of the router")
    parser.add_argument("--own-core", action="store_true", help="the door (and nginx) on CPU 1, all else on CPU 0")
    parser.add_argument("--light-rate", type=float, default=50, help="requests/s of the latency-only run")
    asyncio.run(main(parser.parse_args()))
