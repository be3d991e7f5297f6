"""Typed configuration loading: JSON or YAML files into pydantic models.

Every error names the field to change, e.g.
`health_check_config.max_failure_count: must be >= 1 (got 0)`.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import shlex
import typing
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ValidationError

from motor.errors import ConfigError
from motor.text import excerpt

ModelT = TypeVar("ModelT", bound=BaseModel)


def split_host_port(value: str) -> tuple[str, int]:
    """'0.0.0.0:50051' -> ('0.0.0.0', 50051); '[::1]:0' -> ('::1', 0); ValueError otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be host:port with a port in 0-65535 (e.g. 0.0.0.0:50051)")
    return host.strip("[]"), int(port)


def _check_host_port(value: str) -> str:
    split_host_port(value)
    return value


# A setting holding a listen or dial address (port 0 allowed: any free port).
HostPort = Annotated[str, AfterValidator(_check_host_port)]


def _check_readable(path: str) -> str:
    if not os.access(path, os.R_OK):
        raise ValueError(f"cannot read {path!r}")
    return path


# A setting naming a file this process must be able to read (a certificate, a key, tokens).
ReadableFile = Annotated[str, AfterValidator(_check_readable)]


def _check_absolute_command(value: str) -> str:
    argv = shlex.split(value)
    if not argv or not os.path.isabs(argv[0]) or not os.path.isfile(argv[0]) or not os.access(argv[0], os.X_OK):
        raise ValueError(
            "must start with the absolute path of an executable file "
            "(e.g. /opt/sglang/bin/python -m sglang.launch_server)"
        )
    return value


# A command line set by the operator only (split like a shell), whose program is named by its
# absolute path: what a node runs is never looked up on a PATH someone else may change.
AbsoluteCommand = Annotated[str, AfterValidator(_check_absolute_command)]


def field_path(loc: tuple[Any, ...], prefix: str = "") -> str:
    parts = [prefix] if prefix else []
    for item in loc:
        parts.append(f"[{item}]" if isinstance(item, int) else str(item))
    return ".".join(parts).replace(".[", "[")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`HealthCheckConfig | None` -> HealthCheckConfig)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def closest_field(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """The field of `model` nearest in spelling to the unknown key at `loc` (its last item), or None."""
    for item in loc[:-1]:
        field = model.model_fields.get(item) if model is not None and isinstance(item, str) else None
        model = _model_in(field.annotation) if field is not None else None
    if model is None or not loc:
        return None
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return close[0] if close else None


# A key a path can spell as `a.b.c`; any other (empty, spaced, capitalised) is quoted after the path.
_PLAIN_KEY = re.compile(r"[a-z_][a-z0-9_]*")


def _split_at_odd_key(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], str | None]:
    """(the path up to the first key a path cannot spell, that key)."""
    for index, item in enumerate(loc):
        if isinstance(item, str) and not _PLAIN_KEY.fullmatch(item):
            return loc[:index], item
    return loc, None


def describe_validation_error(exc: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """One line per problem: `<field path>: <message> (got <value>)`; with the `model` that was
    validated, an unknown key also names the closest field (`did you mean 'latency_ms'?`)."""
    lines = []
    for error in exc.errors():
        loc, odd_key = _split_at_odd_key(error["loc"])
        path = field_path(loc, prefix) or "(top level)"
        message = error["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if odd_key is not None:  # `engine_config: key '': ...`, not `engine_config.: ...`
            message = f"key {excerpt(odd_key)}: {message}"
        if error["type"] == "extra_forbidden" and model is not None:
            close = closest_field(model, error["loc"])
            message += f"; did you mean {close!r}?" if close else ""
        got = error.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {excerpt(got)})"
        lines.append(f"{path}: {message}{shown}")
    return "; ".join(lines)


def validate(model: type[ModelT], data: Any, source: str = "", prefix: str = "") -> ModelT:
    """Validate `data` into `model`, raising ConfigError that names each bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}{describe_validation_error(exc, prefix, model)}") from None


class _DocumentLoader(yaml.SafeLoader):
    """YAML as people write configuration: a key written twice is an error (PyYAML kept the last
    value silently, so half an edit won), and `1e3` is a number, as in YAML 1.2 and JSON (PyYAML,
    YAML 1.1, read it as a string, which made quoted numbers pass for numbers too)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base`: the keys written beside it override the merged ones
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable):
                    continue  # SafeLoader itself refuses it, with its own message
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {excerpt(key)}: write each key once", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_DocumentLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {excerpt(key)}: write each key once")
        out[key] = value
    return out


def read_document(path: str) -> Any:
    """Read a JSON or YAML file (YAML is a superset of JSON; .json files get JSON errors); a key
    written twice in one mapping is refused, naming it and its line."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        if path.endswith(".json"):
            return json.loads(text, object_pairs_hook=_unique_keys)
        return yaml.load(text, Loader=_DocumentLoader)  # noqa: S506 (a SafeLoader)
    except (json.JSONDecodeError, yaml.YAMLError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}") from None


def load(model: type[ModelT], path: str, prefix: str = "") -> ModelT:
    """Read `path` and validate it into `model`."""
    data = read_document(path)
    if data is None:
        data = {}
    return validate(model, data, source=path, prefix=prefix)


def prepare_directory(
    setting: str, directory: str, subdirectories: tuple[str, ...] = (), files: tuple[str, ...] = ()
) -> None:
    """Create `directory` if needed and check what lives in it has the right kind: a ConfigError
    naming `setting` and the path otherwise (a file where a directory belongs, or the reverse),
    rather than a traceback from deep inside the service."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{setting}: cannot create the directory {directory} ({exc.strerror}: "
            f"{exc.filename}); choose another path or move what is in the way"
        ) from None
    for name in subdirectories:
        path = os.path.join(directory, name)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ConfigError(
                f"{setting}: {path} must be a directory but is not; move it away (or choose another path)"
            )
    for name in files:
        path = os.path.join(directory, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ConfigError(
                f"{setting}: {path} must be a regular file but is not (a directory?); move it away "
                "(or choose another path)"
            )


LOOPBACK_NAMES = {"localhost"}


def is_loopback(bind: str) -> bool:
    """'127.0.0.1:50051', '[::1]:0', 'localhost:1' -> True; '0.0.0.0:50051', ':50051' -> False."""
    host = bind.rsplit(":", 1)[0].strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
