"""The termination message: a process's own cause of exit, one JSON line in a file.

As with Kubernetes' terminationMessagePath, the process that exits knows why far better than
the last lines of its log: the engine server writes the cause (`--termination-message-path`)
just before it exits, and the node manager that launched it reads the file after the exit, so
events and `motorctl` show the cause first and the log tail second.

    {"exit_code": 1, "cause": "engine_died", "message": "the engine died: engine-core process ...", "time": "..."}
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

# Causes an engine server gives: its exit code says success or failure, the cause says which.
# config_error is a refusal of the spec itself (its node manager does not launch it again at once);
# port_taken (exit 2 too) is the moment's: another process holds the management port.
STOPPED, CONFIG_ERROR, START_FAILED, ENGINE_DIED = "stopped", "config_error", "start_failed", "engine_died"
PORT_TAKEN = "port_taken"
# A message longer than this is cut (a node manager keeps it in every engine report).
MAX_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class TerminationMessage:
    exit_code: int
    cause: str
    message: str
    time: str = ""

    def describe(self) -> str:
        return f"{self.cause}: {self.message}"


def write_termination_message(path: str, exit_code: int, cause: str, message: str) -> None:
    """Write the message atomically (a reader never sees half a line); never raises."""
    record = TerminationMessage(exit_code, cause, message[:MAX_MESSAGE_CHARS], time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w") as file:
            file.write(json.dumps(asdict(record)) + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        logger.warning("cannot write the termination message to %s: %s", path, exc)


def read_termination_message(path: str) -> TerminationMessage | None:
    """The message a process left at `path`, or None when there is none or it is unreadable."""
    try:
        with open(path) as file:
            data = json.loads(file.readline())
        return TerminationMessage(
            exit_code=int(data["exit_code"]), cause=str(data["cause"]),
            message=str(data["message"])[:MAX_MESSAGE_CHARS], time=str(data.get("time", "")),
        )  # fmt: skip
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("unreadable termination message %s: %s", path, exc)
        return None
