"""The room-presence book: which of the controller's and the empty room's timeouts runs, and what it means."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from states import explore_room_presence, stream_session
from states.explore import explore
from states.room_presence import TIMERS, RoomPresence, State, Timer
from states.stream_session import FAILING_CAUSES, QUEUED_ENDS_WITH, DrainCause, Event, settle_event


def book(**overrides: float) -> RoomPresence:
    values = {"controller_timeout": 60.0, "room_empty_timeout": 30.0, "started_at": 0.0}
    values.update(overrides)
    return RoomPresence("ctl", **values)


def test_a_room_nobody_entered_waits_for_its_controller_not_for_emptiness():
    presence = book()
    assert presence.deadline() == (60.0, Timer.CONTROLLER_ABSENT)
    assert presence.due(59.9) is None and presence.due(60.0) is Timer.CONTROLLER_ABSENT
    assert presence.state is State.ENDED


def test_a_viewer_who_leaves_before_the_controller_came_leaves_the_controller_s_deadline_alone():
    """It started the room-empty timer, which passed first (10 + 30 < 60): the session ended as room_empty."""
    presence = book()
    presence.joined("viewer", 5.0)
    assert presence.deadline() == (60.0, Timer.CONTROLLER_ABSENT)
    presence.left("viewer", 10.0)
    assert presence.state is State.AWAITING_EMPTY and presence.deadline() == (60.0, Timer.CONTROLLER_ABSENT)
    assert presence.due(40.0) is None and presence.state is State.AWAITING_EMPTY
    presence.joined("viewer", 41.0)
    presence.left("viewer", 42.0)
    assert presence.due(59.9) is None and presence.due(60.0) is Timer.CONTROLLER_ABSENT


def test_until_the_controller_came_its_deadline_is_the_only_timer_and_the_empty_room_s_needs_it_gone():
    """The rule over the whole table: where the controller's absence is timed, nothing else is; the empty room's
    timer runs only where the controller's departure is timed beside it."""
    for state, timers in TIMERS.items():
        if Timer.CONTROLLER_ABSENT in timers:
            assert timers == (Timer.CONTROLLER_ABSENT,), state
        if Timer.ROOM_EMPTY in timers:
            assert timers[0] is Timer.CONTROLLER_LEFT, state  # and the controller's first on a tie


def test_viewers_after_the_controller_left_only_put_the_end_off():
    presence = book()  # controller 60 s, room empty 30 s
    presence.joined("ctl", 0.0)
    presence.left("ctl", 10.0)  # the controller left last: the empty room ends it at 40 s, normally
    assert presence.deadline() == (40.0, Timer.ROOM_EMPTY)
    presence.joined("viewer", 20.0)
    presence.left("viewer", 25.0)
    assert presence.deadline() == (55.0, Timer.ROOM_EMPTY)
    presence.joined("viewer", 30.0)
    presence.left("viewer", 50.0)  # the controller's deadline comes first: it left and did not come back
    assert presence.deadline() == (70.0, Timer.CONTROLLER_LEFT)


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
                              DrainCause.PIPELINE_STALLED, DrainCause.PIPELINE_FAILED, DrainCause.TRANSPORT_FAILED,
                              DrainCause.START_FAILED}
    assert {timer.value for timer in Timer} <= {cause.value for cause in DrainCause}  # a timeout names its cause


def test_each_way_a_queued_session_ends_is_a_move_its_table_allows():
    for cause, event in QUEUED_ENDS_WITH.items():
        assert (stream_session.State.QUEUED, event) in stream_session.TRANSITIONS, cause
    assert QUEUED_ENDS_WITH[DrainCause.DELETED] is Event.WITHDRAW and QUEUED_ENDS_WITH[DrainCause.SHUTDOWN] is Event.FAIL


# -- exhaustive exploration and a model test -------------------------------------------------------


def test_the_explorer_finds_no_violation_and_every_timer_can_end_the_watch():
    reports = [explore(config) for config in explore_room_presence.configurations(small=True)]
    assert all(report.violations == () and report.states > 100 for report in reports), [r.line() for r in reports]
    assert explore_room_presence.ended_by_each_timer() == set(Timer)  # each timeout can happen


