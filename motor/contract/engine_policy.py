"""What a request may put in an engine's configuration: nothing that chooses a program, code to
load, or a file on the node outside the allowed model roots.

A StartEngine request (and the deployment it comes from) carries the engine server's user_config
as JSON. The node manager checks it with `check_engine_config` before anything is written or
started (the controller checks deployments too, without the path rule), and refuses with
INVALID_ARGUMENT naming the key path. Keys are compared the way the engines read them: `-` and
`_` are the same and case does not count (`trust-remote-code` is `trust_remote_code`), and a
dotted key (`speculative-config.model`) is each of its parts. The rules (docs/security.md):
- anywhere: keys that name a program or code to import (`CODE_KEYS`, and every `*_cls`,
  `*_class`, `*_module`, `*module_path`, `*plugin*` key), `trust_remote_code` unless false,
  `mgmt_tls_config` with `enable_tls: true` (an engine's TLS comes from its node manager);
- vLLM `engine_args`: only the arguments of motor/contract/vllm_request_args.py (an allow-list); inside
  its values no dotted Python name (`pkg.Class`: vLLM imports those, e.g.
  `compilation_config.backend`) and no string that looks like a command-line option;
- SGLang `extra_args`: only the flags of `SGLANG_EXTRA_FLAGS` (an allow-list), as `--flag value`
  or `--flag=value`;
- any string that is a local path (starts with `/`, `~` or `./`, or climbs with `../`, also after
  an `=` as in `--flag=/path`) must resolve inside one of the node's model roots (`--model-root`).
  Model names such as `Qwen/Qwen2-0.5B` are not paths;
- a string that holds a JSON object or array (vLLM parses those) is checked as that object;
- documents nest at most MAX_CONFIG_DEPTH levels.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

from motor.contract.sglang_server_flags import SGLANG_SERVER_FLAGS, SGLANG_VERSION_REVIEWED
from motor.contract.vllm_request_args import (
    MOTOR_ENGINE_ARGS,
    VLLM_ARG_CHOICES,
    VLLM_REFUSED_ARGS,
    VLLM_REQUEST_ARGS,
    VLLM_VERSION_REVIEWED,
    unsupported_vllm_arg,
)  # fmt: skip
from motor.errors import InvalidArgument

# Far above any real engine configuration (a few levels), far below Python's recursion limit.
MAX_CONFIG_DEPTH = 32

CODE_KEYS = {
    "launcher": "the command that starts SGLang",
    "logits_processors": "Python objects vLLM imports",
    "middleware": "Python objects vLLM imports",
    "model_class_overrides": "Python classes vLLM uses for the model",
    "pylogging_config_file": "a Python logging configuration (it can construct any class)",
    "inductor_compile_config": "torch inductor settings (they include the compiler command)",
    "inductor_passes": "Python objects torch runs while compiling",
    "enable_custom_logit_processor": "it lets callers send Python code (SGLang)",
    "custom_weight_loader": "Python functions SGLang imports",
}
REFUSED_SECTIONS = {
    "mgmt_tls_config": "an engine's TLS files come from its node manager's settings (--tls-cert/--tls-key/--tls-ca)"
}
CODE_FLAGS = {"trust_remote_code": "it runs Python code shipped with the model"}

# SGLang flags a request may append (`extra_args`), reviewed against SGLang 0.5.23's server flags
# (motor/contract/sglang_server_flags.py, generated from its parser; tests/security/
# test_engine_policy.py checks this list against it): numbers, switches and names; none names code
# to import. Paths among their values must still lie inside a model root.
SGLANG_EXTRA_FLAGS = frozenset(
    """
    allow_auto_truncate attention_backend chat_template chunked_prefill_size context_length
    cuda_graph_bs_decode cuda_graph_bs_prefill cuda_graph_max_bs_decode cuda_graph_max_bs_prefill
    decode_log_interval disable_cuda_graph disable_overlap_schedule disable_radix_cache
    disaggregation_ib_device dp_size dtype enable_cache_report enable_dp_attention enable_mixed_chunk
    enable_torch_compile ep_size grammar_backend kv_cache_dtype load_balance_method log_level
    log_requests log_requests_level max_prefill_tokens max_queued_requests max_running_requests
    max_total_tokens mem_fraction_static num_continuous_decode_steps page_size pp_size quantization
    random_seed reasoning_parser revision sampling_backend schedule_conservativeness schedule_policy
    served_model_name show_time_cost skip_tokenizer_init speculative_algorithm
    speculative_draft_model_path speculative_eagle_topk speculative_num_draft_tokens
    speculative_num_steps stream_interval tokenizer_mode tokenizer_path tool_call_parser
    torch_compile_max_bs tp_size watchdog_timeout
    """.split()
)

# SGLang flags the engine server passes itself: a request's own would undo them.
SGLANG_MOTOR_FLAGS = {
    "api_key": "Motor gives SGLang the engines' key itself (MOTOR_ENGINE_API_KEY, docs/security.md); "
    "a key of the request's own would lock Motor's probes and front door out",
    "config": "the engine server passes SGLang's --config itself (the file that holds the engines' key); "
    "give the flags in extra_args instead",
}

_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")
_OPTION = re.compile(r"-+[A-Za-z]")
# Top-level vLLM values that are names or secrets, not code (a served name may hold dots).
_VLLM_FREE_TEXT = {"served_model_name", "api_key", "hf_token"}


def normalise(key: Any) -> str:
    """A key as the engines read it: `--Trust-Remote-Code` -> `trust_remote_code`."""
    return str(key).strip().lstrip("-").lower().replace("-", "_")


def code_reason(key: Any) -> str | None:
    """What a key names when it names code to run (any engine, any level), else None."""
    for name in normalise(key).split("."):
        if name in CODE_KEYS:
            return CODE_KEYS[name]
        if name.endswith(("_cls", "_class")) or name in ("cls", "class"):
            return "a Python class the engine imports"
        if name.endswith(("module_path", "_module")) or name == "module":
            return "a Python module the engine imports"
        if "plugin" in name:
            return "a plugin the engine loads"
    return None


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


def embedded_json(value: str) -> Any:
    """The object or array a string holds as JSON (vLLM parses such strings), else None."""
    text = value.strip()
    if not text.startswith(("{", "[")):
        return None
    try:
        return json.loads(text)  # text starting with { or [ parses to an object or array, if at all
    except (ValueError, RecursionError):
        return None


class TooDeep(ValueError):
    """A document nests deeper than MAX_CONFIG_DEPTH (check_engine_config names the field)."""


def walk(value: Any, where: str, depth: int = 0) -> Iterator[tuple[str, str | None, Any]]:
    """(field path, key, value) for every value of a JSON document, strings holding JSON
    objects or arrays included; TooDeep past MAX_CONFIG_DEPTH levels."""
    if isinstance(value, str):
        inner = embedded_json(value)
        if inner is not None:
            yield from walk(inner, where, depth)
        return
    if not isinstance(value, (dict, list)):
        return
    if depth >= MAX_CONFIG_DEPTH:  # the document itself is level 1
        raise TooDeep()
    if isinstance(value, dict):
        items = [(f"{where}.{key}", str(key), item) for key, item in value.items()]
    else:
        items = [(f"{where}[{index}]", None, item) for index, item in enumerate(value)]
    for path, key, item in items:
        yield path, key, item
        yield from walk(item, path, depth + 1)


def config_depth_error(field: str) -> InvalidArgument:
    return InvalidArgument(f"{field}: nested deeper than {MAX_CONFIG_DEPTH} levels")


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not JSON (JSON numbers are finite)")


def _not_finite_text(text: str) -> bool:
    """'nan', '-inf', '1e999': what vLLM's and SGLang's argument parsers make a float that is not finite."""
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def parse_config_json(text: str, field: str) -> dict:
    """A request's JSON configuration as a dict; InvalidArgument naming `field` otherwise."""
    try:
        parsed = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise config_depth_error(field) from None
    except ValueError as exc:
        raise InvalidArgument(f"{field} is not a JSON object: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{field} is not a JSON object: {type(parsed).__name__}")
    return parsed


