"""One way from command line (and an optional --config file) to a service's settings.

Every service describes its settings once, as a pydantic model (types, bounds, defaults, errors
naming the field), plus a help line per flag. Each flag is named after its setting
(`--heartbeat-interval` sets `heartbeat_interval`) and its help shows the model's real default.
A flag not given leaves the setting to the --config file (YAML or JSON, same names with '_'),
then to the model's default. Every error is a ConfigError naming the setting (entry points
exit with 2).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from motor.errors import ConfigError, MotorError
from motor.service.config import read_document, validate
from motor.service.event_loop import EventLoop, run_on

ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass(frozen=True)
class Flag:
    """A setting's flag: its help line, and argparse keywords (type, choices, action, required)."""

    help: str
    # How to show a default the model leaves to code (e.g. "<state-dir>/logs"); else the model's.
    default_text: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


def flag_name(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def default_text(model: type[BaseModel], setting: str, flag: Flag) -> str:
    """The default the help shows: from the model itself, so help and behaviour cannot disagree."""
    if flag.default_text is not None:
        return flag.default_text
    info = model.model_fields[setting]
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None or value == [] or value == {}:
        return "none"
    return str(value)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, model: type[BaseModel], flags: Mapping[str, Flag]
) -> None:
    """One flag per setting of `model` named in `flags`; unset flags leave the setting alone."""
    for setting, flag in flags.items():
        options = dict(flag.options)
        if not options.get("required"):
            options.setdefault("default", argparse.SUPPRESS)
        shown = default_text(model, setting, flag)
        parser.add_argument(
            flag_name(setting),
            dest=setting,
            help=f"{flag.help} [{shown if shown == 'required' else 'default: ' + shown}]",
            **options,
        )


def settings_parser(
    prog: str, description: str, model: type[BaseModel], flags: Mapping[str, Flag], config_file: bool = True
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    if config_file:
        parser.add_argument(
            "--config",
            default=argparse.SUPPRESS,
            help="YAML or JSON file with these settings, named with '_' (flags win)",
        )
    add_flags(parser, model, flags)
    return parser


def load_settings(model: type[ModelT], parser: argparse.ArgumentParser, argv: list[str] | None = None) -> ModelT:
    """Parse `argv`, lay the flags given over the --config file, validate into `model`."""
    given = vars(parser.parse_args(argv))
    path = given.pop("config", None)
    data: dict[str, Any] = {}
    source = "command line"
    if path is not None:
        source = f"{path} + command line"
        loaded = read_document(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of settings")
        data.update(loaded or {})
    data.update(given)
    for name, info in model.model_fields.items():
        if info.is_required() and name not in data:
            where = f" or {name} in --config" if parser.get_default("config") is not None else ""
            raise ConfigError(f"{name}: required ({flag_name(name)}{where})")
    return validate(model, data, source=source)


def run_service(
    prog: str,
    load: Callable[[], ModelT],
    start_logging: Callable[[ModelT], object],
    serve: Callable[[ModelT], Awaitable[None]],
    event_loop: Callable[[ModelT], EventLoop] = lambda _: "asyncio",
) -> int:
    """A service's main: settings (exit 2 naming the setting), logging, then `serve` until it
    returns (0), or exit 2 when it raises a MotorError (a port in use, a bad deployment file, a
    registration the controller refuses), logged with the reason."""
    try:
        config = load()
    except ConfigError as exc:
        print(f"{prog}: configuration error: {exc}", file=sys.stderr)
        return 2
    start_logging(config)
    try:
        run_on(event_loop(config), serve(config))
    except MotorError as exc:
        logging.getLogger(prog).error("%s", exc)
        return 2
    return 0
