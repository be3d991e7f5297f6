"""Stands in for `python -m sglang.launch_server` (SGLang is not installed here): it parses its
command line strictly (a flag SGLang does not have exits 2, as SGLang's own parser does), records it,
serves the simulated engine's API on --host/--port, and behaves like a server process (stops on
SIGTERM; FAKE_SGLANG_IGNORE_TERM=1 makes it ignore SIGTERM; it starts a worker child in its process
group as SGLang does)."""

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

SCRIPT = os.path.abspath(__file__)  # run as the launched command: [sys.executable, SCRIPT, ...]


def sglang_parser() -> argparse.ArgumentParser:
    """The SGLang server flags that Motor passes, spelled and typed as SGLang's own ServerArgs fields
    (python/sglang/srt/server_args.py: model_path -> --model-path, ...). Unknown flags and prefixes
    are rejected, so a misspelled flag in Motor's mapping fails the tests instead of passing."""
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--tp-size", type=int)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"])
    parser.add_argument("--disaggregation-transfer-backend")
    parser.add_argument("--disaggregation-bootstrap-port", type=int)
    parser.add_argument("--dist-init-addr")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--log-level")  # what the tests pass through extra_args
    return parser


async def main() -> None:
    args = sglang_parser().parse_args()
    state = os.environ["FAKE_SGLANG_STATE"]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(state, "launch.json"), "w") as handle:
        json.dump(
            {
                "argv": sys.argv[1:],
                "pid": os.getpid(),
                "worker_pid": worker.pid,
                "pgid": os.getpgid(0),
                "ppid": os.getppid(),
            },
            handle,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if os.environ.get("FAKE_SGLANG_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    engine = SimEngine(
        EngineOptions(
            role="union",
            instance_id="fake",
            dp_rank=0,
            host=args.host,
            port=args.port,
            master_dp_ip=args.host,
            engine_args={"model": args.model_path, "utilization": 1},
        )
    )
    await engine.start()
    await stop.wait()
    await engine.shutdown()
    worker.terminate()


if __name__ == "__main__":
    asyncio.run(main())
