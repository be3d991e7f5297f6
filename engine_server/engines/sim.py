"""The simulated engine (engine_type "sim"): an OpenAI-compatible server without a GPU, with faults.

Routes on the inference plane (--port):
  POST /v1/completions, POST /v1/chat/completions   deterministic answers derived from the prompt
                                                     (`"stream": true` gives server-sent events)
                                                     a completion's prompt may be token ids
  GET  /v1/models, GET /health, GET /metrics         (/metrics also carries the engine server's own)
  GET  /sim/faults                                   the current faults
  POST /sim/faults   {"fail_inference": true, ...}   change some faults now (unknown keys: 400)
  DELETE /sim/faults                                 back to the faults from the config

Faults (engine_args.faults in the user_config, or at run time):
  crash           the engine dies: the engine server reports ABNORMAL and exits non-zero
  crash_after_s   (config only) die that many seconds after start
  hang            inference and /health stop answering (until hang is set false)
  hang_inference  completions (probes too) never answer while /health stays 200 and the
                  utilization figure stays as it was: a hung engine core behind a live API
                  server, the failure only probes and the engine's progress can see
  fail_inference  completions answer 500 while /health stays 200
  latency_ms      every completion takes this long (generating: progress every 50 ms)
  utilization     the simulated accelerator utilization (percent) the engine server samples

Tokens (sim_tokens.py): a prompt is tokenized (whitespace words), and a deterministic "model" makes
each next token id from all the ids so far, so an answer continued from its prompt's ids and the ids
already sent is the rest of the uninterrupted answer, on any sim engine. Token by token over time:
engine_args.decode_ms_per_token (0 = every token at once, after latency_ms) makes one token (one
streamed chunk) every that many ms. The requests' fields (sim_request.py) and the answers (vLLM's
wire format: return_token_ids, logprobs, stream_options.include_usage, error bodies) are
sim_answers.py. A stream cut by the engine's death (or a fault) just stops, without [DONE].

Prefill/decode: a request with `kv_transfer_params` is one leg of a disaggregating router's flow
(sim_pd.py): the prefill leg answers where its KV cache is, the decode leg skips the prefill.
Prefix cache (sim_prefix_cache.py): the prefill pays only for the tokens not cached; its KV events
go out in vLLM's ZMQ format (sim_kv_events.py).

Probes (the engine server's own request ids, see engines.base.is_probe_request_id) are served but
kept out of the sim:* counters, as the engine server's patch does for vLLM. Given the engines' key
(motor/engine_key.py), a request under /v1/ or for inference without it is answered 401.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine_server import metrics as server_metrics
from engine_server.engines import sim_pd
from engine_server.engines.admission import (
    Admission,
    HeldRequest,
    failed_back_first,
    is_inference_request,
)
from engine_server.engines.base import (
    EngineBackend,
    EngineOptions,
    UtilizationSampler,
    is_probe_request_id,
)
from engine_server.engines.sim_answers import DONE, Answer, error, json_body, model_not_found, sse, unavailable
from engine_server.engines.sim_capacity import SimCapacity
from engine_server.engines.sim_faults import FaultRoutes
from engine_server.engines.sim_kv_events import SimKvEvents
from engine_server.engines.sim_lora import SimLoras
from engine_server.engines.sim_metrics import (
    SIM_FAILED,
    SIM_RUNNING,
    VLLM_GENERATION_TOKENS,
    VLLM_ITL,
    VLLM_PROMPT_TOKENS,
    VLLM_SUCCESS,
    VLLM_TTFT,
    count_success,
)
from engine_server.engines.sim_prefix_cache import SimPrefixCache
from engine_server.engines.sim_request import SimRequest, parse
from engine_server.engines.sim_tokens import Model
from motor.contract.engine_args import SimArgs, SimFaults
from motor.engine_key import UNAUTHORIZED_BODY

logger = logging.getLogger(__name__)

SIM_STEP_S = 0.05  # one simulated scheduler step of a prefill
TOKENS_PER_YIELD = 32  # tokens made (and chunks written) between two yields of the event loop
HELD = web.RequestKey("held", HeldRequest)  # the client request's place in the admission (admission.py)


class _SimSampler(UtilizationSampler):
    name = "sim"

    def __init__(self, engine: SimEngine):
        self.engine = engine

    async def sample(self) -> float:
        return 0.0 if self.engine.sleeping else max(self.engine.faults.utilization, self.engine.load_utilization())


class SimEngine(EngineBackend, engine_type="sim", can_sleep=True, args_model=SimArgs):
    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.faults = self._initial_faults()
        self.sleeping = False
        self.sleep_level = 0
        # Drain and not-serving refusals, and fail-backs of held requests (admission.py), as with vLLM.
        self.admission = Admission()
        self._in_flight = 0
        self._progress = 0  # scheduler steps and tokens for client requests (probes excluded)
        self._succeeded = self._server_errors = 0  # client requests' outcomes (probes excluded)
        self._prefilling = asyncio.Lock()
        self._started_at = 0.0
        self._died: asyncio.Future[str] | None = None
        self._stopping = False
        self._unhang = asyncio.Event()
        self._inference_unhang = asyncio.Event()  # cleared by hang_inference
        self._runner: web.AppRunner | None = None
        self._crash_timer: asyncio.TimerHandle | None = None
        self.loras = SimLoras(self.args.model)  # adapters loaded at run time (sim_lora.py)
        self.capacity = SimCapacity(self.args.max_num_seqs, self.args.model, str(options.dp_rank))
        self.kv_events: SimKvEvents | None = None  # bound in start(), when kv_events_port is set
        self.prefix = SimPrefixCache(self.args.kv_cache_blocks, self._publish_kv, self._vllm_labels())

    def _initial_faults(self) -> SimFaults:
        base = {"latency_ms": self.args.latency_ms, "utilization": self.args.utilization}
        base.update(self.args.faults.model_dump(exclude_unset=True))
        return SimFaults.model_validate(base)

    # --- EngineBackend ---------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._died = loop.create_future()
        self._started_at = time.monotonic()
        # As vLLM: its request series exist (at zero) from the start, not from the first request.
        for family in (VLLM_TTFT, VLLM_ITL, VLLM_PROMPT_TOKENS, VLLM_GENERATION_TOKENS):
            family.labels(*self._vllm_labels())
        VLLM_SUCCESS.labels(*self._vllm_labels(), "length")
        app = web.Application(middlewares=[self._admit])
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                *FaultRoutes(self).routes(),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),  # (as vLLM's)
                *self.loras.routes(),
            ]
        )
        # handler_cancellation: a client that leaves (its timeout, a router retrying elsewhere)
        # takes its request out of the engine, its seat and the in-flight count, as vLLM aborts it.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise RuntimeError(
                f"sim engine cannot listen on {self.options.host}:{self.options.port}: {exc.strerror}"
            ) from None
        logger.info(
            "sim engine serving model %r on http://%s:%d", self.args.model, self.options.host, self.options.port
        )
        if self.args.kv_events_port:
            self.kv_events = SimKvEvents(self.options.host, self.args.kv_events_port, self.options.dp_rank)
        self._apply_faults()
        if self.faults.crash_after_s:
            self._crash_timer = loop.call_later(
                self.faults.crash_after_s, self._die, f"sim fault: crash_after_s={self.faults.crash_after_s:g}"
            )

    async def wait_dead(self) -> str:
        assert self._died is not None, "start() first"
        return await asyncio.shield(self._died)

    async def shutdown(self) -> None:
        if self._crash_timer is not None:
            self._crash_timer.cancel()
        self._stopping = True  # streams stop where they are (_decode), as when the engine dies
        self._unhang.set()  # release hung handlers so the runner can close
        self._inference_unhang.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_events is not None:
            self.kv_events.close()

    def _publish_kv(self, events: list) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(events)

    def in_flight_requests(self) -> int:
        return self._in_flight

    async def sleep(self, level: int) -> None:
        self.sleeping, self.sleep_level = True, level

    async def wake_up(self) -> None:
        self.sleeping, self.sleep_level = False, 0

    def progress(self) -> int:
        return self._progress

    def request_outcomes(self) -> tuple[int, int]:
        return self._succeeded, self._server_errors

    def utilization_sampler(self) -> UtilizationSampler:
        return _SimSampler(self)

    def load_utilization(self) -> float:
        """What its batch alone reads: the share of its seats taken (max_num_seqs). A saturated
        engine reads 100 % at the default `utilization: 0`, so probes queued behind its batch are
        excused while it makes progress; below saturation a probe gets a seat at once."""
        return 100.0 * self.capacity.running / self.capacity.max_num_seqs

    # --- faults ----------------------------------------------------------------------------
    def _die(self, reason: str) -> None:
        if self._died is not None and not self._died.done():
            logger.error("sim engine died: %s", reason)
            self._died.set_result(reason)

    def _apply_faults(self) -> None:
        for event, hung in ((self._unhang, self.faults.hang), (self._inference_unhang, self.faults.hang_inference)):
            (event.clear if hung else event.set)()
        if self.faults.crash:
            self._die("sim fault: crash")

    # --- inference plane -------------------------------------------------------------------
    def _loading(self) -> bool:
        return time.monotonic() - self._started_at < self.args.load_s

    async def _health(self, request: web.Request) -> web.Response:
        await self._unhang.wait()
        if self._loading():
            return error(503, "loading the model")
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "owned_by": "motor-sim"}
                    for name in (self.args.model, *self.loras.loaded)
                ],
            }
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(server_metrics.registry())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.prefix.clear()  # (its AllBlocksCleared published)
        return web.Response(status=200)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body, problem = await json_body(request)
        if problem:
            return problem
        asked = parse(body, chat, self.args.max_tokens_default)
        if isinstance(asked, str):
            return error(400, asked)
        request_id = request.headers.get("X-Request-Id") or f"sim-{time.time_ns()}"
        probe = is_probe_request_id(request_id)
        if self._loading():  # as vLLM's API server before its engine is up: nothing is served yet
            return self._failed(probe, 503, "loading the model")
        model = body.get("model") or self.args.model
        if model != self.args.model and model not in self.loras.loaded:  # as vLLM: only what it serves
            return model_not_found(model, self.args.model)
        leg = sim_pd.leg(body)
        if leg == sim_pd.DECODE_LEG and (problem := sim_pd.missing_handoff(body)):
            return error(400, problem)
        arrived = time.monotonic()
        if not probe:
            self._in_flight += 1
            SIM_RUNNING.labels(self.args.model).inc()
        try:
            await self._until_inference_runs()
            if self.sleeping:
                return self._failed(probe, 503, "the engine is sleeping; call WakeUp first")
            if self.faults.fail_inference:
                return self._failed(probe, 500, "sim fault: fail_inference")
            async with self.capacity.seat():  # at most max_num_seqs run at once; the rest wait
                if leg != sim_pd.DECODE_LEG:  # a decode leg fetches the KV cache its prefill leg computed
                    adapter = None if model == self.args.model else model  # (its blocks are its own)
                    cached = self.prefix.lookup(asked.prompt_ids, adapter)
                    await self._prefill(len(asked.prompt_ids) - cached, probe)
                    self.prefix.store(asked.prompt_ids, adapter)
                if self.faults.latency_ms:
                    await self._generate(self.faults.latency_ms / 1000, probe)
                await self._until_inference_runs()  # a hang set while this request waited
                answer = Answer(asked, f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", model)
                tokens = self._decode(asked, answer, probe, arrived)
                if asked.stream:
                    held = request.get(HELD)
                    if held is not None and not held.start_sending():
                        raise asyncio.CancelledError  # failed back meanwhile: its 503 is being sent
                    response = await self._stream(request, answer, tokens)
                else:
                    async for _ in tokens:
                        pass
            if not probe:
                count_success(self.args.model, self._vllm_labels(), len(asked.prompt_ids), len(answer.ids), leg)
                self._succeeded += 1
            if asked.stream:
                await response.write_eof()
                return response
            whole = answer.whole()
            if leg == sim_pd.PREFILL_LEG:
                engine_id = f"{self.options.instance_id}/rank{self.options.dp_rank}"
                whole["kv_transfer_params"] = sim_pd.handoff(
                    engine_id, self.options.host, self.options.port, len(asked.prompt_ids)
                )
            return web.json_response(whole, headers={"X-Request-Id": request_id})
        finally:
            if not probe:
                self._in_flight -= 1
                SIM_RUNNING.labels(self.args.model).dec()

    async def _stream(self, request: web.Request, answer: Answer, tokens: AsyncIterator[None]) -> web.StreamResponse:
        """The answer as server-sent events, a chunk per token as it is made; [DONE] once all are."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        if (first := answer.first_chunk()) is not None:
            await response.write(sse(first))
        async for _ in tokens:
            await response.write(sse(answer.chunk()))
        if answer.request.include_usage:
            await response.write(sse(answer.usage_chunk()))
        await response.write(DONE)
        return response

    async def _decode(self, asked: SimRequest, answer: Answer, probe: bool, arrived: float) -> AsyncIterator[None]:
        """The answer's tokens, added to it one at a time: one every decode_ms_per_token (at 0, all at
        once, the loop yielded every TOKENS_PER_YIELD: it is the management plane's too). Each token
        is progress, so a long answer is never taken for a stall."""
        model, interval = Model(asked.prompt_ids), self.args.decode_ms_per_token / 1000
        vllm, last = self._vllm_labels(), time.monotonic()
        for index in range(asked.max_tokens):
            if interval:
                await asyncio.sleep(interval)
                await self._until_inference_runs()
            elif index and not index % TOKENS_PER_YIELD:
                await asyncio.sleep(0)
                await self._until_inference_runs()
            if self._stopping or (self._died is not None and self._died.done()):
                raise asyncio.CancelledError  # the engine is gone: its answers just stop (no [DONE])
            token, piece = model.next()
            answer.add(token, piece, None if asked.logprobs is None else model.logprobs(asked.logprobs))
            if not probe:
                self._progress += 1
                now = time.monotonic()
                if index:
                    VLLM_ITL.labels(*vllm).observe(now - last if interval else 0.0)
                else:
                    VLLM_TTFT.labels(*vllm).observe(now - arrived)
                last = now
            yield

    def _vllm_labels(self) -> tuple[str, str]:
        """vLLM's labels: the served model, and the engine (this data-parallel rank)."""
        return self.args.model, str(self.options.dp_rank)

    async def _prefill(self, tokens: int, probe: bool) -> None:
        left = tokens * self.args.prefill_ms_per_token / 1000
        if not left:
            return
        async with self._prefilling:
            while left > 0:
                await asyncio.sleep(min(SIM_STEP_S, left))
                await self._until_inference_runs()
                left -= SIM_STEP_S
                if not probe:
                    self._progress += 1

    async def _generate(self, seconds: float, probe: bool) -> None:
        """The answer's generation time (latency_ms): a step every SIM_STEP_S, each progress as a
        real engine's decode steps are, so a slow answer is never taken for a stall."""
        left = seconds
        while left > 0:
            await asyncio.sleep(min(SIM_STEP_S, left))
            left -= SIM_STEP_S
            if left > 0:
                await self._until_inference_runs()
            if not probe:
                self._progress += 1

    async def _until_inference_runs(self) -> None:
        while not (self._unhang.is_set() and self._inference_unhang.is_set()):
            await self._unhang.wait()
            await self._inference_unhang.wait()

    def stop_admitting(self) -> None:
        self.admission.close()

    def stop_serving(self, reason: str) -> int:
        return self.admission.stop_serving(reason)

    def serve_again(self) -> None:
        self.admission.serve_again()

    @web.middleware
    async def _admit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The aiohttp side of admission.py: refusals, and a client request failed back (503,
        its handler cancelled) while it has sent nothing; `_stream` says when it starts sending."""
        if self.admission.unkeyed(request.method, request.path, request.headers.getall("Authorization", [])):
            return web.Response(status=401, body=UNAUTHORIZED_BODY, content_type="application/json")
        if not is_inference_request(request.method, request.path):
            return await handler(request)
        probe = is_probe_request_id(request.headers.get("X-Request-Id"))
        refusal = self.admission.refusal(probe)
        if refusal is not None:
            return unavailable(refusal)
        if probe:
            return await handler(request)
        failed_back: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        request[HELD] = held = self.admission.hold(
            lambda message: failed_back.done() or failed_back.set_result(message)
        )
        work = asyncio.ensure_future(handler(request))
        if not await failed_back_first(work, held, failed_back):
            return work.result()
        return unavailable(failed_back.result())

    def _failed(self, probe: bool, status: int, message: str) -> web.Response:
        if not probe:
            SIM_FAILED.labels(self.args.model).inc()
            if status >= 500 and status != 503:
                self._server_errors += 1
        return error(status, message)
