"""The liveness book: unit rules, a model-based Hypothesis machine, and the exhaustive explorer."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from states import explore_liveness
from states.explore import explore
from states.liveness import (
    DuplicateWorkerId,
    Event,
    InvalidLiveness,
    LivenessBook,
    State,
    fence_at,
)


def test_registration_starts_the_deadline_and_ready_admits() -> None:
    book = LivenessBook(3.0)
    view = book.register("a", 10.0)
    assert view.state is State.CONNECTED and view.deadline_at == 13.0
    assert not book.admitting("a")
    [t] = book.ready("a", 11.0)
    assert (t.event, t.state) == (Event.READY, State.READY)
    assert book.admitting("a")
    assert book.next_deadline() == 13.0


def test_every_message_moves_the_deadline_and_expiry_loses_the_silent() -> None:
    book = LivenessBook(3.0)
    book.register("a", 0.0)
    book.register("b", 0.0)
    assert book.heard("a", 2.5)
    assert book.expire(2.9) == []
    [lost] = book.expire(3.0)
    assert lost.worker_id == "b" and lost.state is State.LOST
    assert lost.cause == "heartbeat missed (nothing heard for 3.0 s)"
    assert book.state("a") is State.CONNECTED and book.next_deadline() == 5.5


def test_a_worker_that_heartbeats_but_never_says_ready_is_lost_at_its_ready_deadline() -> None:
    book = LivenessBook(3.0, ready_within=5.0)
    book.register("slow", 0.0)
    book.register("prompt", 0.0)
    book.ready("prompt", 0.5)
    for now in (1.0, 2.0, 3.0, 4.0):  # heartbeats keep both alive, but not past the ready deadline
        assert book.heard("slow", now) and book.heard("prompt", now)
    assert book.view("slow").deadline_at == 5.0 and book.next_deadline() == 5.0  # type: ignore[union-attr]
    assert book.expire(4.9) == []
    [lost] = book.expire(5.0)
    assert (lost.worker_id, lost.state) == ("slow", State.LOST)
    assert lost.cause == "protocol error: not ready 5.0 s after registering"
    assert book.state("prompt") is State.READY and book.next_deadline() == 7.0  # ready: only heartbeats count
    with pytest.raises(InvalidLiveness, match="ready_within"):
        LivenessBook(3.0, ready_within=0)


def test_a_draining_worker_that_never_says_goodbye_is_lost_at_its_drain_deadline() -> None:
    book = LivenessBook(3.0)
    for wid in ("stuck", "free"):
        book.register(wid, 0.0)
        book.ready(wid, 0.0)
    book.drain("stuck", 1.0, within=4.0)
    book.drain("free", 1.0)  # no deadline given: heartbeats alone keep it
    assert book.drain("stuck", 2.0, within=100.0) == []  # a second drain changes nothing, its deadline included
    for now in (2.0, 3.0, 4.0):
        assert book.heard("stuck", now) and book.heard("free", now)
    assert book.next_deadline() == 5.0 and book.expire(4.9) == []
    [lost] = book.expire(5.0)
    assert (lost.worker_id, lost.state) == ("stuck", State.LOST)
    # said from the drain on: the time it was given is the drain's deadline and the grace to say goodbye ("0.0 s past
    # its drain deadline" was said of an agent 15 s past its deadline)
    assert lost.cause == "protocol error: still draining 4.0 s after its drain began (it had 4 s to say goodbye)"
    assert book.state("free") is State.DRAINING and book.copy().next_deadline() == 7.0


def test_a_worker_that_never_finishes_a_session_it_was_asked_to_stop_is_lost_at_the_stop_deadline() -> None:
    """Heartbeats alone kept an agent that never stopped its session alive (its slot taken) for as long as it
    stayed connected."""
    book = LivenessBook(3.0)
    for wid in ("mute", "prompt"):
        book.register(wid, 0.0)
        book.ready(wid, 0.0)
    assert book.owe_stop("mute", "s1", 1.0, 5.0)
    assert not book.owe_stop("mute", "s1", 2.0, 100.0)  # asked again: the first deadline stands
    assert book.owe_stop("prompt", "s2", 1.0, 5.0)
    book.stop_answered("prompt", "s2")
    book.stop_answered("prompt", "never-owed")  # a session that ended on its own: nothing to forget
    for now in (2.0, 3.0, 4.0, 5.0):
        assert book.heard("mute", now) and book.heard("prompt", now)
    assert book.next_deadline() == 6.0 and book.expire(5.9) == []
    [lost] = book.expire(6.5)
    assert (lost.worker_id, lost.state) == ("mute", State.LOST)
    assert lost.cause == "protocol error: session s1 not reported finished by its stop deadline"
    assert book.state("prompt") is State.READY and book.copy().next_deadline() == 8.0
    assert not book.owe_stop("mute", "s3", 7.0, 1.0)  # lost: it owes nothing more


def test_a_finish_owed_for_a_drain_the_worker_reported_names_that_deadline_in_the_loss() -> None:
    """A session the worker drains on its own owes its finish too (no stop was sent): the loss says which deadline
    it missed, and the earliest deadline owed for a session stands."""
    book = LivenessBook(3.0)
    book.register("w", 0.0)
    book.ready("w", 0.0)
    assert book.owe_stop("w", "s1", 1.0, 4.0, by="within 4 s of the drain its agent reported")
    assert not book.owe_stop("w", "s1", 2.0, 4.0)  # a stop after the reported drain: the drain's deadline stands
    for now in (2.0, 3.0, 4.0):
        assert book.heard("w", now)
    assert book.next_deadline() == 5.0
    [lost] = book.expire(5.0)
    assert lost.cause == "protocol error: session s1 not reported finished within 4 s of the drain its agent reported"


def test_messages_from_a_dead_id_are_dropped_and_counted() -> None:
    book = LivenessBook(3.0)
    book.register("a", 0.0)
    book.ready("a", 0.0)
    assert book.lose("a", "socket closed", 1.0)[0].cause == "socket closed"
    assert book.lose("a", "again", 1.0) == []  # a second notice of the same loss changes nothing
    assert not book.heard("a", 1.5)
    assert not book.heard("never-registered", 1.5)
    assert book.stale_dropped == 2
    assert book.ready("a", 2.0) == [] and book.state("a") is State.LOST
    assert book.view("a").cause == "socket closed"  # type: ignore[union-attr]


def test_drain_then_leave_and_ids_are_never_reused() -> None:
    book = LivenessBook(3.0)
    book.register("a", 0.0)
    book.ready("a", 0.0)
    assert book.leave("a", 0.5) == []  # only a draining worker may leave
    assert [t.state for t in book.drain("a", 1.0)] == [State.DRAINING]
    assert not book.admitting("a")
    assert [t.state for t in book.leave("a", 2.0)] == [State.LEFT]
    with pytest.raises(DuplicateWorkerId, match="fresh id"):
        book.register("a", 3.0)


def test_terminal_entries_are_bounded() -> None:
    book = LivenessBook(1.0, retain_terminal=2)
    for i in range(5):
        book.register(f"w{i}", 0.0)
        book.lose(f"w{i}", "socket closed", 0.0)
    assert [v.worker_id for v in book.views()] == ["w3", "w4"]
    assert not book.heard("w0", 1.0) and book.stale_dropped == 1


def test_the_agent_fences_before_the_authority_declares_it_lost() -> None:
    book = LivenessBook(4.0)
    book.register("a", 0.0)
    sent = 1.0  # the agent sent a heartbeat at 1.0; the authority got it at 1.2 and acknowledged
    book.heard("a", 1.2)
    fence = fence_at(sent, book.deadline)
    assert fence == 3.0
    assert book.expire(fence) == []  # still live at the moment the agent stops its own sessions
    assert book.expire(5.2)[0].state is State.LOST


@pytest.mark.parametrize("bad", [0, -1.0, True, "3"])
def test_bad_deadline_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(InvalidLiveness, match="deadline"):
        LivenessBook(bad)  # type: ignore[arg-type]


def test_bad_worker_id_is_refused() -> None:
    with pytest.raises(InvalidLiveness, match="worker_id"):
        LivenessBook(1.0).register("", 0.0)


DEADLINE = 2.0
IDS = ["a", "b", "c", "d"]
SESSIONS = ["s1", "s2"]


class LivenessModel(RuleBasedStateMachine):
    """The book against a plain model: {id: [state, last_heard, cause]} and a stale counter."""

    def __init__(self) -> None:
        super().__init__()
        self.book = LivenessBook(DEADLINE)
        self.model: dict[str, list] = {}
        self.stale = 0
        self.now = 0.0

    def _live(self, wid: str) -> bool:
        return wid in self.model and self.model[wid][0] not in ("lost", "left")

    @precondition(lambda self: len(self.model) < len(IDS))
    @rule()
    def register(self) -> None:
        wid = IDS[len(self.model)]
        self.book.register(wid, self.now)
        self.model[wid] = ["connected", self.now, None, {}]

    @rule(wid=st.sampled_from(IDS + ["ghost"]))
    def heard(self, wid: str) -> None:
        accepted = self.book.heard(wid, self.now)
        assert accepted == self._live(wid)
        if accepted:
            self.model[wid][1] = self.now
        else:
            self.stale += 1

    @rule(wid=st.sampled_from(IDS))
    def ready(self, wid: str) -> None:
        moved = self.book.ready(wid, self.now)
        expected = wid in self.model and self.model[wid][0] == "connected"
        assert bool(moved) == expected
        if expected:
            self.model[wid][0] = "ready"

    @rule(wid=st.sampled_from(IDS))
    def drain(self, wid: str) -> None:
        moved = self.book.drain(wid, self.now)
        expected = wid in self.model and self.model[wid][0] in ("connected", "ready")
        assert bool(moved) == expected
        if expected:
            self.model[wid][0] = "draining"

    @rule(wid=st.sampled_from(IDS))
    def leave(self, wid: str) -> None:
        moved = self.book.leave(wid, self.now)
        expected = wid in self.model and self.model[wid][0] == "draining"
        assert bool(moved) == expected
        if expected:
            self.model[wid][0] = "left"

    @rule(wid=st.sampled_from(IDS), cause=st.sampled_from(["socket closed", "node removed"]))
    def lose(self, wid: str, cause: str) -> None:
        moved = self.book.lose(wid, cause, self.now)
        assert bool(moved) == self._live(wid)
        if moved:
            self.model[wid][0] = "lost"
            self.model[wid][2] = cause

    @rule(wid=st.sampled_from(IDS + ["ghost"]), session=st.sampled_from(SESSIONS), within=st.sampled_from([1.0, 2.5]))
    def owe_stop(self, wid: str, session: str, within: float) -> None:
        owed = self.book.owe_stop(wid, session, self.now, within)
        expected = self._live(wid) and session not in self.model[wid][3]
        assert owed == expected
        if expected:
            self.model[wid][3][session] = self.now + within

    @rule(wid=st.sampled_from(IDS + ["ghost"]), session=st.sampled_from(SESSIONS))
    def stop_answered(self, wid: str, session: str) -> None:
        self.book.stop_answered(wid, session)
        if wid in self.model:
            self.model[wid][3].pop(session, None)

    def _due(self, wid: str) -> float:
        return min([self.model[wid][1] + DEADLINE, *self.model[wid][3].values()])

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 1.9, 2.0, 3.5]))
    def tick(self, dt: float) -> None:
        self.now += dt
        lost = {t.worker_id for t in self.book.expire(self.now)}
        overdue = {w for w in self.model if self._live(w) and self.now >= self._due(w)}
        assert lost == overdue
        for w in overdue:
            heartbeat = self.now >= self.model[w][1] + DEADLINE
            self.model[w][0] = "lost"
            self.model[w][2] = "heartbeat" if heartbeat else "protocol error: session"

    @invariant()
    def agrees(self) -> None:
        assert self.book.stale_dropped == self.stale
        for wid, (state, last_heard, cause, _) in self.model.items():
            view = self.book.view(wid)
            assert view is not None and view.state.value == state
            if state == "lost":
                assert view.cause is not None and view.cause.startswith(cause)
            if self._live(wid):
                assert view.last_heard == last_heard and view.deadline_at == self._due(wid)
        live = [self._due(w) for w in self.model if self._live(w)]
        assert self.book.next_deadline() == (min(live) if live else None)


TestLivenessModel = LivenessModel.TestCase
TestLivenessModel.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("config", explore_liveness.configurations(small=True), ids=lambda c: c.name)
def test_small_exploration_finds_no_violation(config) -> None:
    report = explore(config)
    assert report.states > 20 and report.violations == ()
