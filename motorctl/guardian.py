"""The guardian of a `motorctl up` cluster: stops it if `motorctl up` dies without stopping it.

`motorctl up` handles every way it can end except the ones it cannot see: SIGKILL, the OOM
killer, a crash of the interpreter. The guardian runs in its own session (a closed terminal or a
Ctrl-C to `motorctl up`'s process group does not reach it) and reads a pipe from `motorctl up`:
the line "stopped" means the cluster was stopped and it exits; the pipe closing without it means
`motorctl up` is gone, and the guardian stops every process of the run (motorctl/run_processes.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from motorctl.run_processes import stop_run

DONE = b"stopped\n"


def spawn(run_dir: str) -> subprocess.Popen:
    log_dir = os.path.join(run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, "guardian.log"), "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "motorctl.guardian", os.path.abspath(run_dir)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def release(guardian: subprocess.Popen) -> None:
    """Tell the guardian the cluster was stopped, and let it go."""
    try:
        assert guardian.stdin is not None
        guardian.stdin.write(DONE)
        guardian.stdin.close()
        guardian.wait(5)
    except (OSError, subprocess.TimeoutExpired):
        guardian.kill()


def main() -> int:
    run_dir = sys.argv[1]
    if sys.stdin.buffer.readline() == DONE:
        return 0
    print(f"{time.strftime('%H:%M:%S')} motorctl up ended without stopping the cluster: stopping it", flush=True)
    for process in stop_run(run_dir):
        print(f"  stopped {process}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
