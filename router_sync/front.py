"""The front door: OpenAI's model surface in front of the router (docs/router.md).

vllm-router 0.1.17 routes by model in its `--enable-igw` mode, but there a request for a model it
has no worker of goes to any worker (another model's engine answers its own 404), a request
without `model` gets 503, and `GET /v1/models` answers the router's own shape. This layer runs in
its own process on the published port (router_sync/door.py) and knows what the router can route
(`served`: the sync's table, every model and adapter with a worker in the router, withdrawn the
moment Motor withdraws its last engine, pushed to the door by the sync). It answers:

- `GET /v1/models`: OpenAI's list of every served model and loaded adapter (`parent`: its model);
- a request naming a model that is not served: vLLM's 404 naming the models that are;
- any request naming a model (or none), and the model list, before the sync knows what is served
  (just started or restarted: no list from Motor, or no read of the router, yet): 503, to retry;
- a request without `model`: served by the one model when exactly one is served, else a 400
  saying what to name;
- the router's admin API (adding or removing workers, loading adapters): 403, only the sync
  changes the router;

and passes everything else to the router unchanged: an answer with a Content-Length (up to 1 MiB)
in one write, any other (a stream) chunk by chunk as the router sends it (a slow client slows its
own stream, never the others: each write waits for the client to take the previous one).
Connections to the router are pooled and kept alive.
Its own Prometheus metrics at `GET /metrics`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

logger = logging.getLogger(__name__)

# Requests that name a model in a JSON body (vLLM's OpenAI server, its Anthropic, SageMaker and
# Cohere APIs, its render and batch endpoints, and the router's own paths). The router sends one
# naming a model it has no worker of to any worker: each must be checked here.
MODEL_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/completions/render",
        "/v1/chat/completions",
        "/v1/chat/completions/render",
        "/v1/chat/completions/batch",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/responses/render",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/render",
        "/invocations",
        "/v2/embed",
        "/cohere/v2/chat",
        "/cohere/v2/chat/render",
        "/generative_scoring",
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/pooling",
        "/classify",
        "/tokenize",
        "/detokenize",
    }
)
# What changes the router or its engines: only the sync (and Motor's controller) may.
# (`/flush_cache`: the router sends it to every engine, and SGLang's drop their prefix cache.)
ADMIN_PATHS = (
    "/add_worker",
    "/remove_worker",
    "/workers",
    "/flush_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Request bodies aiohttp's server decodes as it reads them (aiohttp/http_parser.py): the body passed on
# is the decoded one, so its Content-Encoding must not go with it (the engine would decode it again).
DECODED_ENCODINGS = frozenset({"gzip", "deflate", "br", "zstd"})
STARTING = "The front door is starting: the models it serves are not known yet. Retry shortly."
MAX_BODY = 256 * 1024 * 1024  # the router's own default --max-payload-size
WHOLE_BODY = 1024 * 1024  # an answer with a Content-Length up to this is passed in one write


def end_to_end(headers) -> CIMultiDict:
    """The headers a proxy passes on: all but the hop-by-hop ones, repeated ones kept (Set-Cookie)."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def openai_error(status: int, message: str, kind: str, param: str | None = "model") -> web.Response:
    """vLLM's error body (entrypoints/openai/protocol.py ErrorResponse)."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "motor_front_door_requests",
            'Requests through the front door, by the model named ("" none, "?" not served) and HTTP status.',
            ["model", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "motor_front_door_response_start_seconds",
            "From a request's arrival to the router's response headers (the router's time included).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "motor_front_door_requests_in_flight", "Requests being passed to the router now.", registry=self.registry
        )
        self.router_errors = Counter(
            "motor_front_door_router_errors",
            "Requests the router did not answer (no connection, or the connection broke).",
            registry=self.registry,
        )


class FrontDoor:
    def __init__(
        self,
        router_url: str,
        served: Callable[[], dict[str, str | None]],
        ready: Callable[[], bool] = lambda: True,
        connections: int = 1024,
    ):
        self.router_url = router_url.rstrip("/")
        self.served = served  # model -> parent model (None: a deployment's model)
        # Whether `served` is known yet: a sync just (re)started has heard nothing from Motor or
        # the router, and every model would look unserved (a false 404 to requests it can route).
        self.ready = ready
        self.connections = connections
        self.metrics = FrontMetrics()
        self.created = int(time.time())
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None

    # Serving ------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.own_metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def start(self, host: str, port: int) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.connections, keepalive_timeout=60),
            # A generation may take long; only the connection to the router has a deadline.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            # A proxy keeps no cookies: one client's would be sent on every other client's requests.
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        # handler_cancellation: a client that goes away cancels its request to the router too.
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port, backlog=1024).start()
        logger.info("front door on http://%s:%d in front of router %s", host, port, self.router_url)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    # OpenAI's model surface -----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        if not self.ready():  # an empty list would say "no model", not "not known yet"
            self.metrics.requests.labels("", "503").inc()
            return openai_error(503, STARTING, "ServiceUnavailableError", None)
        served = self.served()
        data = []
        for name in sorted(served, key=lambda n: (served[n] is not None, n)):
            entry = {"id": name, "object": "model", "created": self.created, "owned_by": "motor", "root": name}
            entry["parent"] = served[name]
            data.append(entry)
        self.metrics.requests.labels("", "200").inc()
        return web.json_response({"object": "list", "data": data})

    async def own_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _refusal(self, body: dict) -> tuple[web.Response | None, bytes | None, str]:
        """(an answer of the front door's own, or None; the body to send when it was changed; the
        model label)."""
        if not self.ready():
            return openai_error(503, STARTING, "ServiceUnavailableError", None), None, "?"
        served = self.served()
        model = body.get("model")
        if model is None or model == "":
            models = sorted(n for n, parent in served.items() if parent is None)
            if len(models) == 1:
                return None, json.dumps({**body, "model": models[0]}).encode(), models[0]
            if not models:
                return openai_error(503, "No model is served yet.", "ServiceUnavailableError"), None, ""
            return (
                openai_error(
                    400,
                    f"The request names no model and several are served: {', '.join(sorted(served))}. "
                    "Name one in the request's `model` field (GET /v1/models lists them).",
                    "BadRequestError",
                ),
                None,
                "",
            )
        if not isinstance(model, str):
            return openai_error(400, "`model` must be a string.", "BadRequestError"), None, "?"
        if model not in served:
            names = ", ".join(sorted(served)) or "none"
            return (
                openai_error(404, f"The model `{model}` does not exist. Valid aliases: {names}.", "NotFoundError"),
                None,
                "?",
            )
        return None, None, model

    # Passing requests to the router -----------------------------------------------------------------

    async def forward(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.method not in ("GET", "HEAD") and path.startswith(ADMIN_PATHS):
            self.metrics.requests.labels("", "403").inc()
            return openai_error(
                403,
                f"{request.method} {path} changes the router: Motor keeps its workers (motor-router-sync) "
                "and loads adapters from the deployment's `adapters`",
                "PermissionDeniedError",
                None,
            )
        body = await request.read() if request.can_read_body else None
        label = ""
        if request.method == "POST" and path in MODEL_PATHS and body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None  # not JSON: the router and the engine answer it as they would
            if isinstance(parsed, dict):
                answer, changed, label = self._refusal(parsed)
                if answer is not None:
                    self.metrics.requests.labels(label, str(answer.status)).inc()
                    return answer
                body = changed or body
        return await self._pass(request, body, label)

    async def _pass(self, request: web.Request, body: bytes | None, label: str) -> web.StreamResponse:
        assert self.session is not None
        headers = end_to_end(request.headers)
        if headers.get("Content-Encoding", "").lower() in DECODED_ENCODINGS:
            del headers["Content-Encoding"]
        began = time.monotonic()
        response: web.StreamResponse | None = None
        self.metrics.in_flight.inc()
        try:
            async with self.session.request(
                request.method, self.router_url + request.rel_url.raw_path_qs, headers=headers, data=body
            ) as upstream:
                self.metrics.latency.observe(time.monotonic() - began)
                headers = end_to_end(upstream.headers)
                length = upstream.content_length
                if length is not None and length <= WHOLE_BODY:
                    # A whole answer (not a stream): one write, far cheaper than a chunk loop.
                    whole = web.Response(status=upstream.status, reason=upstream.reason, headers=headers)
                    whole.body = await upstream.read()
                    self.metrics.requests.labels(label, str(upstream.status)).inc()
                    return whole
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
                if length is not None:
                    response.content_length = length
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    try:
                        await response.write(chunk)  # waits while the client has not taken the last one
                    except ConnectionResetError:
                        # The client went (a stop button): the router answered; not its failure.
                        self.metrics.requests.labels(label, str(upstream.status)).inc()
                        return response
                await response.write_eof()
                self.metrics.requests.labels(label, str(upstream.status)).inc()
                return response
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            self.metrics.router_errors.inc()
            self.metrics.requests.labels(label, "502").inc()
            if response is not None and response.prepared:
                raise  # the stream had begun: the client sees it cut, as from the router itself
            return openai_error(502, f"the router did not answer: {type(exc).__name__}", "BadGatewayError", None)
        finally:
            self.metrics.in_flight.dec()
