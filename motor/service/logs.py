"""Logging set-up, called only by entry points (modules use logging.getLogger(__name__)).

Two formats: `text` (one readable line) and `json` (one JSON object per line, for log collectors:
time, level, service, logger, message, and the ids the line is about: node_id, instance_id,
engine_id, plus the event's reason). Ids come from three places, in this order: `extra=` of the
call (e.g. the controller's events), the convention that a message starting with "engine %s" names
the engine in its first argument, and the process's own ids given to setup_logging (a node
manager's node_id, an engine server's engine).
"""

from __future__ import annotations

import datetime
import json
import logging
import logging.handlers
import os
import sys
import time
from typing import Annotated, Any

from pydantic import AfterValidator

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The --log-level values every service accepts (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The --log-format values: readable lines, or one JSON object per line.
LOG_FORMATS = ("text", "json")


def check_log_format(value: str) -> str:
    """`text` or `json` (any case), or ValueError naming both (for pydantic validators)."""
    if not isinstance(value, str) or value.lower() not in LOG_FORMATS:
        raise ValueError("must be text or json")
    return value.lower()


def check_log_level(value: str) -> str:
    """The level in upper case, or ValueError listing the accepted ones (for pydantic validators)."""
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ValueError(f"must be {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}")
    return value.upper()


# A --log-level setting: any case in, upper case out.
LogLevel = Annotated[str, AfterValidator(check_log_level)]
# A --log-format setting: text or json, any case in, lower case out.
LogFormat = Annotated[str, AfterValidator(check_log_format)]


# Record attributes (set with `extra=`) that JSON lines carry when present.
ID_FIELDS = ("node_id", "instance_id", "engine_id", "event", "reason")


# The formatter setup_logging installed: lines this process writes into other logs (the launch
# line at the top of an engine's log file) use it too, so those files stay one format.
_active: logging.Formatter = logging.Formatter(LOG_FORMAT)


def launch_line(argv: list[str]) -> str:
    """The line a node manager writes at the top of an engine's log file before launching it:
    `--- <time> launching: <argv>`, or in JSON mode an object whose message starts "--- launching"."""
    if isinstance(_active, JsonFormatter):
        record = logging.LogRecord(
            "motor.processes", logging.INFO, __file__, 0, "--- launching: %s", (" ".join(argv),), None
        )
        return _active.format(record)
    return f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} launching: {' '.join(argv)}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line. `fields`: the process's own ids, on every line."""

    def __init__(self, fields: dict[str, str] | None = None):
        super().__init__()
        self.fields = {k: v for k, v in (fields or {}).items() if v not in (None, "")}

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            **self.fields,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if isinstance(record.msg, str) and record.msg.startswith("engine %s") and record.args:
            line["engine_id"] = str(record.args[0])
        for name in ID_FIELDS:
            value = getattr(record, name, None)
            if value not in (None, ""):
                line[name] = value
        engine = line.get("engine_id", "")
        if "/rank" in engine and "instance_id" not in line:
            line["instance_id"] = engine.rsplit("/rank", 1)[0]
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(
    level: str = "INFO",
    log_dir: str | None = None,
    file_name: str | None = None,
    max_bytes: int = 50 * 1024 * 1024,
    backup_count: int = 5,
    log_format: str = "text",
    fields: dict[str, str] | None = None,
) -> str | None:
    """Log to stderr, and also to a rotated file `log_dir/file_name` when both are given.

    Returns the log file path, if any.
    """
    root = logging.getLogger()
    root.setLevel(level.upper())
    for handler in list(root.handlers):
        root.removeHandler(handler)
    global _active
    formatter = JsonFormatter(fields) if log_format == "json" else logging.Formatter(LOG_FORMAT)
    _active = formatter
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(formatter)
    root.addHandler(stream)
    path = None
    if log_dir and file_name:
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, file_name)
        rotating = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backup_count)
        rotating.setFormatter(formatter)
        root.addHandler(rotating)
    # grpc's own chatter is rarely useful to an operator.
    logging.getLogger("grpc").setLevel(logging.WARNING)
    return path
