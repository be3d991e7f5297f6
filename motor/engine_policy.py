"""What a request may put in an engine's configuration: nothing that chooses a program, code to
load, or a file on the node outside the allowed model roots.

A StartEngine request (and the deployment it comes from) carries the engine server's user_config
as JSON. The node manager checks it with `check_engine_config` before anything is written or
started, and refuses with INVALID_ARGUMENT naming the key:
- keys that name a program or code to import (`PROGRAM_KEYS`; e.g. SGLang's `launcher`, vLLM's
  `worker_extension_cls`): the engine command comes only from the node manager's own
  configuration (`--engine-command`);
- `trust_remote_code: true` (it runs Python shipped with a model);
- `mgmt_tls_config` with `enable_tls: true`: an engine's TLS comes from its node manager's
  settings, not a request;
- any string that is a local path (starts with `/`, `~` or `./`, or climbs with `../`, also after an
  `=` as in `--flag=/path`) unless it resolves inside one of the node's model roots
  (`--model-root`). Model names such as `Qwen/Qwen2-0.5B` are not paths.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from motor.errors import InvalidArgument

PROGRAM_KEYS = {
    "launcher": "the command that starts SGLang",
    "worker_cls": "a Python class vLLM imports",
    "worker_extension_cls": "a Python class vLLM imports",
    "tool_parser_plugin": "a Python file vLLM imports",
    "logits_processors": "Python objects vLLM imports",
    "middleware": "Python objects vLLM imports",
    "reasoning_parser_plugin": "a Python file vLLM imports",
}
REFUSED_SECTIONS = {"mgmt_tls_config": "an engine's TLS files come from its node manager's settings (--tls-cert/--tls-key/--tls-ca)"}
CODE_FLAGS = {"trust_remote_code": "it runs Python code shipped with the model"}


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", "~", "./")) or text in (".", "..") or "../" in text or text.endswith("/..")


def local_paths(text: str) -> Iterator[str]:
    """Local paths in a string value: the value itself, or what follows an '=' (--flag=/path)."""
    for candidate in [text, *text.split("=")[1:]]:
        if _looks_like_path(candidate):
            yield candidate


def within(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(os.path.expanduser(path))
    for root in roots:
        base = os.path.realpath(root)
        if os.path.commonpath([real, base]) == base:
            return True
    return False


def _walk(value: Any, where: str) -> Iterator[tuple[str, str | None, Any]]:
    """(field path, key, value) for every value in a JSON document."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{where}.{key}"
            yield path, str(key), item
            yield from _walk(item, path)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            path = f"{where}[{index}]"
            yield path, None, item
            yield from _walk(item, path)


def check_engine_config(config: dict, model_roots: list[str] | None, field: str = "config_json") -> None:
    """Raise InvalidArgument naming the first key that would choose a program, code or a file.

    `model_roots` None (the controller, which cannot know each node's roots) skips the path
    check; the node manager repeats the whole check with its own roots."""
    roots_hint = f"the node's model roots ({', '.join(model_roots)})" if model_roots else "a model root (the node allows no local paths: --model-root)"
    check_paths = model_roots is not None
    for path, key, value in _walk(config, field):
        if key in PROGRAM_KEYS:
            raise InvalidArgument(
                f"{path}: names {PROGRAM_KEYS[key]}; a request may not choose what runs on a node "
                "(engine commands come from the node manager's --engine-command)"
            )
        if key in REFUSED_SECTIONS and isinstance(value, dict) and value.get("enable_tls"):
            raise InvalidArgument(f"{path}: not accepted in a request: {REFUSED_SECTIONS[key]}")
        if key in CODE_FLAGS and value not in (False, None, "false", "False", 0):
            raise InvalidArgument(f"{path}: must be false in a request: {CODE_FLAGS[key]}")
        if check_paths and isinstance(value, str):
            for local in local_paths(value):
                if not within(local, model_roots or []):
                    raise InvalidArgument(f"{path}: {local!r} is a local path outside {roots_hint}")
