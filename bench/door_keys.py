"""What API keys, tenant limits and TLS cost the front door: its CPU per request, side by side.

Door processes (front_door/cli.py) in front of one stand-in router (a raw asyncio server in this
process answering every completion at once with a small JSON answer and its `usage`, so that the
door's own work dominates): open (no keys), with keys and limits (`--keys` keys loaded, 10,000 by
default; every request with a key, its tenant's limits checked and its usage read), and each of
those with TLS. The same load goes to each in turn, round after round (`--rounds`): `--concurrency`
clients on kept-alive connections for `--seconds`, together `--rate` requests a second (the same
for every door: CPU per request depends on the rate), every request carrying the same
`Authorization` header (the open door passes it on). For each: requests/s and the door process's
CPU time (user + system, from /proc) per request, in microseconds.

`--nginx` adds nginx (one process, keep-alive to the router, no buffering: bench/front_door.py's
reference hop) in front of the same stand-in router, plain and terminating TLS with the door's
certificate: what TLS costs the cheapest proxy there is, beside what it costs the door.

    .venv/bin/python bench/door_keys.py [--rounds 3] [--seconds 5] [--concurrency 16] [--keys 10000] [--nginx]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import httptools
import psutil
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.front_door import start_nginx  # noqa: E402
from front_door.keys import digest  # noqa: E402
from motor.ports import free_port  # noqa: E402
from motor.security.pki import CertificateAuthority  # noqa: E402

KEY = "sk-motor-bench-0123456789abcdefghijklmnopqrstuv"
BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 4}).encode()
ANSWER = json.dumps(
    {
        "id": "c",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }
).encode()
REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)


class StandInRouter(asyncio.Protocol):
    """Answers every request at once, kept alive."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(REPLY)


def key_file(path: str, count: int) -> None:
    keys = [{"id": "bench-0", "tenant": "bench", "sha256": digest(KEY).hex()}]
    keys += [
        {"id": f"k-{i}", "tenant": f"t{i % 100}", "sha256": digest(f"sk-other-{i}").hex()} for i in range(count - 1)
    ]
    tenants = {f"t{i}": {"models": ["m"]} for i in range(100)}
    # limits high enough never to refuse: their checks are what is measured
    limits = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "concurrent_requests": 10**6}
    tenants["bench"] = {"models": ["m", "m-*"], "limits": limits}
    with open(path, "w") as f:
        yaml.safe_dump({"tenants": tenants, "keys": keys}, f)


class Door:
    def __init__(self, name: str, router_port: int, extra: list[str], log: str) -> None:
        self.name = name
        self.port, self.table = free_port(), free_port()
        argv = [sys.executable, "-m", "front_door", "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--router", f"http://127.0.0.1:{router_port}", "--table", f"127.0.0.1:{self.table}", *extra]
        with open(log, "ab") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.tls = "--tls-cert" in extra
        deadline = time.monotonic() + 30
        while True:
            try:
                body = json.dumps({"served": {"m": None}}).encode()
                put = urllib.request.Request(f"http://127.0.0.1:{self.table}/served", data=body, method="PUT")
                urllib.request.urlopen(put, timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"door {name} did not start; see {log}") from None
                time.sleep(0.1)
        self.rates: list[float] = []
        self.cpu: list[float] = []

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


class Nginx:
    """nginx in front of the stand-in router, measured as a door is."""

    def __init__(self, name: str, work: str, router_port: int, tls: tuple[str, str] | None) -> None:
        self.name, self.tls = name, tls is not None
        self.process, url = start_nginx(work, router_port, tls, name="nginx-tls" if tls else "nginx")
        self.port = int(url.rsplit(":", 1)[1])
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"{name} did not start; see {work}") from None
                time.sleep(0.1)
        self.rates: list[float] = []
        self.cpu: list[float] = []

    cpu_seconds = Door.cpu_seconds
    stop = Door.stop


