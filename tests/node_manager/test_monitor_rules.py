"""EngineMonitor alone, on fakes (fake clock, scripted engine, recording listener): what it tells
its listener, what it writes on the record, what it logs, how it follows the probe stream.

Written to kill the mutants `make mutation` found surviving; the kill decision built on it is in
test_kill_decision.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from motor.v1 import engine_pb2, types_pb2
from node_manager.config import NodeManagerConfig
from node_manager.engine import RUNNING, STARTING, EngineRecord
from node_manager.health import Verdict
from node_manager.monitor import EngineMonitor
from tests.support.node_manager_fakes import ABNORMAL, NORMAL, FakeClock, FakeEngine, FakeEngineClient, settle, sim_spec

ENGINE_ID = "prefill-0/rank0"


class Listener:
    def __init__(self) -> None:
        self.verdicts: list[tuple[Verdict, bool]] = []
        self.messages: list[engine_pb2.WatchProbesResponse] = []

    def on_verdict(self, record, verdict, changed) -> None:
        self.verdicts.append((verdict, changed))

    def on_stream_message(self, record, message) -> None:
        self.messages.append(message)


class Watched:
    """One record watched by one monitor, with the fakes around it."""

    def __init__(self, state=STARTING, slow_answers: float = 0.0):
        self.clock = FakeClock()
        self.engine = FakeEngine(self.clock)
        self.config = NodeManagerConfig(node_id="node-f", state_dir="/nonexistent", heartbeat_interval=0.5,
                                        status_timeout=0.5, abnormal_threshold=3, startup_grace=60)  # fmt: skip
        self.record = EngineRecord(spec=sim_spec(), requested=sim_spec(), log_path="/nonexistent", token="t",
                                   state=state, started_at=self.clock.time())  # fmt: skip
        self.listener = Listener()
        self.latencies: list[float] = []
        self.slow_answers = slow_answers
        self.monitor = EngineMonitor(self.record, self.config, self._client, self.clock, self.listener,
                                     self.latencies.append)  # fmt: skip

    def _client(self, spec):
        client = FakeEngineClient(self.engine)
        if self.slow_answers:
            answer = client.get_status

            async def slow(timeout):
                status = await answer(timeout)
                self.clock.advance(self.slow_answers)
                return status

            client.get_status = slow
        return client

    def start(self) -> None:
        self.monitor.start(asyncio.ensure_future)

    async def answer(self, answer) -> None:
        await settle(lambda: self.engine.waiting)
        calls = self.engine.calls
        self.engine.answers.put_nowait(answer)
        await settle(lambda: self.engine.calls > calls)

    async def stop(self) -> None:
        tasks = self.monitor.tasks
        self.monitor.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def watched():
    made: list[Watched] = []

    def make(**kwargs) -> Watched:
        made.append(Watched(**kwargs))
        return made[-1]

    yield make
    for w in made:
        await w.stop()


async def test_each_verdict_is_written_on_the_record_and_told_with_whether_it_changed(watched):
    w = watched()
    w.start()
    await w.answer(NORMAL)
    await w.answer(NORMAL)
    await w.answer(ABNORMAL)
    assert [(v.health, v.reason, changed) for v, changed in w.listener.verdicts] == [
        (types_pb2.HEALTH_STATUS_NORMAL, "ok", True),
        (types_pb2.HEALTH_STATUS_NORMAL, "ok", False),
        (types_pb2.HEALTH_STATUS_ABNORMAL, "ABNORMAL: probe failed", True),
    ]
    assert (w.record.health, w.record.health_reason, w.record.consecutive_abnormal) == (
        types_pb2.HEALTH_STATUS_ABNORMAL,
        "ABNORMAL: probe failed",
        1,
    )
    assert w.record.ever_answered is True


async def test_a_running_engine_counts_as_having_answered(watched):
    w = watched(state=RUNNING)  # e.g. adopted after a node-manager restart
    w.start()
    await w.answer("GetStatus failed: UNAVAILABLE")  # within the start-up grace, but not starting
    verdict, _ = w.listener.verdicts[0]
    assert verdict.counted and verdict.reason == "no answer: GetStatus failed: UNAVAILABLE"


async def test_abnormal_heartbeats_are_logged_with_the_count(watched, caplog):
    w = watched()
    w.start()
    await w.answer(NORMAL)
    await w.answer(ABNORMAL)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "node_manager.monitor"] == [
        ("WARNING", f"engine {ENGINE_ID}: abnormal heartbeat 1/3: ABNORMAL: probe failed")
    ]


async def test_the_latency_of_an_answered_call_is_observed(watched):
    w = watched(slow_answers=0.2)
    w.start()
    await w.answer(NORMAL)
    assert w.latencies == [pytest.approx(0.2)]


async def test_a_failed_call_that_began_when_the_stream_answered_is_judged(watched):
    w = watched(state=RUNNING)
    w.start()
    await settle(lambda: w.engine.waiting)  # the call began; the fake clock has not moved since
    w.engine.stream.put_nowait(engine_pb2.WatchProbesResponse(status=NORMAL))
    await settle(lambda: w.listener.messages)
    await w.answer("GetStatus timed out after 0.5s")
    assert [v.counted for v, _ in w.listener.verdicts] == [True]


async def test_the_probe_stream_keeps_the_last_probes_and_reconnects_after_an_interval(watched, caplog):
    caplog.set_level(logging.DEBUG, logger="node_manager.monitor")
    w = watched()
    w.start()
    probe = types_pb2.ProbeResult(outcome=types_pb2.PROBE_OUTCOME_SUCCESS, consecutive_failures=0)
    w.engine.stream.put_nowait(engine_pb2.WatchProbesResponse(status=NORMAL, probe=probe))
    await settle(lambda: len(w.listener.messages) == 1)
    assert w.record.last_probe == probe and list(w.record.recent_probes) == [probe]
    assert w.record.stream_heard_at == w.clock.monotonic()
    before = w.clock.monotonic()
    w.engine.stream.put_nowait(None)  # the stream breaks
    w.engine.stream.put_nowait(engine_pb2.WatchProbesResponse(status=NORMAL))
    await settle(lambda: len(w.listener.messages) == 2)
    assert w.clock.monotonic() - before >= 0.5  # it waited one heartbeat interval before reconnecting
    assert f"engine {ENGINE_ID}: probe stream ended: UNAVAILABLE" in [r.getMessage() for r in caplog.records]


async def test_a_monitor_can_be_stopped_before_it_starts_and_twice(watched):
    w = watched()
    w.monitor.stop()
    w.start()
    await w.stop()
    w.monitor.stop()
    assert w.monitor.tasks == []
