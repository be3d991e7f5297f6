"""Logging set-up, called only by entry points (modules use logging.getLogger(__name__))."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from typing import Annotated

from pydantic import AfterValidator

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The --log-level values every service accepts (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_log_level(value: str) -> str:
    """The level in upper case, or ValueError listing the accepted ones (for pydantic validators)."""
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ValueError(f"must be {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}")
    return value.upper()


# A --log-level setting: any case in, upper case out.
LogLevel = Annotated[str, AfterValidator(check_log_level)]


def setup_logging(
    level: str = "INFO",
    log_dir: str | None = None,
    file_name: str | None = None,
    max_bytes: int = 50 * 1024 * 1024,
    backup_count: int = 5,
) -> str | None:
    """Log to stderr, and also to a rotated file `log_dir/file_name` when both are given.

    Returns the log file path, if any.
    """
    root = logging.getLogger()
    root.setLevel(level.upper())
    for handler in list(root.handlers):
        root.removeHandler(handler)
    formatter = logging.Formatter(LOG_FORMAT)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(formatter)
    root.addHandler(stream)
    path = None
    if log_dir and file_name:
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, file_name)
        rotating = logging.handlers.RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=backup_count
        )
        rotating.setFormatter(formatter)
        root.addHandler(rotating)
    # grpc's own chatter is rarely useful to an operator.
    logging.getLogger("grpc").setLevel(logging.WARNING)
    return path
