"""The engine server's load meter (engine_server/load_meter.py): the autoscaler's signal at the
edges of its window."""

from __future__ import annotations

from engine_server.load_meter import InFlightMeter


def test_the_mean_is_over_the_readings_of_the_last_second():
    meter = InFlightMeter()
    for tick in range(40):  # 2 s of readings every 50 ms: 0 in the first second, 4 in the second
        meter.add(tick * 0.05, 0 if tick < 20 else 4)
    assert meter.average(1.95, 4) == 4.0


def test_a_second_without_readings_reports_the_count_read_now_not_none():
    # The engine server's loop was held longer than the window (a long prompt tokenized on it):
    # no reading is younger than a second, yet 50 requests are in flight. Read as 0 it would say
    # the engine is idle at the moment it is busiest.
    meter = InFlightMeter()
    meter.add(0.0, 50)
    assert meter.average(1.5, 50) == 50.0
    assert InFlightMeter().average(0.0, 0) == 0.0  # nothing read yet, nothing in flight
