"""Who a request is and what it may take: the door's *identify* and *admit* stages (docs/design.md,
"The front door's seams"; docs/security.md, "The front door: API keys, tenants, limits").

- identify: the key in `Authorization: Bearer <key>` (or Anthropic's `x-api-key`) to its tenant,
  else 401 in OpenAI's shape. Exactly one key in exactly one header: none, two, or a scheme other
  than Bearer is refused, so the door and what is behind it can never read different keys. The
  key's headers are taken out of the request before it is passed on. A 401 closes its connection:
  guessing keys costs a connection each.
- admit: the tenant's limits (front_door/admission.py), else 429 with Retry-After in OpenAI's shape
  (`type` "requests", "tokens" or "concurrency"; `code` "rate_limit_exceeded"); the ticket is
  given back when the answer ends, with the tokens it took (front_door/usage.py).

Every refusal is logged with the key's id (never the key; an unknown key by the client's address),
at most LOG_PER_SECOND lines a second for each reason (the rest counted in the next line), and
counted by tenant and reason.
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CollectorRegistry

from front_door.admission import Admission, Refusal, Ticket, retry_after
from front_door.keys import Key, KeyRing, Tenant
from front_door.messages import Answer, Request, response
from front_door.tenant_metrics import TenantSeries

logger = logging.getLogger("motor-front-door.audit")

KEY_HEADERS = (b"authorization", b"x-api-key")
KEY_NAME_LENGTHS = (13, 9)
STATUS = {code: str(code) for code in range(100, 600)}  # (no str() made per request)
LOG_PER_SECOND = 10
NO_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
    "auth (i.e. Authorization: Bearer YOUR_KEY)."
)
BAD_KEY = "Incorrect API key provided. Check the key, or ask for a new one."
TWO_KEYS = "Give one API key, in one Authorization header (Bearer); this request has several."
NOT_BEARER = "Give the API key as `Authorization: Bearer YOUR_KEY`."
LIMITED = {
    "requests": "Rate limit reached for requests: {limit:g} per minute for tenant {tenant}. Retry in {wait}s.",
    "tokens": "Rate limit reached for tokens: {limit:g} per minute for tenant {tenant}. Retry in {wait}s.",
    "concurrency": "Too many requests at once: {limit:g} for tenant {tenant}. Retry when one has ended.",
}


def is_key_header(name: bytes) -> bool:
    # (only names as long as a key header's are lowered: most headers are not lowered at all)
    return len(name) in KEY_NAME_LENGTHS and name.lower() in KEY_HEADERS


def unauthorized(message: str, code: str | None) -> Answer:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    extra = 'WWW-Authenticate: Bearer realm="motor"\r\nConnection: close\r\n'
    return Answer(response(401, json.dumps({"error": error}).encode(), extra=extra), 401)


def too_many(refusal: Refusal, tenant: str) -> Answer:
    wait = retry_after(refusal.retry_after)
    message = LIMITED[refusal.reason].format(limit=refusal.limit, tenant=tenant, wait=wait)
    error = {"message": message, "type": refusal.reason, "param": None, "code": "rate_limit_exceeded"}
    extra = f"Retry-After: {wait}\r\nx-ratelimit-limit-{refusal.reason}: {refusal.limit:g}\r\n"
    return Answer(response(429, json.dumps({"error": error}).encode(), extra=extra), 429)


class AuditLog:
    """Refusals logged, at most LOG_PER_SECOND lines a second for each reason."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.windows: dict[str, list] = {}  # reason -> [second, lines in it, lines left out]

    def refused(self, reason: str, message: str, *args: object) -> None:
        second = int(self.clock())
        window = self.windows.setdefault(reason, [second, 0, 0])
        if window[0] != second:
            window[0], window[1] = second, 0
        if window[1] >= LOG_PER_SECOND:
            window[2] += 1
            return
        window[1] += 1
        left_out, window[2] = window[2], 0
        suffix = f" ({left_out} more refusal(s) for this reason not logged)" if left_out else ""
        logger.warning("refused (%s): " + message + suffix, reason, *args)


