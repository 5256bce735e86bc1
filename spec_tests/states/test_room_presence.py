"""The room-presence book: which of the controller's and the empty room's timeouts runs, and what it means."""

from __future__ import annotations

import pytest

from states.room_presence import RoomPresence, State, Timer
from states.stream_session import FAILING_CAUSES, DrainCause, Event, settle_event


def book(**overrides: float) -> RoomPresence:
    values = {"controller_timeout": 60.0, "room_empty_timeout": 30.0, "started_at": 0.0}
    values.update(overrides)
    return RoomPresence("ctl", **values)


def test_a_room_nobody_entered_waits_for_its_controller_not_for_emptiness():
    presence = book()
    assert presence.deadline() == (60.0, Timer.CONTROLLER_ABSENT)
    assert presence.due(59.9) is None and presence.due(60.0) is Timer.CONTROLLER_ABSENT
    assert presence.state is State.ENDED


def test_a_viewer_who_leaves_before_the_controller_came_starts_the_empty_room_timer():
    presence = book()
    presence.joined("viewer", 5.0)
    assert presence.deadline() == (60.0, Timer.CONTROLLER_ABSENT)
    presence.left("viewer", 10.0)
    assert presence.state is State.AWAITING_EMPTY and presence.deadline() == (40.0, Timer.ROOM_EMPTY)
    presence.joined("viewer", 20.0)  # back: the room is not empty any more
    assert presence.deadline() == (60.0, Timer.CONTROLLER_ABSENT)


def test_the_controller_leaving_runs_its_timer_and_the_empty_room_one_while_nobody_is_left():
    presence = book(controller_timeout=20.0)
    presence.joined("ctl", 1.0)
    assert presence.deadline() is None
    presence.joined("viewer", 2.0)
    presence.left("ctl", 10.0)
    assert presence.state is State.AWAY and presence.deadline() == (30.0, Timer.CONTROLLER_LEFT)
    presence.left("viewer", 12.0)
    assert presence.state is State.AWAY_EMPTY and presence.deadline() == (30.0, Timer.CONTROLLER_LEFT)
    presence.joined("ctl", 25.0)  # the controller's return ends both
    assert presence.state is State.PRESENT and presence.deadline() is None and presence.due(99.0) is None


def test_an_empty_room_ends_first_when_its_timeout_is_shorter():
    presence = book(controller_timeout=60.0, room_empty_timeout=5.0)
    presence.joined("ctl", 1.0)
    presence.left("ctl", 10.0)
    assert presence.deadline() == (15.0, Timer.ROOM_EMPTY)
    assert presence.due(15.0) is Timer.ROOM_EMPTY and presence.ended_by is Timer.ROOM_EMPTY


def test_bad_timeouts_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="room_empty_timeout"):
        book(room_empty_timeout=0)


def test_each_drain_cause_settles_as_its_table_says():
    assert settle_event(DrainCause.EXPIRED, failed=False) is Event.EXPIRE
    assert settle_event(DrainCause.ROOM_EMPTY, failed=False) is Event.COMPLETE
    assert settle_event(DrainCause.DELETED, failed=True) is Event.FAIL
    assert FAILING_CAUSES == {DrainCause.CONTROLLER_ABSENT, DrainCause.CONTROLLER_LEFT, DrainCause.WORKER_FAILED,
                              DrainCause.PIPELINE_STALLED}
    assert {timer.value for timer in Timer} <= {cause.value for cause in DrainCause}  # a timeout names its cause