def _check_key(path: str, key: str, value: Any) -> None:
    reason = code_reason(key)
    if reason:
        raise InvalidArgument(
            f"{path}: names {reason}; a request may not choose what runs on a node "
            "(engine commands come from the node manager's --engine-command)"
        )
    name = normalise(key)
    if name in REFUSED_SECTIONS and isinstance(value, dict) and value.get("enable_tls"):
        raise InvalidArgument(f"{path}: not accepted in a request: {REFUSED_SECTIONS[name]}")
    if name in CODE_FLAGS and str(value).strip().lower() not in ("false", "0", "none"):
        raise InvalidArgument(f"{path}: must be false in a request: {CODE_FLAGS[name]}")


def _did_you_mean(name: str, names: frozenset[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_vllm_args(engine_args: dict, where: str) -> None:
    for key, value in engine_args.items():
        path, name = f"{where}.{key}", normalise(key).split(".")[0]
        if name in VLLM_REFUSED_ARGS:
            raise InvalidArgument(f"{path}: not accepted in a request: {VLLM_REFUSED_ARGS[name]}")
        if name in MOTOR_ENGINE_ARGS:
            continue  # read by the engine server itself
        if name not in VLLM_REQUEST_ARGS:  # every vLLM argument is either allowed or refused above
            raise InvalidArgument(
                f"{path}: not a vLLM {VLLM_VERSION_REVIEWED} argument{_did_you_mean(name, VLLM_REQUEST_ARGS)}"
            )
        if name in VLLM_ARG_CHOICES and value is not None and value not in VLLM_ARG_CHOICES[name]:
            raise InvalidArgument(
                f"{path}: must be one of {sorted(VLLM_ARG_CHOICES[name])} in a request (got {value!r})"
            )
        unsupported = unsupported_vllm_arg(name, value)
        if unsupported:
            raise InvalidArgument(f"{path}: {unsupported}")
        for inner, _, item in [(path, None, value), *walk(value, path)]:
            if not isinstance(item, str):
                continue
            if _DOTTED_NAME.fullmatch(item.strip()) and name not in _VLLM_FREE_TEXT:
                raise InvalidArgument(
                    f"{inner}: {item!r} is a Python name vLLM would import; not accepted in a request"
                )
            if _OPTION.match(item):
                raise InvalidArgument(f"{inner}: {item!r} looks like a command-line option; vLLM would read it as one")


def _check_sglang_extra_args(extra_args: Any, where: str) -> None:
    if not isinstance(extra_args, list):
        return  # the engine server refuses it (a list of strings)
    for index, item in enumerate(extra_args):
        if not isinstance(item, str) or not _OPTION.match(item):
            if index == 0:
                raise InvalidArgument(f"{where}[0]: {item!r}: extra_args must start with a --flag")
            continue  # a value of the flag before it
        flag = item.partition("=")[0]
        name = normalise(flag)
        path = f"{where}[{index}]"
        _check_key(path, name, True)
        if name in SGLANG_MOTOR_FLAGS:
            raise InvalidArgument(f"{path}: {flag}: {SGLANG_MOTOR_FLAGS[name]}")
        if name not in SGLANG_SERVER_FLAGS:
            close = difflib.get_close_matches(name, SGLANG_EXTRA_FLAGS, n=1)
            hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else ""
            raise InvalidArgument(f"{path}: {flag} is not an SGLang {SGLANG_VERSION_REVIEWED} flag{hint}")
        if name not in SGLANG_EXTRA_FLAGS or not item.startswith("--"):
            raise InvalidArgument(
                f"{path}: {flag} is not among the SGLang flags a request may add (SGLANG_EXTRA_FLAGS in "
                "motor/contract/engine_policy.py, docs/security.md)"
            )


def _check_engine_sections(config: dict, field: str) -> None:
    for section_name, section in config.items():
        if not isinstance(section, dict) or not isinstance(section.get("engine_args"), dict):
            continue
        engine_args, where = section["engine_args"], f"{field}.{section_name}.engine_args"
        engine_type = normalise(section.get("engine_type"))
        if engine_type == "vllm":
            _check_vllm_args(engine_args, where)
        elif engine_type == "sglang":
            _check_sglang_extra_args(engine_args.get("extra_args"), f"{where}.extra_args")


def check_engine_config(config: dict, model_roots: list[str] | None, field: str = "config_json") -> None:
    """Raise InvalidArgument naming the first key that would choose a program, code or a file.

    `model_roots` None (the controller, which cannot know each node's roots) skips the path
    check; the node manager repeats the whole check with its own roots."""
    roots_hint = (
        f"the node's model roots ({', '.join(model_roots)})"
        if model_roots
        else "a model root (the node allows no local paths: --model-root)"
    )
    check_paths = model_roots is not None
    try:
        for path, key, value in walk(config, field):
            if key is not None:
                _check_key(path, key, value)
            if (
                isinstance(value, float)
                and not math.isfinite(value)
                or isinstance(value, str)
                and _not_finite_text(value)
            ):
                # A protobuf Struct and embedded JSON strings carry them, and argument parsers read
                # "nan" as one; engines' range checks miss NaN.
                raise InvalidArgument(f"{path}: {value!r} is not a finite number; give a number")
            if check_paths and isinstance(value, str):
                for local in local_paths(value):
                    if not within(local, model_roots or []):
                        raise InvalidArgument(f"{path}: {local!r} is a local path outside {roots_hint}")
        _check_engine_sections(config, field)
    except TooDeep:
        raise config_depth_error(field) from None


def local_paths_outside(config: dict, model_roots: list[str], field: str = "engine_config") -> list[tuple[str, str]]:
    """(key path, local path) of every local path `config` names outside `model_roots`: what a
    node with those roots refuses to start (the rule of check_engine_config, for a controller
    holding a deployment against the roots its nodes announce, and for `motorctl up`)."""
    try:
        return [
            (path, local)
            for path, _, value in walk(config, field)
            if isinstance(value, str)
            for local in local_paths(value)
            if not within(local, model_roots)
        ]
    except TooDeep:
        raise config_depth_error(field) from None