async def load(
    door: Door | Nginx, seconds: float, concurrency: int, context: ssl.SSLContext | None, rate: float
) -> int:
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: door\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    )
    done = 0
    end = time.monotonic() + seconds

    async def client() -> None:
        nonlocal done
        kwargs = {"ssl": context, "server_hostname": "127.0.0.1"} if door.tls else {}
        reader, writer = await asyncio.open_connection("127.0.0.1", door.port, **kwargs)
        every, due = concurrency / rate if rate else 0.0, time.monotonic()
        while time.monotonic() < end:
            if every:
                due += every
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            done += 1
        writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done


async def main(args) -> None:
    work = tempfile.mkdtemp(prefix="door-keys-bench-")
    router_port = free_port()
    server = await asyncio.get_running_loop().create_server(StandInRouter, "127.0.0.1", router_port)
    keys = os.path.join(work, "keys.yaml")
    key_file(keys, args.keys)
    ca = CertificateAuthority.create()
    ca_path, _ = ca.save(work)
    cert, key = ca.issue(None, hosts=["127.0.0.1"]).save(work, "door")
    context = ssl.create_default_context(cafile=ca_path)
    tls = ["--tls-cert", cert, "--tls-key", key]
    log = os.path.join(work, "doors.log")
    doors = [
        Door("open", router_port, [], log),
        Door(f"keys+limits ({args.keys} keys)", router_port, ["--api-keys", keys], log),
        Door("open, TLS", router_port, tls, log),
        Door("keys+limits, TLS", router_port, ["--api-keys", keys, *tls], log),
    ]
    if args.nginx:
        doors.append(Nginx("nginx", work, router_port, None))
        doors.append(Nginx("nginx, TLS", work, router_port, (cert, key)))
    try:
        for door in doors:  # warm up: imports, connections, first requests
            await load(door, 1.0, args.concurrency, context, args.rate)
        for _ in range(args.rounds):
            for door in doors:
                before = door.cpu_seconds()
                began = time.monotonic()
                done = await load(door, args.seconds, args.concurrency, context, args.rate)
                took = time.monotonic() - began
                door.rates.append(done / took)
                door.cpu.append((door.cpu_seconds() - before) / done * 1e6)
    finally:
        for door in doors:
            door.stop()
        server.close()
    pace = f"{args.rate:g} requests/s" if args.rate else "closed loop"
    print(
        f"{args.rounds} rounds of {args.seconds:g} s at {pace}, {args.concurrency} clients on kept-alive connections, "
        f"{os.cpu_count()} CPUs; medians (each round's figures)"
    )
    print(f"{'door':<34} {'requests/s':>11} {'door CPU µs/request':>21}")
    for door in doors:
        rates = " ".join(f"{r:.0f}" for r in door.rates)
        cpus = " ".join(f"{c:.1f}" for c in door.cpu)
        print(
            f"{door.name:<34} {statistics.median(door.rates):>11.0f} {statistics.median(door.cpu):>21.1f}"
            f"   ({rates}; {cpus})"
        )
    base = statistics.median(doors[0].cpu)
    print(
        f"keys and limits add {statistics.median(doors[1].cpu) - base:.1f} µs of the door's CPU a request; "
        f"TLS adds {statistics.median(doors[2].cpu) - base:.1f} µs (kept-alive connections)"
    )
    if args.nginx:
        plain, tls_hop = (statistics.median(d.cpu) for d in doors[4:6])
        print(f"nginx: {plain:.1f} µs a request, TLS adds {tls_hop - plain:.1f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--nginx", action="store_true", help="nginx in front of the same router, plain and with TLS")
    parser.add_argument(
        "--rate",
        type=float,
        default=1500,
        help="requests/s to each door (0: as fast as each answers); one rate for all, so that each door's CPU per "
        "request is measured at the same load (a door that answers faster batches more events per wake-up)",
    )
    asyncio.run(main(parser.parse_args()))
