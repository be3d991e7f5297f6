"""Stands in for `python -m sglang.launch_server` (SGLang is not installed here): it records its
command line, serves the simulated engine's API on --host/--port, and behaves like a server process
(stops on SIGTERM; FAKE_SGLANG_IGNORE_TERM=1 makes it ignore SIGTERM; it starts a worker child in
its process group as SGLang does)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    state = os.environ["FAKE_SGLANG_STATE"]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(state, "launch.json"), "w") as handle:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "worker_pid": worker.pid,
                   "pgid": os.getpgid(0), "ppid": os.getppid()}, handle)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if os.environ.get("FAKE_SGLANG_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    engine = SimEngine(EngineOptions(role="union", instance_id="fake", dp_rank=0, host=args.host, port=args.port,
                                     master_dp_ip=args.host, engine_args={"model": args.model_path, "utilization": 1}))
    await engine.start()
    await stop.wait()
    await engine.shutdown()
    worker.terminate()


if __name__ == "__main__":
    asyncio.run(main())