class Tenancy:
    """The identify and admit stages, and what is given back when an answer ends."""

    def __init__(self, keys: KeyRing, registry: CollectorRegistry, clock=time.monotonic) -> None:
        self.keys = keys
        self.admission = Admission(clock)
        self.audit = AuditLog(clock)
        self.metrics = TenantSeries(
            registry,
            lambda: {name: state.in_flight for name, state in self.admission.states.items()},
            lambda: len(self.keys.keys),
            lambda: self.keys.failures,
        )

    def identify(self, request: Request, peer: str) -> Answer | None:
        """The request's key (request.key, its headers taken out), or a 401."""
        at, key, refusal = self._find(request.headers)
        if key is None:
            request.keep_alive = False
            return self._unauthorized(request.method, request.path, peer, *refusal)
        del request.headers[at]
        request.key = key
        return None

    def screen(self, method: str, path: str, headers: list[tuple[bytes, bytes]], peer: str) -> Answer | None:
        """identify's 401 decided from a request's head alone, as soon as it is read: a request
        without a valid key has none of its body read, held, inflated or answered `100 Continue`,
        so a client without a key costs the door neither memory nor the body pool's threads."""
        _, key, refusal = self._find(headers)
        return None if key is not None else self._unauthorized(method, path, peer, *refusal)

    @staticmethod
    def drop_keys(headers: list[tuple[bytes, bytes]]) -> None:
        """Takes every key header out (a request that needs no key passes none on)."""
        headers[:] = [(name, value) for name, value in headers if not is_key_header(name)]

    def _find(self, headers: list[tuple[bytes, bytes]]) -> tuple[int, Key | None, tuple[str, str, str | None]]:
        """(where its key header is, the key) or (-1, None, why it is refused)."""
        at = [index for index, (name, _value) in enumerate(headers) if is_key_header(name)]
        if len(at) != 1:
            return -1, None, ("no_key", NO_KEY, None) if not at else ("bad_key", TWO_KEYS, None)
        name, value = headers[at[0]]
        presented = value.strip() if len(name) == 9 else self._bearer(value)  # x-api-key, else Authorization
        if not presented:
            return -1, None, ("bad_key", NOT_BEARER, None)
        key = self.keys.find(presented)
        if key is None:
            return -1, None, ("bad_key", BAD_KEY, "invalid_api_key")
        return at[0], key, ("", "", None)

    @staticmethod
    def _bearer(value: bytes) -> bytes:
        scheme, _, token = value.strip().partition(b" ")
        return token.strip() if scheme.lower() == b"bearer" else b""

    def _unauthorized(self, method: str, path: str, peer: str, reason: str, message: str, code: str | None) -> Answer:
        self.metrics.rejections["", reason] += 1
        # (%r: a path or method the client wrote cannot forge a line of the log)
        self.audit.refused(reason, "%r %r from %s: %s", method[:20], path[:200], peer or "?", message)
        return unauthorized(message, code)

    def not_allowed(self, request: Request, model: str) -> None:
        """A model the request's tenant may not use (answered 404, as a model that does not exist)."""
        key: Key = request.key
        self.metrics.rejections[self.metrics.label(key.tenant.name), "model"] += 1
        self.audit.refused(
            "model",
            "key %s (tenant %s): %r %r for model %r",
            key.id,
            key.tenant.name,
            request.method[:20],
            request.path[:200],
            model[:200],
        )

    def admit(self, request: Request) -> Answer | None:
        key: Key = request.key
        tenant = key.tenant
        label = self.metrics.label(tenant.name)
        admitted = self.admission.admit(tenant, label)
        if isinstance(admitted, Refusal):
            self.metrics.rejections[label, admitted.reason] += 1
            self.metrics.requests[label, "429"] += 1
            self.audit.refused(
                admitted.reason,
                "key %s (tenant %s): %r %r: at its limit of %g %s",
                key.id,
                tenant.name,
                request.method[:20],
                request.path[:200],
                admitted.limit,
                admitted.reason,
            )
            return too_many(admitted, tenant.name)
        request.ticket = admitted
        return None

    def answered(self, request: Request, seconds: float) -> None:
        ticket: Ticket | None = request.ticket
        if ticket is not None:
            self.metrics.observe(ticket.label, seconds)

    def counted(self, request: Request, status: int) -> None:
        """A request of a tenant the door answered itself (its model list, a 404, ...)."""
        if request.key is not None:
            label = self.metrics.label(request.key.tenant.name)
            self.metrics.requests[label, str(status)] += 1

    def ended(self, request: Request, status: int, tokens: tuple[int, int]) -> None:
        ticket: Ticket | None = request.ticket
        if ticket is None or ticket.given_back:
            return
        tenant: Tenant = request.key.tenant
        label = ticket.label
        prompt, completion = tokens
        self.admission.give_back(ticket, prompt + completion, self.keys.tenants.get(tenant.name, tenant))
        series = self.metrics
        if status:
            series.requests[label, STATUS.get(status) or str(status)] += 1
        if prompt:
            series.tokens[label, "prompt"] += prompt
        if completion:
            series.tokens[label, "completion"] += completion
