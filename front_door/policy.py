"""The front door: OpenAI's model surface in front of the router (docs/router.md).

vllm-router 0.1.17 routes by model in its `--enable-igw` mode, but there a request for a model it
has no worker of goes to any worker (another model's engine answers its own 404), a request
without `model` gets 503, and `GET /v1/models` answers the router's own shape. This layer runs in
its own process on the published port (front_door/cli.py) and knows what the router can route
(`served`: the sync's table, every model and adapter with a worker in the router, withdrawn the
moment Motor withdraws its last engine, pushed to the door by the sync). It answers:

- `GET /v1/models`: OpenAI's list of every served model and loaded adapter (`parent`: its model);
- a request naming a model that is not served: vLLM's 404 naming the models that are; but 503
  with Retry-After for a model Motor serves whose engines are all out right now (`unavailable`);
- any request naming a model (or none), and the model list, before the sync knows what is served
  (just started or restarted: no list from Motor, or no read of the router, yet): 503, to retry;
- a request without `model`: served by the one model when exactly one is served, else a 400
  saying what to name;
- the router's admin API (adding or removing workers, loading adapters): 403, only the sync
  changes the router;

and passes everything else to the router unchanged (front_door/relay.py: the bytes as the router
writes them, a stream chunk by chunk, a slow client slowing only its own answer; connections to
the router pooled and kept alive). Its own Prometheus metrics at `GET /metrics`.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Collection

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from front_door.continuation import plan
from front_door.front_metrics import FrontMetrics
from front_door.keys import KeyRing, Tenant
from front_door.messages import Answer, Forward, Passed, Request, error_answer, response
from front_door.model_field import NOT_NAMED, TooComplex, model_field, with_model
from front_door.relay import Relay
from front_door.router_pool import RouterPool
from front_door.streams import Hooks, watch
from front_door.tenancy import Tenancy
from front_door.usage import read_usage, tokens_taken

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
# With API keys, what a keyed request may reach besides MODEL_PATHS (POST): an allow-list, so that
# no route of the router's or an engine's (one naming a model in a form, an admin read listing the
# engines' addresses) is reached around the tenant's models. `GET /health` needs no key.
KEYED_READS = frozenset({"/v1/models", "/version"})
STARTING = "The front door is starting: the models it serves are not known yet. Retry shortly."
MAX_BODY = 256 * 1024 * 1024  # the router's own default --max-payload-size
STREAM_CONTINUATIONS = 3  # times a cut stream is gone on with on another engine, at most (0: never)


def openai_error(status: int, message: str, kind: str, param: str | None = "model") -> Answer:
    """An answer of the door's own (front_door/messages.py: error_answer)."""
    return Answer(error_answer(status, message, kind, param), status)


