"""The engines' own API key: one secret Motor holds, so that an engine's OpenAI port answers only
Motor's components, not whoever reaches it (docs/security.md, "Engines with a key of their own").

It travels in the environment (MOTOR_ENGINE_API_KEY, readable only by the processes' own user,
never on a command line, which every user of the host can read): `motorctl up` makes one for its
run when its front door takes API keys (an open door guards nothing worth going around) and
gives it to the controller, the node managers (whose engines inherit their environment) and the
front door. Unset, engines take every caller, as before.

Where the environment cannot hold the secret itself (compose: a variable cannot come from a
volume), MOTOR_ENGINE_API_KEY_FILE names a file holding it (its first line), read when
MOTOR_ENGINE_API_KEY is unset; a file that cannot be read or is empty is an error that names the
variable (EngineKeyError), never a silently open engine.

- engines (engine_server/engines/admission.py: the simulated engine's middleware, vLLM's behind
  vllm_admission) answer 401 to a request under `/v1/` or an inference route none of whose
  Authorization headers is `Bearer <key>`; `/health` and `/metrics` stay open (routers and
  Prometheus read them);
- the front door sends it on every request it passes on (vllm-router 0.1.17 cannot: its
  `--api-key` and a worker's `api_key` are never sent to workers, measured, but it passes a
  request's `Authorization` on to the engine it picks), in place of any the client sent; in its
  prefill/decode flow the router sends both legs `Bearer $OPENAI_API_KEY` of its own environment
  instead, where `motorctl up` puts the key (motorctl/router.py);
- the engine server's own probes and the controller's adapter loads send it too.
"""

from __future__ import annotations

import hmac
import os
import secrets

ENGINE_KEY_ENV = "MOTOR_ENGINE_API_KEY"
ENGINE_KEY_FILE_ENV = "MOTOR_ENGINE_API_KEY_FILE"


class EngineKeyError(RuntimeError):
    """MOTOR_ENGINE_API_KEY_FILE names a file that cannot be read or holds no key."""


def engine_key() -> str | None:
    """The engines' key, if Motor was given one: MOTOR_ENGINE_API_KEY, else the first line of the
    file MOTOR_ENGINE_API_KEY_FILE names (EngineKeyError when it cannot be read or is empty)."""
    key = os.environ.get(ENGINE_KEY_ENV)
    if key:
        return key
    path = os.environ.get(ENGINE_KEY_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as held:
            key = held.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineKeyError(f"{ENGINE_KEY_FILE_ENV}={path}: the engines' key cannot be read: {exc}") from exc
    if not key:
        raise EngineKeyError(f"{ENGINE_KEY_FILE_ENV}={path}: the file holds no key (its first line is empty)")
    return key


def new_engine_key() -> str:
    return "sk-motor-engine-" + secrets.token_urlsafe(32)


def authorization(key: str | None) -> dict[str, str]:
    """The header that carries `key` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorization_line(key: str | None) -> bytes:
    """The same header as one raw HTTP/1.1 line, without its CRLF (b"" without a key)."""
    return "".join(f"{name}: {value}" for name, value in authorization(key).items()).encode()


def presented(header: str | bytes | None, key: str) -> bool:
    """Whether an `Authorization` header's value carries `key` (compared in constant time)."""
    if isinstance(header, str):
        header = header.encode("latin-1", "replace")
    scheme, _, token = (header or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


UNAUTHORIZED_BODY = (
    b'{"error": {"message": "This engine takes requests from Motor only: send them to the front door.",'
    b' "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}'
)
