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

import yaml

from engine_server.engines.base import EngineOptions
from engine_server.engines.sim import SimEngine
from motor.engine_key import ENGINE_KEY_ENV, ENGINE_KEY_FILE_ENV

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
    parser.add_argument("--api-key")
    return parser


def parse_like_sglang(argv: list[str]) -> argparse.Namespace:
    """SGLang's own handling of `--config FILE.yaml` (server_args_config_parser.py): one at most,
    a .yaml/.yml suffix, each key of the file turned into a flag placed before the command line's
    (which wins)."""
    configs = [i for i, arg in enumerate(argv) if arg == "--config"]
    if len(configs) > 1:
        raise SystemExit("Multiple config files specified! Only one allowed.")
    if configs:
        path = argv[configs[0] + 1]
        if not path.endswith((".yaml", ".yml")):
            raise SystemExit(f"Config file must be YAML format, got: {path}")
        with open(path) as held:
            config = yaml.safe_load(held) or {}
        flags = [item for key, value in config.items() for item in (f"--{key}", str(value))]
        argv = flags + argv[: configs[0]] + argv[configs[0] + 2 :]
    return sglang_parser().parse_args(argv)


async def main() -> None:
    args = parse_like_sglang(sys.argv[1:])
    state = os.environ["FAKE_SGLANG_STATE"]
    # SGLang knows no MOTOR_ENGINE_API_KEY: it checks the key it was given (its api_key), and only it.
    for name in (ENGINE_KEY_ENV, ENGINE_KEY_FILE_ENV):
        os.environ.pop(name, None)
    if args.api_key:
        os.environ[ENGINE_KEY_ENV] = args.api_key
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
