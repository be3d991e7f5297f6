"""The front door's own process (front_door/cli.py) in front of a stand-in router, for tests that
need it apart from the test's loop: its memory read from /proc, or killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

from motor.ports import free_port
from tests.support import REPO_ROOT, wait_for


class DoorProcess:
    """`python -m front_door` on a free port of loopback in front of `router_url`, told `served`."""

    def __init__(self, router_url: str, log_path: str, served: dict | None = None, extra=()) -> None:
        self.port, self.table_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "front_door", "--listen", f"127.0.0.1:{self.port}"]
        argv += ["--router", router_url, "--table", f"127.0.0.1:{self.table_port}", *extra]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        wait_for(lambda: self.push(served or {"m": None}), timeout=20, what="the front door's table port")

    def push(self, served: dict, unavailable: list[str] | None = None) -> bool:
        body = {"served": served} if unavailable is None else {"served": served, "unavailable": unavailable}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.table_port}/served", data=json.dumps(body).encode(), method="PUT"
        )
        with urllib.request.urlopen(request, timeout=2) as reply:
            return reply.status == 204

    def memory_kib(self, field: str = "VmRSS") -> int:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise AssertionError(f"no {field} for the door")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def door_log(tmp_path) -> str:
    return os.path.join(str(tmp_path), "front-door.log")
