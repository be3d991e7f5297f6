"""SGLang (engine_type "sglang"): `python -m sglang.launch_server` as a child process.

The child serves SGLang's own OpenAI-compatible API on --port; the engine server probes it over
HTTP like any engine. The child runs in its own process group (so the whole SGLang tree is stopped
with one signal) and gets SIGKILL from the kernel if the engine server dies (PR_SET_PDEATHSIG), so a
killed engine server never leaves SGLang holding the accelerators.

Argument mapping (engine_args -> SGLang flags):
  model_path -> --model-path, served_model_name -> --served-model-name, tp_size -> --tp-size,
  mem_fraction_static -> --mem-fraction-static, context_length -> --context-length,
  trust_remote_code -> --trust-remote-code, transfer_backend -> --disaggregation-transfer-backend,
  extra_args -> appended verbatim;
  --host/--port from the command line; role prefill/decode -> --disaggregation-mode prefill/decode;
  --kv-port (prefill) -> --disaggregation-bootstrap-port; --dp-rpc-port -> --dist-init-addr
  <master_dp_ip>:<dp_rpc_port>; --enable-metrics always.
`launcher` replaces `python -m sglang.launch_server` (a wrapper script, a container entry point).

The engines' key (motor/engine_key.py), when Motor holds one, becomes SGLang's `api_key`, so that
SGLang's own HTTP layer answers 401 to a caller without it. It never goes on the command line
(every user of the host reads those): it is written, 0600 in a folder of the engine server's own,
to a YAML file SGLang reads with `--config` (keys of that file become flags; SGLang 0.5.23's
server_args_config_parser), and the folder is removed when SGLang exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile

from engine_server.engines.base import EngineBackend, EngineOptions
from motor.contract.engine_args import SglangArgs
from motor.contract.exits import describe_returncode
from motor.engine_key import engine_key

logger = logging.getLogger(__name__)

# Runs in the child before exec: die with the parent (SIGKILL on its death), and exit at once when
# the parent already died before prctl took effect.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "parent = int(sys.argv[1])\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != parent: sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def sglang_command(args: SglangArgs, options: EngineOptions) -> list[str]:
    """The SGLang command line for this engine (see the module docstring for the mapping)."""
    command = [*args.launcher, "--model-path", args.model_path, "--host", options.host, "--port", str(options.port)]
    if args.served_model_name:
        command += ["--served-model-name", args.served_model_name]
    if args.tp_size != 1:
        command += ["--tp-size", str(args.tp_size)]
    if args.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(args.mem_fraction_static)]
    if args.context_length is not None:
        command += ["--context-length", str(args.context_length)]
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    if options.role in ("prefill", "decode"):
        command += ["--disaggregation-mode", options.role]
        if args.transfer_backend:
            command += ["--disaggregation-transfer-backend", args.transfer_backend]
        if options.role == "prefill" and options.kv_port:
            command += ["--disaggregation-bootstrap-port", str(options.kv_port)]
    if options.dp_rpc_port:
        command += ["--dist-init-addr", f"{options.master_dp_ip}:{options.dp_rpc_port}"]
    command.append("--enable-metrics")
    return command + list(args.extra_args)


def write_key_config(key: str) -> str:
    """A YAML file, readable by this user alone in a folder of its own, that gives SGLang `key` as
    its api_key; returns its path (SGLang wants a .yaml suffix)."""
    folder = tempfile.mkdtemp(prefix="motor-sglang-")  # 0700
    path = os.path.join(folder, "engine-key.yaml")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as held:
        held.write(f"api-key: {json.dumps(key)}\n")  # a JSON string is a YAML string
    return path


def describe_exit(returncode: int) -> str:
    return f"SGLang {describe_returncode(returncode)}"


class SglangEngine(EngineBackend, engine_type="sglang", args_model=SglangArgs):
    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.command = sglang_command(self.args, options)
        self.process: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Task | None = None
        self._key_config: str | None = None

    async def start(self) -> None:
        command = self.command
        key = engine_key()
        if key:
            self._key_config = write_key_config(key)
            command = [*command, "--config", self._key_config]
        launch = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
        logger.info("starting SGLang: %s", " ".join(command))
        try:
            self.process = await asyncio.create_subprocess_exec(*launch, start_new_session=True)
        except OSError as exc:
            self._forget_key()
            raise RuntimeError(f"cannot start SGLang ({command[0]}): {exc.strerror}") from None
        self._exited = asyncio.ensure_future(self.process.wait())
        self._exited.add_done_callback(lambda _: self._forget_key())
        logger.info("SGLang pid %d (own process group)", self.process.pid)

    def _forget_key(self) -> None:
        if self._key_config:
            shutil.rmtree(os.path.dirname(self._key_config), ignore_errors=True)
            self._key_config = None

    async def wait_dead(self) -> str:
        assert self._exited is not None, "start() first"
        return describe_exit(await asyncio.shield(self._exited))

    async def shutdown(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(self.args.stop_timeout):
                await asyncio.shield(self._exited)
        except TimeoutError:
            logger.warning("SGLang did not stop within %gs of SIGTERM: SIGKILL", self.args.stop_timeout)
        # The main process may be gone while its workers linger: end the whole group.
        self._signal_group(signal.SIGKILL)
        await asyncio.shield(self._exited)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass
