#!/usr/bin/env python3
"""What the engine server costs over plain `vllm serve`: same tiny model, same vLLM settings.

Starts both (one after the other, each timed from process start to GET /health 200), then drives
/v1/completions at a fixed concurrency in alternating rounds (engine server, vllm serve, ...) so
that drift on a shared machine hits both alike, and prints requests/s, median and p99 latency
of each side by side with their ratio. The engine server runs as in production: virtual
inference on (a probe every 5 s), its gRPC plane up, its metrics and the probe filter in place.

    .venv/bin/python bench/engine_server_vs_vllm.py [--rounds 6] [--round-seconds 4] [--concurrency 4] [--startups 1]

Needs the vLLM CPU build and the `vllm` command (python scripts/vllm-shim.py). About 1-2 min.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import aiohttp  # noqa: E402

from motor.ports import free_port  # noqa: E402
from motorctl.tiny_model import LEAN_CPU_ARGS, ensure_tiny_model  # noqa: E402
from tests.support.vllm_engines import offline_vllm_env  # noqa: E402

VENV_BIN = os.path.join(REPO_ROOT, ".venv", "bin")


def vllm_flags(args: dict) -> list[str]:
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


class Peer:
    def __init__(self, name: str, command: list[str], port: int, env: dict, log: str):
        self.name, self.command, self.port, self.env, self.log_path = name, command, port, env, log
        self.process: subprocess.Popen | None = None
        self.startups: list[float] = []

    @property
    def startup_s(self) -> float:
        return statistics.median(self.startups) if self.startups else float("nan")

    def start(self, timeout: float = 300) -> None:
        log = open(self.log_path, "wb")
        started = time.monotonic()
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        self.startups.append(time.monotonic() - started)
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


async def drive(
    port: int, model: str, seconds: float, concurrency: int, max_tokens: int
) -> tuple[int, float, list[float]]:
    """Closed loop: `concurrency` clients send completions for `seconds`. Returns (done, elapsed, latencies)."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True}
    latencies: list[float] = []
    errors = 0

    async def client(session: aiohttp.ClientSession, end: float) -> None:
        nonlocal errors
        while time.monotonic() < end:
            sent = time.monotonic()
            async with session.post(url, json=body) as response:
                await response.read()
                if response.status != 200:
                    errors += 1
                    continue
            latencies.append(time.monotonic() - sent)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        end = started + seconds
        await asyncio.gather(*(client(session, end) for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    if errors:
        raise RuntimeError(f"{errors} requests failed on port {port}")
    return len(latencies), elapsed, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="load rounds per side (alternating)")
    parser.add_argument("--round-seconds", type=float, default=4.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--startups", type=int, default=1, help="start-ups per side, alternating (median shown)")
    options = parser.parse_args()

    if not os.path.exists(os.path.join(VENV_BIN, "vllm")) or not shutil.which("engine_server", path=VENV_BIN):
        print("needs .venv/bin/vllm (python scripts/vllm-shim.py) and .venv/bin/engine_server", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="motor-bench-vllm-")
    model = ensure_tiny_model(os.path.join(work, "tiny-llama"))
    env = {**os.environ, **offline_vllm_env(os.path.join(work, "cache"))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)

    es_port, es_mgmt, vllm_port = free_port(), free_port(), free_port()
    config = {
        "motor_engine_union_config": {
            "engine_type": "vllm",
            "engine_args": {"model": model, **LEAN_CPU_ARGS},
            "health_check_config": {"enable_virtual_inference": True},
        }
    }
    config_path = os.path.join(work, "user_config.json")
    with open(config_path, "w") as handle:
        json.dump(config, handle)
    engine_server = Peer(
        "engine_server",
        [
            os.path.join(VENV_BIN, "engine_server"),
            "--dp-rank",
            "0",
            "--instance-id",
            "bench-0",
            "--role",
            "union",
            "--host",
            "127.0.0.1",
            "--port",
            str(es_port),
            "--mgmt-port",
            str(es_mgmt),
            "--master-dp-ip",
            "127.0.0.1",
            "--config-path",
            config_path,
            "--log-dir",
            os.path.join(work, "logs"),
        ],  # fmt: skip
        es_port,
        env,
        os.path.join(work, "engine_server.out"),
    )
    plain = Peer(
        "vllm serve",
        [
            os.path.join(VENV_BIN, "vllm"),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(vllm_port),
            *vllm_flags(LEAN_CPU_ARGS),
        ],  # fmt: skip
        vllm_port,
        env,
        os.path.join(work, "vllm_serve.out"),
    )
    peers = [engine_server, plain]
    try:
        for repeat in range(options.startups):
            for peer in peers if repeat % 2 == 0 else list(reversed(peers)):
                if repeat:
                    peer.stop()  # one instance of each at a time: the last one takes the load
                print(f"starting {peer.name} ...", flush=True)
                peer.start()
                print(f"  /health 200 after {peer.startups[-1]:.1f} s", flush=True)
        # Arm virtual inference as the node manager's first heartbeat does.
        subprocess.run(
            [
                os.path.join(VENV_BIN, "grpcurl"),
                "-plaintext",
                f"127.0.0.1:{es_mgmt}",
                "motor.v1.EngineService/GetStatus",
            ],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        for peer in peers:  # warm-up
            asyncio.run(drive(peer.port, model, 2.0, options.concurrency, options.max_tokens))
        results = {peer.name: {"done": 0, "elapsed": 0.0, "latencies": [], "rounds": []} for peer in peers}
        for round_index in range(options.rounds):
            order = peers if round_index % 2 == 0 else list(reversed(peers))
            for peer in order:
                done, elapsed, latencies = asyncio.run(
                    drive(peer.port, model, options.round_seconds, options.concurrency, options.max_tokens)
                )
                result = results[peer.name]
                result["done"] += done
                result["elapsed"] += elapsed
                result["latencies"] += latencies
                result["rounds"].append(done / elapsed)
                print(f"  round {round_index + 1} {peer.name}: {done / elapsed:.1f} req/s", flush=True)
    finally:
        for peer in peers:
            peer.stop()

    print()
    print(
        f"tiny Llama (2 layers, {LEAN_CPU_ARGS['dtype']}), /v1/completions max_tokens={options.max_tokens}, "
        f"concurrency {options.concurrency}, {options.rounds} x {options.round_seconds:g} s per side, "
        f"{os.cpu_count()} CPUs, start-up: median of {options.startups}"
    )
    print(f"{'':16}{'start-up s':>12}{'req/s':>10}{'median ms':>12}{'p99 ms':>10}{'requests':>10}")
    rows = {}
    for peer in peers:
        result = results[peer.name]
        rps = result["done"] / result["elapsed"]
        median = statistics.median(result["latencies"]) * 1000
        p99 = percentile(result["latencies"], 0.99) * 1000
        rows[peer.name] = (peer.startup_s, rps, median, p99)
        print(f"{peer.name:16}{peer.startup_s:12.1f}{rps:10.1f}{median:12.1f}{p99:10.1f}{result['done']:10d}")
    es, vl = rows["engine_server"], rows["vllm serve"]
    print(f"{'ratio es/vllm':16}{es[0] / vl[0]:12.2f}{es[1] / vl[1]:10.3f}{es[2] / vl[2]:12.3f}{es[3] / vl[3]:10.3f}")
    # Each engine-server round next to the plain round run right before or after it: on a shared
    # machine the load drifts, and neighbouring rounds see about the same.
    paired = [a / b for a, b in zip(results["engine_server"]["rounds"], results["vllm serve"]["rounds"])]
    print(
        f"paired round ratios es/vllm: {' '.join(f'{r:.2f}' for r in paired)}; median {statistics.median(paired):.3f}"
    )
    overhead = (1 - statistics.median(paired)) * 100
    print(f"engine server throughput cost (median paired round): {overhead:+.1f}% (goal: under 2%)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
