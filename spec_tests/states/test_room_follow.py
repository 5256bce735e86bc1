"""The room-follow book: who keeps the count of a session's room, whether a look's result or a stop counts, and
whether a token's check lists the room."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from states import IllegalTransition, explore_room_follow, room_follow
from states.explore import explore
from states.room_follow import RUNTIME_KEEPS, STARTS, TRANSITIONS, Event, RoomFollowBook, State


def test_a_watched_room_is_followed_for_the_sessions_whole_life_and_cleared_at_its_stop():
    book = RoomFollowBook(Event.WATCH)
    book.start("s")
    book.hand_over("s")  # the runners leave a watched room's count to the runtime: nothing changes
    assert book.state("s") is State.WATCHED and book.followed() == {"s"}
    assert not book.looks_into("s") and not book.take_look("s")  # nothing is looked into where rooms are watched
    assert not book.check("s")  # nor listed for a token's check: the record follows each join as it happens
    assert book.stop("s") is True and book.followed() == frozenset() and book.state("s") is None
    assert book.stop("s") is False  # idempotent: the second stop clears nothing


def test_a_looked_into_room_takes_looks_until_its_worker_takes_over():
    book = RoomFollowBook(Event.LOOK_INTO)
    book.start("a")
    book.start("b")
    assert book.looked_into() == ["a", "b"] and book.take_look("a") and book.check("a")
    book.hand_over("a")
    assert book.state("a") is State.HANDED_OVER and book.looked_into() == ["b"] and book.followed() == {"b"}
    assert not book.take_look("a")  # a look under way at the hand-over is dropped
    assert book.check("a")  # a token's check still lists the room: the worker's word comes a moment after a join
    assert book.state("a") is State.HANDED_OVER and not book.looks_into("a")  # ... and its answer is not the count's
    assert book.stop("a") is False  # the count was the worker's: the runtime does not clear it
    assert book.stop("b") is True and book.machines == {}


def test_a_look_whose_session_ended_meanwhile_is_dropped_and_a_late_hand_over_changes_nothing():
    book = RoomFollowBook(Event.LOOK_INTO)
    book.start("s")
    assert book.looks_into("s")
    assert book.stop("s") is True
    assert not book.take_look("s") and not book.check("s")
    book.hand_over("s")  # a runner's word after the end
    assert book.state("s") is None and book.followed() == frozenset()


def test_where_no_room_is_seen_the_worker_keeps_the_count_from_the_start():
    book = RoomFollowBook(Event.LEAVE_TO_WORKER)
    book.start("s")
    assert book.state("s") is State.LEFT_TO_WORKER and book.followed() == frozenset() and not book.looks_into("s")
    book.hand_over("s")
    assert book.state("s") is State.LEFT_TO_WORKER and not book.check("s")  # nothing lists the room
    assert book.stop("s") is False


def test_a_session_starts_once_and_with_a_start_event_only():
    book = RoomFollowBook(Event.LOOK_INTO)
    book.start("s")
    with pytest.raises(IllegalTransition):
        book.start("s")
    assert book.state("s") is State.LOOKED_INTO
    with pytest.raises(ValueError, match="start_with"):
        RoomFollowBook(Event.HAND_OVER)


def test_the_table_takes_looks_only_while_looked_into_and_stops_from_every_live_state():
    assert STARTS == {Event.WATCH, Event.LOOK_INTO, Event.LEAVE_TO_WORKER}
    assert {source for (source, event) in TRANSITIONS if event is Event.LOOKED} == {State.LOOKED_INTO}
    assert {source for (source, event) in TRANSITIONS if event is Event.CHECK} == {State.LOOKED_INTO, State.HANDED_OVER}
    assert {source for (source, event) in TRANSITIONS if event is Event.STOP} == set(State) - {State.ENDED}
    assert RUNTIME_KEEPS == {State.WATCHED, State.LOOKED_INTO}


# -- exhaustive exploration and a model test -------------------------------------------------------


def test_the_explorer_finds_no_violation():
    reports = [explore(config) for config in explore_room_follow.configurations(small=True)]
    assert all(report.violations == () and report.states > 10 for report in reports), [r.line() for r in reports]
    assert max(report.states for report in reports) > 100


def test_the_explorer_catches_a_look_taken_after_the_hand_over(monkeypatch):
    monkeypatch.setitem(TRANSITIONS, (State.HANDED_OVER, Event.LOOKED), State.HANDED_OVER)
    reports = [explore(config) for config in explore_room_follow.configurations(small=True)]
    assert any(report.violations for report in reports), [r.line() for r in reports]


def test_the_explorer_catches_a_handed_over_room_not_listed_for_a_tokens_check(monkeypatch):
    monkeypatch.delitem(TRANSITIONS, (State.HANDED_OVER, Event.CHECK))
    reports = [explore(config) for config in explore_room_follow.configurations(small=True)]
    assert any(report.violations for report in reports), [r.line() for r in reports]


def test_the_explorer_catches_a_stop_that_clears_the_workers_count(monkeypatch):
    monkeypatch.setattr(room_follow, "RUNTIME_KEEPS", frozenset({State.WATCHED, State.LOOKED_INTO, State.HANDED_OVER}))
    reports = [explore(config) for config in explore_room_follow.configurations(small=True)]
    assert any(report.violations for report in reports), [r.line() for r in reports]


class FollowModel(RuleBasedStateMachine):
    """The book on LiveKit's start against plain sets: started, handed over, stopped, and looks under way."""

    def __init__(self) -> None:
        super().__init__()
        self.book = RoomFollowBook(Event.LOOK_INTO)
        self.started: list[int] = []
        self.handed: set[int] = set()
        self.stopped: set[int] = set()
        self.looks: list[int] = []  # the sessions of the looks under way

    def looked(self, session: int) -> bool:
        return session in self.started and session not in self.handed and session not in self.stopped

    @rule()
    def a_session_starts(self) -> None:
        self.book.start(len(self.started))
        self.started.append(len(self.started))

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def a_look_begins(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(self.started))
        assert self.book.looks_into(session) is self.looked(session)
        if self.looked(session):
            self.looks.append(session)

    @precondition(lambda self: self.looks)
    @rule(data=st.data())
    def a_look_arrives(self, data: st.DataObject) -> None:
        session = self.looks.pop(data.draw(st.integers(0, len(self.looks) - 1)))
        assert self.book.take_look(session) is self.looked(session)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def a_token_is_asked_for(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(self.started))
        assert self.book.check(session) is (session not in self.stopped)  # handed over or not

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def the_worker_hands_over(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(self.started))
        self.book.hand_over(session)
        if session not in self.stopped:
            self.handed.add(session)

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def the_session_stops(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(self.started))
        assert self.book.stop(session) is self.looked(session)
        self.stopped.add(session)

    @invariant()
    def the_book_follows_the_definitions(self) -> None:
        assert self.book.looked_into() == [s for s in self.started if self.looked(s)]
        assert self.book.followed() == {s for s in self.started if self.looked(s)}
        assert set(self.book.machines) == set(self.started) - self.stopped


TestFollowModel = FollowModel.TestCase
TestFollowModel.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
