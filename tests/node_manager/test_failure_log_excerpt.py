"""An engine failure's log excerpt holds only what may explain it: the lines since the engine's
last launch, without the records of another client's malformed request (an HTTP/2 preface from a
port scan logged by the engine's HTTP server), which read as the cause."""

from __future__ import annotations

from node_manager.engine import EngineRecord
from tests.support.node_manager_fakes import sim_spec

LOG = """--- 2026-01-01T10:00:00 launching: python -m engine_server.cli --port 21006
2026-01-01 10:00:01,000 INFO engine_server: serving
2026-01-01 10:00:09,000 ERROR engine_server: CUDA out of memory (the previous run's end)
--- 2026-01-01T10:01:00 launching: python -m engine_server.cli --port 21006
2026-01-01 10:01:01,000 INFO engine_server: engine decode-0/rank0 serving on 127.0.0.1:21006
2026-01-01 10:01:05,000 ERROR aiohttp.server: Error handling request from 127.0.0.1
Traceback (most recent call last):
  File "aiohttp/_http_parser.pyx", line 557, in aiohttp._http_parser.HttpParser.feed_data
aiohttp.http_exceptions.BadHttpMessage: 400, message:
  Pause on PRI/Upgrade:

    b'\\x00\\x00\\x12\\x04\\x00\\x00\\x00\\x00\\x00'
      ^
2026-01-01 10:01:06,000 INFO engine_server: load 3 in flight
"""


def record(tmp_path, text: str) -> EngineRecord:
    path = tmp_path / "engine.log"
    path.write_text(text)
    return EngineRecord(spec=sim_spec(), requested=sim_spec(), log_path=str(path), token="t")


def test_the_excerpt_leaves_out_the_earlier_runs_and_another_clients_garbage(tmp_path):
    tail = record(tmp_path, LOG).log_tail(5)
    assert "serving on 127.0.0.1:21006" in tail and "load 3 in flight" in tail
    for stray in ("PRI/Upgrade", "\\x00", "Error handling request", "Traceback", "out of memory", "launching"):
        assert stray not in tail, (stray, tail)


def test_a_traceback_of_the_engine_itself_is_kept(tmp_path):
    crash = LOG + (
        "2026-01-01 10:01:07,000 ERROR engine_server: the engine loop died\n"
        "Traceback (most recent call last):\n"
        '  File "engine.py", line 3, in run\n'
        "RuntimeError: worker lost\n"
    )
    tail = record(tmp_path, crash).log_tail(4)
    assert tail.endswith("RuntimeError: worker lost") and "the engine loop died" in tail, tail


def test_an_engine_that_logged_nothing_since_its_launch_has_no_excerpt(tmp_path):
    assert record(tmp_path, LOG + "--- 2026-01-01T10:02:00 launching: python -m engine_server.cli\n").log_tail(5) == ""
