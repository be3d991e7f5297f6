"""FrontDoors: what the routers' syncs report they route to, and the predicate rollouts and
spares count availability by (controller/routing/door_reports.py), on a clock moved by hand."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.model.events import EventBus
from controller.routing.door_reports import FORGET_AFTER, FrontDoorCollector, FrontDoors
from motor.errors import InvalidArgument
from motor.v1 import controller_pb2
from tests.support.controller_fakes import ManualClock

ROUTER = "http://127.0.0.1:8080"
A, B = "http://127.0.0.1:21000", "http://127.0.0.1:21001"


@pytest.fixture
def doors():
    return FrontDoors(EventBus(), ManualClock())  # its clock moves when told (doors.clock.advance)


def said(front: FrontDoors) -> list[str]:
    return [e.message for e in front.events.recent if e.type == controller_pb2.EVENT_TYPE_FRONT_DOOR]


def test_without_any_report_every_url_counts_as_routed(doors):
    """A cluster without a router, or a controller its sync has not reached yet: the feed decides."""
    assert doors.routes_to(A) and doors.routes_to("http://anything:1")
    doors.check()
    assert said(doors) == []


def test_a_fresh_report_routes_exactly_the_urls_its_router_holds(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    assert doors.routes_to(A)
    assert not doors.routes_to(B), "an engine the router does not hold is not reached through the front door"
    assert said(doors) == [
        f"front door {ROUTER}: motor-router-sync reports its router holds 1 worker(s); rollouts and spares count "
        "an engine available only when a front door routes to it"
    ]


def test_a_router_that_does_not_answer_its_sync_routes_nothing_and_is_said_each_way(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    doors.report(ROUTER, [], False, 2.0, "sync-1")
    assert not doors.routes_to(A)
    doors.report(ROUTER, [A, B], True, 2.0, "sync-1")
    assert doors.routes_to(A) and doors.routes_to(B)
    assert "its router does not answer its sync" in said(doors)[1]
    assert "its router answers its sync again; its router holds 2 worker(s)" in said(doors)[2]


def test_a_silent_sync_makes_the_front_door_stale_once_and_nothing_counts_as_routed(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    doors.clock.advance(5.9)
    doors.check()
    assert doors.routes_to(A), "within 3 report intervals the report holds"
    doors.clock.advance(0.2)
    doors.check()
    doors.check()
    assert not doors.routes_to(A), "a stale report says nothing of what the router routes to now"
    assert not doors.routes_to(B)
    stale = [m for m in said(doors) if "no report from motor-router-sync" in m]
    assert len(stale) == 1 and "for 6s" in stale[0] and "expected every 2s" in stale[0], said(doors)
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    assert doors.routes_to(A)
    assert said(doors)[-1] == f"front door {ROUTER} reports again after 6s of silence"


def test_a_restarted_sync_is_an_event_and_a_counted_restart(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    doors.clock.advance(10)
    doors.check()
    doors.report(ROUTER, [A], True, 2.0, "sync-2")
    assert said(doors)[-2:] == [
        f"front door {ROUTER} reports again after 10s of silence",
        f"front door {ROUTER}: motor-router-sync was restarted (start 2); it reports its router holds 1 worker(s)",
    ]
    registry = CollectorRegistry()
    registry.register(FrontDoorCollector(doors))
    text = generate_latest(registry).decode()
    assert f'motor_front_door_sync_restarts_total{{router="{ROUTER}"}} 1.0' in text
    assert f'motor_front_door_up{{router="{ROUTER}"}} 1.0' in text
    assert f'motor_front_door_workers{{router="{ROUTER}"}} 1.0' in text


def test_the_metrics_show_a_stale_front_door_down_with_its_age(doors):
    doors.report(ROUTER, [A, B], True, 1.0, "sync-1")
    doors.clock.advance(4)
    doors.check()
    registry = CollectorRegistry()
    registry.register(FrontDoorCollector(doors))
    text = generate_latest(registry).decode()
    assert f'motor_front_door_up{{router="{ROUTER}"}} 0.0' in text
    assert f'motor_front_door_report_age_seconds{{router="{ROUTER}"}} 4.0' in text


def test_a_front_door_silent_for_long_is_forgotten_and_the_feed_decides_again(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    doors.clock.advance(FORGET_AFTER + 1)
    doors.check()
    assert doors.routes_to(B)
    assert "forgotten (a router retired for good): the controller's endpoints alone decide" in said(doors)[-1]


def test_with_several_front_doors_a_url_any_fresh_one_routes_to_counts(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    doors.report("http://127.0.0.1:8081", [B], True, 2.0, "sync-x")
    assert doors.routes_to(A) and doors.routes_to(B)
    assert not doors.routes_to("http://127.0.0.1:21002")


@pytest.mark.parametrize(
    "router, interval, named",
    [("", 2.0, "router: required"), (ROUTER, 0.0, "report_interval: must be above 0")],
)
def test_a_bad_report_is_refused_naming_the_field(doors, router, interval, named):
    with pytest.raises(InvalidArgument, match=named):
        doors.report(router, [A], True, interval, "sync-1")
    assert doors.routes_to(A)


def test_a_router_restart_the_sync_counted_is_an_event_once_and_a_new_sync_counts_from_zero(doors):
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    doors.report(ROUTER, [A], True, 2.0, "sync-1", router_restarts=1)
    doors.report(ROUTER, [A], True, 2.0, "sync-1", router_restarts=1)
    restarted = [m for m in said(doors) if "its router was restarted" in m]
    assert restarted == [
        f"front door {ROUTER}: its router was restarted (it stopped answering its sync, or lost workers it held); "
        "the sync gave it its whole list again: its router holds 1 worker(s)"
    ]
    doors.report(ROUTER, [A], True, 2.0, "sync-2", router_restarts=1)  # the restarted sync saw one too
    registry = CollectorRegistry()
    registry.register(FrontDoorCollector(doors))
    assert f'motor_front_door_router_restarts_total{{router="{ROUTER}"}} 2.0' in generate_latest(registry).decode()


def test_what_stopping_an_engine_would_cost_reads_an_unknown_as_routed(doors):
    """may_route_to: the router may still send requests to an engine while its front door is stale
    or not answering its sync, so a change must not stop it as if nobody reached it."""
    assert doors.may_route_to(A)
    doors.report(ROUTER, [A], True, 2.0, "sync-1")
    assert doors.may_route_to(A) and not doors.may_route_to(B)
    doors.clock.advance(7)
    doors.check()
    assert not doors.routes_to(A), "not counted available through a stale front door ..."
    assert doors.may_route_to(A) and doors.may_route_to(B), "... nor taken as unreached"
    doors.report(ROUTER, [], False, 2.0, "sync-1")
    assert doors.may_route_to(B) and not doors.routes_to(B)