class FrontDoor:
    def __init__(
        self,
        router_url: str,
        served: Callable[[], dict[str, str | None]],
        ready: Callable[[], bool] = lambda: True,
        max_body: int = MAX_BODY,
        unavailable: Callable[[], Collection[str]] = frozenset,
        stream_continuations: int = STREAM_CONTINUATIONS,
        keys: KeyRing | None = None,
    ):
        self.router_url = router_url.rstrip("/")
        self.served = served  # model -> parent model (None: a deployment's model)
        # Models Motor serves whose engines are all out right now: 503 to retry, not 404.
        self.unavailable = unavailable
        # Whether `served` is known yet: a sync just (re)started has heard nothing from Motor or
        # the router, and every model would look unserved (a false 404 to requests it can route).
        self.ready = ready
        self.metrics = FrontMetrics()
        self.stream_continuations = stream_continuations  # a cut stream is gone on with this many times at most
        self.hooks = Hooks(self.cut, self.first_event, self.continued, self.resumed_after)
        self.created = int(time.time())
        # API keys, tenants and their limits (None: the door is open, as on a developer's loopback)
        self.tenancy = Tenancy(keys, self.metrics.registry) if keys is not None else None
        self._views: dict[str, tuple] = {}  # tenant -> (served, tenant, what of it the tenant may use)
        self.relay = Relay(
            RouterPool(self.router_url),
            decide=self.decide,
            router_failed=self.router_failed,
            began=self.began,
            answered=self.answered,
            ended=self.ended,
            refused=lambda status: self.metrics.count("", status),
            read=self.read,
            observe=self.observe,
            max_body=max_body,
            screen=self.screen if self.tenancy is not None else None,
        )

    async def start(self, host: str, port: int, sock: socket.socket | None = None, accept: bool = True) -> None:
        await self.relay.start(host, port, sock, accept)
        scheme = "https" if self.relay.ssl is not None else "http"
        logger.info("front door on %s://%s:%d in front of router %s", scheme, host, port, self.router_url)

    async def close(self) -> None:
        await self.relay.close()

    # What a request gets ----------------------------------------------------------------------------

    def read(self, request: Request) -> Answer | None:
        """The model a request's body names, read where the door's rules look (off the loop for a
        large body: this touches nothing shared). An answer of its own if the body cannot be read."""
        if request.method == "POST" and request.path in MODEL_PATHS and request.body:
            try:
                request.model = model_field(request.body)
                request.follow = plan(request.path, request.body, self.stream_continuations)
            except TooComplex:
                return openai_error(
                    413, "The request body has more JSON strings than the front door reads.", "BadRequestError", None
                )
        return None

    def screen(self, method: str, path: str, headers: list[tuple[bytes, bytes]], peer: str) -> Answer | None:
        """A request refused on its head alone, before its body is read: a key that identify would
        refuse (front_door/tenancy.py)."""
        if method in ("GET", "HEAD") and path == "/health":
            return None
        refused = self.tenancy.screen(method, path, headers, peer)
        if refused is not None:
            self.metrics.count("", refused.status)
        return refused

    def decide(self, request: Request) -> Answer | Forward:
        """The stages in their order (docs/design.md, "The front door's seams"): identify, the
        model surface held to the tenant's models, admit."""
        tenancy = self.tenancy
        if tenancy is None:
            return self._decide(request)
        path, method = request.path, request.method
        if method in ("GET", "HEAD") and path == "/health":  # no key needed, none passed on
            tenancy.drop_keys(request.headers)
            return Forward()
        refused = tenancy.identify(request, request.peer)
        if refused is not None:
            self.metrics.count("", refused.status)
            return refused
        if method == "POST" and path in MODEL_PATHS:
            if request.model is None:  # no body: no model to hold to the tenant's
                decision: Answer | Forward = openai_error(
                    400, f"POST {path} takes a JSON object as its body.", "BadRequestError", None
                )
            else:
                decision = self._decide(request)
        elif method in ("GET", "HEAD") and path in KEYED_READS:
            decision = self._decide(request)
        else:
            decision = openai_error(404, f"{method} {path} is not served here.", "NotFoundError", None)
        if isinstance(decision, Answer):
            tenancy.counted(request, decision.status)
            return decision
        refused = tenancy.admit(request)
        if refused is not None:
            self.metrics.count(request.label, refused.status)
            return refused
        return decision

    def _decide(self, request: Request) -> Answer | Forward:
        path, method = request.path, request.method
        if method in ("GET", "HEAD") and path == "/v1/models":
            return self.models(head=method == "HEAD", tenant=request.key.tenant if request.key else None)
        if method in ("GET", "HEAD") and path == "/metrics":
            data = generate_latest(self.metrics.registry)
            return Answer(response(200, data, CONTENT_TYPE_LATEST, head=method == "HEAD"), 200)
        if method not in ("GET", "HEAD") and path.startswith(ADMIN_PATHS):
            self.metrics.count("", 403)
            return openai_error(
                403,
                f"{method} {path} changes the router: Motor keeps its workers (motor-router-sync) "
                "and loads adapters from the deployment's `adapters`",
                "PermissionDeniedError",
                None,
            )
        if request.model is not None and not request.model.is_object:  # the router would answer in plain text
            self.metrics.count("", 400)
            return openai_error(
                400, f"POST {path} takes a JSON object as its body, and this body is not one.", "BadRequestError", None
            )
        if request.model is not None:
            tenant = request.key.tenant if request.key is not None else None
            answer, changed, request.label = self._refusal(request.model.value, request.body, tenant)
            if answer is not None and answer.status == 404 and tenant is not None:
                self.tenancy.not_allowed(request, str(request.model.value))
            if answer is not None:
                self.metrics.count(request.label, answer.status)
                return answer
            follow = request.follow
            if follow is not None and changed is not None:  # the model named by the door: asked of the next engine too
                follow.request["model"] = request.label
                follow.body = changed = with_model(follow.body, request.label)
            elif follow is not None and follow.body is not request.body:  # it asks for token ids
                changed = follow.body
            return Forward(changed)
        return Forward()

    # OpenAI's model surface -----------------------------------------------------------------------

    def served_to(self, tenant: Tenant | None) -> dict[str, str | None]:
        """What is served that `tenant` may use (None: everything), worked out once per table."""
        served = self.served()
        if tenant is None or tenant.models == ("*",):
            return served
        view = self._views.get(tenant.name)
        if view is None or view[0] is not served or view[1] is not tenant:
            view = self._views[tenant.name] = (served, tenant, {n: p for n, p in served.items() if tenant.may_use(n)})
        return view[2]

    def models(self, head: bool = False, tenant: Tenant | None = None) -> Answer:
        if not self.ready():  # an empty list would say "no model", not "not known yet"
            self.metrics.count("", 503)
            return openai_error(503, STARTING, "ServiceUnavailableError", None)
        served = self.served_to(tenant)
        data = []
        for name in sorted(served, key=lambda n: (served[n] is not None, n)):
            entry = {"id": name, "object": "model", "created": self.created, "owned_by": "motor", "root": name}
            entry["parent"] = served[name]
            data.append(entry)
        self.metrics.count("", 200)
        return Answer(response(200, json.dumps({"object": "list", "data": data}).encode(), head=head), 200)

    def _refusal(
        self, model: object, body: bytes, tenant: Tenant | None = None
    ) -> tuple[Answer | None, bytes | None, str]:
        """(an answer of the front door's own, or None; the body to send when it was changed; the
        model label), for a JSON object `body` naming `model`; held to what `tenant` may use."""
        if not self.ready():
            return openai_error(503, STARTING, "ServiceUnavailableError", None), None, "?"
        served = self.served_to(tenant)
        if model is None or model == "" or model is NOT_NAMED:
            models = sorted(n for n, parent in served.items() if parent is None)
            if len(models) == 1:
                return None, with_model(body, models[0]), models[0]
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
        if model not in served and model in self.unavailable() and (tenant is None or tenant.may_use(model)):
            return (
                openai_error(
                    503,
                    f"The model `{model}` is served here but no engine of it can take requests right now "
                    "(one is being restarted or recovering). Retry shortly.",
                    "ServiceUnavailableError",
                ),
                None,
                model,
            )
        if model not in served:
            names = ", ".join(sorted(served)) or "none"
            access = " or you do not have access to it" if tenant is not None else ""
            message = f"The model `{model}` does not exist{access}. Valid aliases: {names}."
            return (
                openai_error(404, message, "NotFoundError"),
                None,
                "?",
            )
        return None, None, model

    # Requests passed to the router ------------------------------------------------------------------

    def began(self, request: Request) -> None:
        request.began = time.monotonic()
        self.metrics.in_flight.inc()

    def answered(self, request: Request | None) -> None:
        if request is not None:
            seconds = time.monotonic() - request.began
            self.metrics.latency.labels(request.label).observe(seconds)
            if self.tenancy is not None:
                self.tenancy.answered(request, seconds)

    def observe(self, request: Request | None, status: int, head: bytes, owner) -> object:
        """What writes the router's answer on: a stream (front_door/streams.py), a tenant's JSON answer
        (its `usage` read, front_door/usage.py), or None: as it came."""
        stream = watch(request, status, head, owner, self.hooks, self.stream_continuations)
        if stream is None and request is not None and request.ticket is not None and request.method == "POST":
            return read_usage(request, status, head, owner.transport)
        return stream

    def ended(self, request: Request | None, passed: Passed) -> None:
        self.metrics.in_flight.dec()
        if request is not None and request.ticket is not None:
            self.tenancy.ended(request, passed.status, tokens_taken(request, passed.status))
        if passed.router_failed:
            self.metrics.router_errors.inc()
        if passed.status:  # a client that left before the router answered: nobody's failure counted
            self.metrics.count(request.label if request else "", passed.status)

    def first_event(self, request: Request) -> None:
        self.metrics.first_token.labels(request.label).observe(time.monotonic() - request.began)

    def cut(self, request: Request, how: str) -> None:
        """A stream the router ended before its `[DONE]`: its client is sent an error event."""
        self.metrics.streams_cut.labels(request.label).inc()
        logger.warning(
            "stream cut: POST %s for model %r: the router's answer %s, before `data: [DONE]`; the client was sent an "
            "error event",
            request.path,
            request.label,
            how,
        )

    def continued(self, request: Request, reason: str) -> None:
        """A cut stream asked of another engine (its answer's rest)."""
        self.metrics.continuations.labels(request.label, reason).inc()
        request_id = next((v.decode("latin-1") for n, v in request.headers if n.lower() == b"x-request-id"), "")
        follow = request.follow
        logger.warning(
            "stream continued: POST %s for model %r%s, answer %s: cut (%s) after %d tokens, its rest asked of "
            "another engine (continuation %d of at most %d)",
            request.path,
            request.label,
            f" (X-Request-Id {request_id})" if request_id else "",
            follow.answer.get("id", "?"),
            reason,
            follow.sent_at_cut,
            follow.continuations,
            follow.limit,
        )

    def resumed_after(self, request: Request, gap: float) -> None:
        """A cut stream's first event from another engine written, `gap` seconds after the cut."""
        self.metrics.continuation_gap.labels(request.label).observe(gap)

    def router_failed(self, request: Request, exc: BaseException) -> Answer:
        """504 when the router's answer did not begin in time, else 502 (no connection, or it closed)."""
        if isinstance(exc, TimeoutError):
            return openai_error(504, f"the router did not answer: {exc}", "GatewayTimeoutError", None)
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return openai_error(502, f"the router did not answer: {detail}", "BadGatewayError", None)
