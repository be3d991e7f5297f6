"""What one client connection costs a bare gRPC Python server (grpc.aio) in memory, plaintext
against mutual TLS, side by side: the floor under the controller's RSS in bench/controller_scale.py.

The server has no Motor code but its TLS credentials (motor/service/grpc_server.py, the controller's): one
bidirectional-streaming method, served as ControllerService/StreamHeartbeats is (an async
generator answering each message), and nothing else. A client process (also grpc.aio) opens --connections connections
with one stream each, as
node managers do, and sends a heartbeat-sized message on each every --every seconds. Once every
stream has had its first answer and --settle seconds have passed, the server's RSS is read; its
growth over the idle server, per connection, is what gRPC itself (its C-core: the HTTP/2 transport,
the call and its arena, the TLS session and buffers; and grpc.aio's per-call objects) holds for
a connection with one open stream. Both modes run in one invocation, plaintext first, each on a
fresh server; --repeats runs the pair again. Mutual TLS uses ECDSA P-256 certificates from one CA
(motor/security/pki.py), as the controller and node managers do; --option NAME=VALUE adds a gRPC server
option (an integer) to both modes, to see what a C-core setting changes.

    .venv/bin/python bench/grpc_connection_memory.py                       # 2,000 connections
    .venv/bin/python bench/grpc_connection_memory.py --connections 4000 --repeats 2
    .venv/bin/python bench/grpc_connection_memory.py --option grpc.tsi.max_frame_size=4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from motor.ports import free_port  # noqa: E402
from motor.security.pki import CertificateAuthority  # noqa: E402
from motor.service.grpc_server import TlsFiles, channel_credentials, server_credentials  # noqa: E402
from motor.v1 import controller_pb2 as C  # noqa: E402

METHOD = "/motor.v1.ControllerService/StreamHeartbeats"
FLEET = 10_000  # the size the per-connection cost is scaled to (issue 15's goal)


def tls_files(pki: str, name: str, server: bool = False) -> TlsFiles:
    return TlsFiles(
        cert=os.path.join(pki, f"{name}.crt"),
        key=os.path.join(pki, f"{name}.key"),
        ca=os.path.join(pki, "ca.crt"),
        require_client_cert=server,
    )


async def answer(requests, context):
    async for request in requests:
        yield C.StreamHeartbeatsResponse(heartbeat=C.HeartbeatResponse(sequence=request.heartbeat.sequence))


async def serve(port: int, pki: str, options: list[tuple[str, int]]) -> None:
    server = grpc.aio.server(options=options)
    handler = grpc.stream_stream_rpc_method_handler(
        answer,
        request_deserializer=C.StreamHeartbeatsRequest.FromString,
        response_serializer=C.StreamHeartbeatsResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("motor.v1.ControllerService", {"StreamHeartbeats": handler})]
    )
    if pki:
        server.add_secure_port(f"127.0.0.1:{port}", server_credentials(tls_files(pki, "server", server=True)))
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def connect(port: int, pki: str, connections: int, every: float) -> None:
    """`connections` channels of one stream each; prints "open" once every stream has been answered."""
    credentials = channel_credentials(tls_files(pki, "client")) if pki else None
    answered = 0

    async def node(n: int) -> None:
        nonlocal answered
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, as each node has
        channel = (
            grpc.aio.secure_channel(f"localhost:{port}", credentials, options=options)
            if credentials
            else grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        )
        call = channel.stream_stream(
            METHOD,
            request_serializer=C.StreamHeartbeatsRequest.SerializeToString,
            response_deserializer=C.StreamHeartbeatsResponse.FromString,
        )()
        for sequence in range(1, 1_000_000):
            await call.write(
                C.StreamHeartbeatsRequest(
                    heartbeat=C.HeartbeatRequest(node_id=f"node-{n:05d}", generation=1, sequence=sequence)
                )
            )
            await call.read()
            if sequence == 1:
                answered += 1
                await asyncio.sleep(n % 100 / 100 * every)  # spread over the interval
            await asyncio.sleep(every)

    tasks: list[asyncio.Task] = []
    while answered < connections:
        failed = [t for t in tasks if t.done()]
        if failed:
            raise SystemExit(f"a stream ended: {failed[0].exception()!r}")
        if len(tasks) == answered < connections:  # open them 100 at a time, as a fleet comes up
            tasks += [asyncio.create_task(node(n)) for n in range(len(tasks), min(connections, len(tasks) + 100))]
        await asyncio.sleep(0.05)
    print("open", flush=True)
    await asyncio.gather(*tasks)


def make_pki(directory: str) -> None:
    ca = CertificateAuthority.create()
    ca.save(directory)
    ca.issue(None, hosts=["localhost", "127.0.0.1"]).save(directory, "server")
    ca.issue(None, hosts=["client.invalid"]).save(directory, "client")


def wait_for_line(process: subprocess.Popen, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = process.stdout.readline()
        if got.strip() == line:
            return
        if not got and process.poll() is not None:
            raise SystemExit(f"{process.args[2]} ended (rc {process.returncode}) before {line!r}")
    raise SystemExit(f"no {line!r} from {process.args[2]} within {timeout:.0f}s")


def measure(args, pki: str) -> float:
    """Server RSS growth per connection (KiB) for one mode ("" pki: plaintext)."""
    port = free_port()
    me = os.path.abspath(__file__)
    options = json.dumps(args.option)
    server = subprocess.Popen([sys.executable, me, "serve", str(port), pki, options], stdout=subprocess.PIPE, text=True)
    client = None
    try:
        wait_for_line(server, "serving", 30)
        time.sleep(1)
        idle = psutil.Process(server.pid).memory_info().rss
        client = subprocess.Popen(
            [sys.executable, me, "connect", str(port), pki, str(args.connections), str(args.every)],
            stdout=subprocess.PIPE,
            text=True,
        )
        wait_for_line(client, "open", 60 + args.connections / 20)
        time.sleep(args.settle)
        held = psutil.Process(server.pid).memory_info().rss
    finally:
        for process in (client, server):
            if process is not None:
                process.kill()
                process.wait()
    per_connection = (held - idle) / args.connections / 1024
    mode = "mutual TLS" if pki else "plaintext "
    print(
        f"{mode} | {args.connections} connections | server RSS {idle / 2**20:6.1f} MiB idle, {held / 2**20:6.1f} MiB "
        f"with them open | {per_connection:5.1f} KiB per connection | {FLEET:,} connections: "
        f"{per_connection * FLEET / 1024:5.0f} MiB",
        flush=True,
    )
    return per_connection


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        port, pki, options = sys.argv[2:5]
        asyncio.run(serve(int(port), pki, [tuple(o) for o in json.loads(options)]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "connect":
        port, pki, connections, every = sys.argv[2:6]
        asyncio.run(connect(int(port), pki, int(connections), float(every)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between a stream's messages")
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds after every stream is open, before RSS is read"
    )
    parser.add_argument("--repeats", type=int, default=1, help="plaintext and mutual TLS, this many times each")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a gRPC server option with an integer value, for both modes (repeatable)",
    )
    args = parser.parse_args()
    try:
        args.option = [(name, int(value)) for name, _, value in (o.partition("=") for o in args.option)]
    except ValueError:
        parser.error("--option: NAME=VALUE with an integer VALUE")
    if args.connections < 1:
        parser.error("--connections: at least 1")
    print(
        f"bare grpc.aio server (grpcio {grpc.__version__}, Python {sys.version.split()[0]}), one stream per "
        "connection, "
        f"a message every {args.every:g}s; options: {args.option or 'none'}",
        flush=True,
    )
    plain, tls = [], []
    with tempfile.TemporaryDirectory(prefix="motor-grpc-memory-") as pki:
        make_pki(pki)
        for _ in range(args.repeats):
            plain.append(measure(args, ""))
            tls.append(measure(args, pki))
    p, t = statistics.median(plain), statistics.median(tls)
    print(
        f"median of {args.repeats}: plaintext {p:.1f} KiB, mutual TLS {t:.1f} KiB per connection (TLS's own: "
        f"{t - p:.1f} KiB); at {FLEET:,} connections gRPC alone holds {p * FLEET / 1024:.0f} MiB plaintext, "
        f"{t * FLEET / 1024:.0f} MiB with mutual TLS"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