def test_the_explorer_catches_a_room_empty_timer_that_runs_before_anyone_came(monkeypatch):
    monkeypatch.setitem(TIMERS, State.AWAITING, (Timer.CONTROLLER_ABSENT, Timer.ROOM_EMPTY))
    monkeypatch.setattr(RoomPresence, "__attrs_post_init__", lambda self: setattr(self, "emptied_at", 0.0))
    (report, *_) = [explore(config) for config in explore_room_presence.configurations(small=True)]
    assert report.violations, report.line()


def test_the_explorer_catches_viewers_ending_a_session_before_its_controller_came(monkeypatch):
    """The table as it was, and with the definitions the explorer checks it against made to agree with it: the
    invariant that others never bring the end before the controller's own still finds it."""
    monkeypatch.setitem(TIMERS, State.AWAITING_EMPTY, (Timer.CONTROLLER_ABSENT, Timer.ROOM_EMPTY))
    monkeypatch.setattr(explore_room_presence, "expected_deadline", lambda world: world.book.deadline())
    reports = [explore(config) for config in explore_room_presence.configurations(small=True)]
    found = [violation for report in reports for violation in report.violations]
    assert any("before the controller's own" in str(v) or "never came" in str(v) for v in found), \
        [r.line() for r in reports]


class PresenceModel(RuleBasedStateMachine):
    """The book against the definitions: who is here, when the controller left, when the room emptied."""

    def __init__(self) -> None:
        super().__init__()
        self.book = RoomPresence("ctl", 7.0, 5.0, 0.0)
        self.now = 0.0
        self.here: set[str] = set()
        self.controller_came = False
        self.left_at: float | None = None
        self.emptied_at: float | None = None
        self.ended: Timer | None = None

    def expected(self) -> tuple[float, Timer] | None:
        due = []
        if "ctl" not in self.here:
            due.append((self.left_at + 7.0, 0, Timer.CONTROLLER_LEFT) if self.controller_came
                       else (7.0, 0, Timer.CONTROLLER_ABSENT))
        if not self.here and self.emptied_at is not None and self.controller_came:
            due.append((self.emptied_at + 5.0, 1, Timer.ROOM_EMPTY))
        return min(due)[::2] if due else None

    @rule(who=st.sampled_from(["ctl", "v0", "v1"]))
    def join_or_leave(self, who: str) -> None:
        if self.ended is not None:  # the watch is over: joins and departures change nothing
            (self.book.left if who in self.book.participants else self.book.joined)(who, self.now)
            return
        if who in self.here:
            self.book.left(who, self.now)
            self.here.discard(who)
            if who == "ctl":
                self.left_at = self.now
            if not self.here:
                self.emptied_at = self.now
        else:
            self.book.joined(who, self.now)
            self.here.add(who)
            self.controller_came |= who == "ctl"
            self.emptied_at = None

    @precondition(lambda self: self.ended is None)
    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0, 5.0, 7.0]))
    def time_passes(self, seconds: float) -> None:
        expected = self.expected()
        self.now += seconds
        ended = self.book.due(self.now)
        assert ended is (expected[1] if expected is not None and expected[0] <= self.now else None)
        self.ended = ended

    @invariant()
    def others_never_hasten_the_end(self) -> None:
        """Whoever comes and goes, the end is no nearer than the controller's own (7 s from the start for one that
        never came, and then only as absent; the earlier of 7 s and 5 s from its departure)."""
        if "ctl" in self.here and self.ended is None:
            return
        own = 7.0 if not self.controller_came else self.left_at + 5.0
        if self.ended is not None:
            assert self.now >= own and (self.controller_came or self.ended is Timer.CONTROLLER_ABSENT)
        else:
            assert self.book.deadline()[0] >= own

    @invariant()
    def the_deadline_follows_the_definitions(self) -> None:
        if self.ended is None:
            assert self.book.deadline() == self.expected()
            assert (self.book.state is State.PRESENT) == ("ctl" in self.here)
        else:
            assert self.book.state is State.ENDED and self.book.ended_by is self.ended


TestPresenceModel = PresenceModel.TestCase
TestPresenceModel.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
