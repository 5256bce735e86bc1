"""The execution-lease book: unit rules, a model-based Hypothesis test, exploration."""

from __future__ import annotations

import copy
import math

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from states import explore_lease
from states.explore import explore
from states.lease import State
from states.lease_book import (
    ChunkInProgress,
    DuplicateLeaseSession,
    LeaseBook,
    LeaseError,
    LeaseSnapshot,
    LeaseTransition,
    NoChunkInProgress,
    NotClosing,
    NotHolder,
    SessionClosing,
    UnknownLeaseSession,
)

T = 10.0  # idle timeout used by the unit tests

W, Q, A, P, C = State.WAITING, State.QUEUED, State.ACTIVE, State.PARKED, State.CLOSING


def tr(session_id: str, state: State) -> LeaseTransition:
    return LeaseTransition(session_id, state)


def book_with(*session_ids: str, now: float = 0.0, rotate: bool = False) -> LeaseBook:
    book = LeaseBook(T, rotate=rotate)
    for session_id in session_ids:
        book.register(session_id, now)
    return book


def states(book: LeaseBook) -> dict[str, State]:
    return {snap.session_id: snap.state for snap in book.snapshot()}


# ------------------------------------------------------------ construction


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, True, "10"])
def test_idle_timeout_must_be_positive(bad: object) -> None:
    with pytest.raises(ValueError):
        LeaseBook(bad)  # type: ignore[arg-type]


def test_register_waits_and_rejects_duplicates() -> None:
    book = LeaseBook(T)
    assert book.register("a", 0.0) == [tr("a", W)]
    assert book.state("a") is W
    assert book.holder() is None
    assert book.queue_position("a") is None
    with pytest.raises(DuplicateLeaseSession) as info:
        book.register("a", 1.0)
    assert info.value.session_id == "a"
    assert isinstance(info.value, LeaseError) and isinstance(info.value, ValueError)
    assert book.last_activity_at("a") == 0.0


def test_transitions_are_frozen_values() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        tr("a", A).state = W  # type: ignore[misc]


# ---------------------------------------------------------------- queueing


def test_first_activity_queues_and_is_granted_at_once() -> None:
    book = book_with("a")
    assert book.record_activity("a", 1.0) == [tr("a", Q), tr("a", A)]
    assert book.holder() == "a"
    assert book.last_activity_at("a") == 1.0


def test_waiters_queue_fifo_with_current_positions() -> None:
    book = book_with("a", "b", "c", "d")
    book.record_activity("a", 0.0)
    assert book.record_activity("c", 0.0) == [tr("c", Q)]
    assert book.record_activity("b", 0.0) == [tr("b", Q)]
    assert book.queued() == ("c", "b")
    assert (book.queue_position("c"), book.queue_position("b")) == (1, 2)
    assert book.queue_position("a") is None and book.queue_position("d") is None
    book.close("a")
    assert book.holder() == "c"
    assert book.queue_position("b") == 1


def test_activity_while_queued_or_active_only_refreshes() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    assert book.record_activity("a", 3.0) == []
    assert book.record_activity("b", 4.0) == []
    assert states(book) == {"a": A, "b": Q}
    assert book.last_activity_at("a") == 3.0 and book.last_activity_at("b") == 4.0
    assert book.queue_position("b") == 1


def test_activity_of_a_closing_session_is_ignored() -> None:
    book = book_with("a")
    book.close("a")
    assert book.record_activity("a", 5.0) == []
    assert book.state("a") is C and book.last_activity_at("a") == 0.0


# ------------------------------------------------------------------ chunks


def test_begin_chunk_only_for_the_idle_holder() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    with pytest.raises(NotHolder):
        book.begin_chunk("b")
    assert book.begin_chunk("a") == []
    assert book.is_busy("a")
    with pytest.raises(ChunkInProgress):
        book.begin_chunk("a")


def test_finish_chunk_requires_a_running_chunk() -> None:
    book = book_with("a")
    book.record_activity("a", 0.0)
    with pytest.raises(NoChunkInProgress):
        book.finish_chunk("a", 1.0)
    with pytest.raises(NoChunkInProgress):
        book.abort_chunk("a")


def test_fresh_holder_keeps_the_lease_at_a_chunk_boundary() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    book.begin_chunk("a")
    assert book.finish_chunk("a", T - 0.5) == []
    assert book.holder() == "a" and not book.is_busy("a")


def test_idle_holder_hands_off_at_the_chunk_boundary_only() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.record_activity("b", 1.0)  # a is mid-chunk: nothing moves
    now = 3 * T
    assert book.tick(now) == []
    assert book.record_activity("b", now) == []
    assert book.holder() == "a" and book.is_busy("a")
    assert book.finish_chunk("a", now) == [tr("a", P), tr("b", A)]
    assert states(book) == {"a": P, "b": A}
    assert not book.is_busy("a")


def test_idle_holder_is_parked_only_when_someone_waits() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    assert book.finish_chunk("a", 5 * T) == []
    assert book.tick(6 * T) == []
    assert book.holder() == "a"
    # the first waiter's own activity parks the idle holder and takes the lease
    assert book.record_activity("b", 7 * T) == [tr("b", Q), tr("a", P), tr("b", A)]


def test_tick_hands_off_from_an_idle_holder_that_has_run() -> None:
    book = book_with("a", "b", "c")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.finish_chunk("a", 1.0)
    book.record_activity("b", 2.0)
    book.record_activity("c", 2.0)
    assert book.tick(T - 0.1) == []  # a is not idle-expired yet
    assert book.tick(T) == [tr("a", P), tr("b", A)]
    assert book.queue_position("c") == 1


def test_waiter_is_guaranteed_one_chunk_after_its_wait() -> None:
    book = book_with("a", "b", "c")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.finish_chunk("a", 0.0)
    book.record_activity("b", 0.0)  # queues while a holds the lease: protected
    assert book.tick(T) == [tr("a", P), tr("b", A)]
    book.record_activity("c", 5 * T)
    # b's own activity is long stale, but it has not run since its grant
    assert book.tick(6 * T) == []
    assert book.record_activity("c", 6 * T) == []
    assert book.holder() == "b"
    book.begin_chunk("b")
    assert book.finish_chunk("b", 6 * T) == [tr("b", P), tr("c", A)]


def test_unprotected_grant_can_be_parked_before_running() -> None:
    # b queued while nobody held the lease, so it was granted at once, unprotected
    book = book_with("a", "b")
    assert book.record_activity("b", 0.0) == [tr("b", Q), tr("b", A)]
    assert book.record_activity("a", T) == [tr("a", Q), tr("b", P), tr("a", A)]
    # whereas a waiter granted after queueing behind b is protected
    assert book.record_activity("b", 2 * T) == [tr("b", Q)]
    assert book.tick(5 * T) == []


def test_abort_chunk_clears_busy_and_the_holder_keeps_the_lease() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.record_activity("b", 0.0)
    assert book.abort_chunk("a") == []
    assert book.holder() == "a" and not book.is_busy("a")
    assert book.tick(T) == [tr("a", P), tr("b", A)]


# ----------------------------------------------------------------- parking


def test_parked_session_requeues_at_the_tail_and_needs_activity() -> None:
    book = book_with("a", "b", "c")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.finish_chunk("a", 0.0)
    book.record_activity("b", 0.0)
    book.tick(T)  # a parked, b granted
    book.record_activity("c", T)
    assert book.record_activity("a", T) == [tr("a", Q)]
    assert book.queued() == ("c", "a")

    book2 = book_with("a", "b")
    book2.record_activity("a", 0.0)
    book2.begin_chunk("a")
    book2.finish_chunk("a", 0.0)
    book2.record_activity("b", 0.0)
    book2.tick(T)
    for step in range(2, 8):  # b idles, nobody waits: a stays parked
        now = step * T
        if book2.holder() == "b":
            book2.begin_chunk("b")
            book2.finish_chunk("b", now)
        assert book2.tick(now) == []
        assert book2.state("a") is P
    book2.close("b")
    assert book2.state("a") is P and book2.holder() is None


# ----------------------------------------------------------- close/release


def test_closing_the_holder_grants_the_next_waiter() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    assert book.close("a") == [tr("a", C), tr("b", A)]
    assert book.holder() == "b"
    assert book.release("a") == []
    assert "a" not in book
    with pytest.raises(UnknownLeaseSession):
        book.state("a")


def test_closing_a_busy_holder_hands_off_when_its_chunk_ends() -> None:
    book = book_with("a", "b", "c")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.record_activity("b", 0.0)
    assert book.close("a") == [tr("a", C)]
    assert book.holder() is None and book.draining() == "a" and not book.lease_free()
    assert book.record_activity("c", 0.0) == [tr("c", Q)]  # nothing granted mid-chunk
    with pytest.raises(ChunkInProgress):
        book.release("a")
    with pytest.raises(NotHolder):
        book.begin_chunk("a")
    assert book.finish_chunk("a", T) == [tr("b", A)]
    assert book.draining() is None
    assert book.release("a") == []
    # c queued behind the draining chunk: it is owed a chunk too
    book.close("b")
    assert book.holder() == "c"
    assert book.tick(10 * T) == []


def test_aborting_a_closed_holders_chunk_frees_the_lease() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.record_activity("b", 0.0)
    book.close("a")
    assert book.abort_chunk("a") == [tr("b", A)]


def test_closing_a_queued_session_leaves_the_fifo() -> None:
    book = book_with("a", "b", "c")
    for sid in ("a", "b", "c"):
        book.record_activity(sid, 0.0)
    assert book.close("b") == [tr("b", C)]
    assert book.queued() == ("c",) and book.queue_position("c") == 1
    assert book.queue_position("b") is None


def test_close_and_release_misuse() -> None:
    book = book_with("a")
    with pytest.raises(NotClosing):
        book.release("a")
    book.close("a")
    with pytest.raises(SessionClosing):
        book.close("a")


# ---------------------------------------------------------------- rotation


def _run_chunk(book: LeaseBook, now: float) -> tuple[str, list[LeaseTransition]]:
    holder = book.holder()
    assert holder is not None
    book.begin_chunk(holder)
    return holder, book.finish_chunk(holder, now)


def test_rotation_is_opt_in() -> None:
    assert LeaseBook(T).rotate is False
    assert LeaseBook(T, rotate=True).rotate is True
    with pytest.raises(TypeError):
        LeaseBook(T, True)  # type: ignore[misc]  # keyword-only
    with pytest.raises(TypeError):
        LeaseBook(T, rotate=1)  # type: ignore[arg-type]


def test_without_rotation_a_busy_holder_keeps_the_lease() -> None:
    # the reference behaviour: a holder that keeps sending controls starves the rest
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    for step in range(10):
        now = step * 1.0
        book.record_activity("a", now)
        book.record_activity("b", now)
        assert _run_chunk(book, now) == ("a", [])
    assert book.queued() == ("b",)


def test_two_active_sessions_alternate_chunk_by_chunk() -> None:
    book = book_with("a", "b", rotate=True)
    assert book.record_activity("a", 0.0) == [tr("a", Q), tr("a", A)]
    assert book.record_activity("b", 0.0) == [tr("b", Q)]
    ran = []
    for step in range(8):
        now = step * 1.0  # both keep sending controls: neither is ever idle
        assert book.record_activity("a", now) == []
        assert book.record_activity("b", now) == []
        holder, got = _run_chunk(book, now)
        other = "b" if holder == "a" else "a"
        assert got == [tr(holder, Q), tr(other, A)]
        assert book.queued() == (holder,) and book.queue_position(holder) == 1
        ran.append(holder)
    assert ran == ["a", "b"] * 4


def test_three_active_sessions_take_turns_in_fifo_order() -> None:
    book = book_with("a", "b", "c", rotate=True)
    for sid in ("a", "c", "b"):
        book.record_activity(sid, 0.0)
    ran = []
    for step in range(9):
        now = step * 1.0
        for sid in ("a", "b", "c"):
            book.record_activity(sid, now)
        holder, got = _run_chunk(book, now)
        assert got[0] == tr(holder, Q) and book.queued()[-1] == holder
        ran.append(holder)
    assert ran == ["a", "c", "b"] * 3


def test_idle_holder_with_waiters_is_parked_not_yielded() -> None:
    book = book_with("a", "b", rotate=True)
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.record_activity("b", T)
    assert book.finish_chunk("a", T) == [tr("a", P), tr("b", A)]
    assert book.state("a") is P and book.queued() == ()
    # parked, not re-queued: it is granted again only after new activity
    book.begin_chunk("b")
    assert book.finish_chunk("b", T) == []  # nobody waits
    assert book.record_activity("a", T) == [tr("a", Q)]
    book.begin_chunk("b")
    assert book.finish_chunk("b", T) == [tr("b", Q), tr("a", A)]


def test_no_yield_when_nobody_waits() -> None:
    book = book_with("a", "b", rotate=True)
    book.record_activity("a", 0.0)
    for step in range(5):
        now = step * 1.0
        book.record_activity("a", now)
        assert _run_chunk(book, now) == ("a", [])
    assert book.holder() == "a" and book.state("b") is W


def test_no_yield_mid_chunk_or_between_chunks() -> None:
    book = book_with("a", "b", rotate=True)
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    assert book.record_activity("b", 0.0) == [tr("b", Q)]
    # mid-chunk: neither activity nor the timer moves the lease
    assert book.record_activity("a", 0.5) == []
    assert book.record_activity("b", 0.5) == []
    assert book.tick(0.5) == []
    assert book.holder() == "a" and book.is_busy("a")
    # an aborted chunk is not a rotation boundary either
    assert book.abort_chunk("a") == []
    assert book.holder() == "a"
    # between chunks a non-idle holder is never touched by the timer or activity
    assert book.tick(1.0) == []
    assert book.record_activity("b", 1.0) == []
    assert book.holder() == "a"
    # only the holder's own chunk boundary rotates
    book.begin_chunk("a")
    assert book.finish_chunk("a", 1.0) == [tr("a", Q), tr("b", A)]


def test_granted_after_wait_still_gets_its_guaranteed_chunk() -> None:
    book = book_with("a", "b", "c", rotate=True)
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)  # queues behind a: owed one chunk once granted
    book.begin_chunk("a")
    assert book.finish_chunk("a", 1.0) == [tr("a", Q), tr("b", A)]
    # b's own activity is long stale, a and c keep sending controls
    now = 5 * T
    book.record_activity("a", now)
    assert book.record_activity("c", now) == [tr("c", Q)]
    assert book.tick(now) == []
    assert book.holder() == "b"
    book.begin_chunk("b")
    # after its chunk, idle b is parked (not re-queued) and the head runs
    assert book.finish_chunk("b", now) == [tr("b", P), tr("a", A)]
    assert book.queued() == ("c",)


def test_a_yielded_session_is_not_owed_a_chunk() -> None:
    book = book_with("a", "b", rotate=True)
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    book.begin_chunk("a")
    assert book.finish_chunk("a", 0.0) == [tr("a", Q), tr("b", A)]
    # a goes idle while it waits; b keeps going: a just ran, so when it is
    # granted again it is unprotected and an idle tick can park it unrun
    book.record_activity("b", T)
    assert _run_chunk(book, T) == ("b", [tr("b", Q), tr("a", A)])
    assert book.tick(T) == [tr("a", P), tr("b", A)]


def test_closing_while_queued_after_a_yield_leaves_the_fifo() -> None:
    book = book_with("a", "b", rotate=True)
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    _run_chunk(book, 0.0)
    assert book.queued() == ("a",)
    assert book.close("a") == [tr("a", C)]
    assert book.queued() == () and book.holder() == "b"


def test_rotation_flag_is_in_the_key_and_the_clone() -> None:
    plain, rotating = book_with("a", "b"), book_with("a", "b", rotate=True)
    assert plain.canonical_key(0.0) != rotating.canonical_key(0.0)
    twin = copy.deepcopy(rotating)
    assert twin.rotate is True and twin.canonical_key(0.0) == rotating.canonical_key(0.0)
    assert copy.copy(plain).rotate is False


# -------------------------------------------------------------- relinquish


def test_relinquish_parks_the_holder_and_grants_the_next() -> None:
    book = book_with("a", "b", "c")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    book.record_activity("c", 0.0)
    _run_chunk(book, 0.0)
    # a's activity is fresh: without relinquish it would keep the lease until idle
    assert book.relinquish("a", 0.0) == [tr("a", P), tr("b", A)]
    assert states(book) == {"a": P, "b": A, "c": Q}
    assert book.queued() == ("c",) and book.queue_position("a") is None
    assert book.last_activity_at("a") == 0.0  # the stamp is untouched


def test_relinquish_needs_neither_idleness_nor_a_chunk_run() -> None:
    # a holder granted after a wait (owed one chunk) may give the lease up unrun
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)  # protected
    book.close("a")
    assert book.holder() == "b" and not book.is_idle_expired("b", 0.0)
    assert book.relinquish("b", 0.0) == [tr("b", P)]
    assert book.lease_free()


def test_relinquish_refuses_anyone_but_the_holder_between_chunks() -> None:
    book = book_with("a", "b", "w")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    book.begin_chunk("a")
    for sid, error in [("a", ChunkInProgress), ("b", NotHolder), ("w", NotHolder), ("zz", UnknownLeaseSession)]:
        before = (book.snapshot(), book.queued(), book.canonical_key(50.0))
        with pytest.raises(error) as info:
            book.relinquish(sid, 0.0)
        assert isinstance(info.value, LeaseError) and info.value.session_id == sid
        assert (book.snapshot(), book.queued(), book.canonical_key(50.0)) == before
    book.finish_chunk("a", 0.0)
    book.relinquish("a", 0.0)
    with pytest.raises(NotHolder):  # parked now
        book.relinquish("a", 0.0)
    book.close("b")
    with pytest.raises(NotHolder):  # closing
        book.relinquish("b", 0.0)


def test_a_relinquished_session_requeues_at_the_tail_on_activity() -> None:
    book = book_with("a", "b", "c")
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    book.relinquish("a", 0.0)
    assert book.holder() == "b"
    assert book.record_activity("c", 1.0) == [tr("c", Q)]
    for step in range(2, 6):  # b (owed its chunk) holds; a stays parked, c waits
        assert book.tick(step * T) == []
        assert book.state("a") is P
    # only new activity brings it back, at the tail, behind c
    assert book.record_activity("a", 6 * T) == [tr("a", Q)]
    assert book.queued() == ("c", "a")
    book.begin_chunk("b")
    assert book.finish_chunk("b", 6 * T) == [tr("b", P), tr("c", A)]


def test_after_relinquish_with_nobody_waiting_the_next_activity_takes_the_free_lease() -> None:
    book = book_with("a", "b")
    book.record_activity("a", 0.0)
    _run_chunk(book, 0.0)
    assert book.relinquish("a", 0.0) == [tr("a", P)]
    assert book.holder() is None and book.lease_free()
    assert book.tick(T) == []  # nothing to grant
    assert book.record_activity("b", T + 1) == [tr("b", Q), tr("b", A)]
    assert book.relinquish("b", T + 1) == [tr("b", P)]
    assert book.record_activity("a", T + 2) == [tr("a", Q), tr("a", A)]  # the relinquisher itself


def test_relinquish_with_rotation_hands_over_a_yield_requeued_holder() -> None:
    # the starvation scenario: b only wanted one chunk; rotation re-queued it
    # behind a, and it is granted again while it has nothing to run
    book = book_with("a", "b", rotate=True)
    book.record_activity("a", 0.0)
    book.record_activity("b", 0.0)
    assert _run_chunk(book, 0.0) == ("a", [tr("a", Q), tr("b", A)])
    assert _run_chunk(book, 0.0) == ("b", [tr("b", Q), tr("a", A)])  # b's one chunk
    book.record_activity("a", 1.0)
    assert _run_chunk(book, 1.0) == ("a", [tr("a", Q), tr("b", A)])
    assert book.relinquish("b", 1.0) == [tr("b", P), tr("a", A)]
    for step in range(2, 6):  # a runs on alone: nobody waits, no yield
        book.record_activity("a", float(step))
        assert _run_chunk(book, float(step)) == ("a", [])
    assert book.state("b") is P


# ------------------------------------------------------------------ errors


def _busy_two() -> LeaseBook:
    book = book_with("a", "b", "w")
    book.record_activity("a", 0.0)
    book.begin_chunk("a")
    book.record_activity("b", 0.0)
    return book


ERROR_CASES = [
    (lambda b: b.register("a", 1.0), DuplicateLeaseSession),
    (lambda b: b.begin_chunk("b"), NotHolder),
    (lambda b: b.begin_chunk("w"), NotHolder),
    (lambda b: b.begin_chunk("a"), ChunkInProgress),
    (lambda b: b.finish_chunk("b", 99.0), NoChunkInProgress),
    (lambda b: b.abort_chunk("w"), NoChunkInProgress),
    (lambda b: b.release("b"), NotClosing),
    (lambda b: b.record_activity("zz", 5.0), UnknownLeaseSession),
    (lambda b: b.begin_chunk("zz"), UnknownLeaseSession),
    (lambda b: b.finish_chunk("zz", 5.0), UnknownLeaseSession),
    (lambda b: b.abort_chunk("zz"), UnknownLeaseSession),
    (lambda b: b.close("zz"), UnknownLeaseSession),
    (lambda b: b.release("zz"), UnknownLeaseSession),
    (lambda b: b.relinquish("a", 1.0), ChunkInProgress),
    (lambda b: b.relinquish("b", 1.0), NotHolder),
    (lambda b: b.relinquish("w", 1.0), NotHolder),
    (lambda b: b.relinquish("zz", 1.0), UnknownLeaseSession),
    (lambda b: b.queue_position("zz"), UnknownLeaseSession),
    (lambda b: b.is_busy("zz"), UnknownLeaseSession),
]


@pytest.mark.parametrize(("call", "error"), ERROR_CASES)
def test_errors_change_nothing(call, error) -> None:
    book = _busy_two()
    before = (book.snapshot(), book.queued(), book.canonical_key(50.0))
    with pytest.raises(error) as info:
        call(book)
    assert isinstance(info.value, LeaseError)
    assert (book.snapshot(), book.queued(), book.canonical_key(50.0)) == before


def test_errors_after_close_change_nothing() -> None:
    book = _busy_two()
    book.close("a")
    before = book.snapshot()
    for call, error in [
        (lambda: book.close("a"), SessionClosing),
        (lambda: book.release("a"), ChunkInProgress),
        (lambda: book.begin_chunk("a"), NotHolder),
        (lambda: book.relinquish("a", 1.0), NotHolder),
    ]:
        with pytest.raises(error):
            call()
        assert book.snapshot() == before


# --------------------------------------------------------- copies and keys


def test_snapshot_reports_every_session() -> None:
    book = _busy_two()
    assert book.snapshot() == (
        LeaseSnapshot("a", A, 0.0, True, None),
        LeaseSnapshot("b", Q, 0.0, False, 1),
        LeaseSnapshot("w", W, 0.0, False, None),
    )


def test_deepcopy_is_independent_and_keys_reduce_time() -> None:
    book = _busy_two()
    twin = copy.deepcopy(book)
    assert twin.canonical_key(1.0) == book.canonical_key(1.0)
    twin.finish_chunk("a", 3 * T)
    assert book.is_busy("a") and book.holder() == "a"
    assert twin.holder() == "b"
    # only "idle-expired or not" matters in the key
    assert book.canonical_key(T) == book.canonical_key(7 * T)
    assert book.canonical_key(0.0) == book.canonical_key(T - 1)
    assert book.canonical_key(0.0) != book.canonical_key(T)
    hash(book.canonical_key(0.0))


# ------------------------------------------------- model-based (Hypothesis)


class ReferenceLease:
    """A plain re-statement of the lease rules, written independently of the book."""

    def __init__(self, idle_timeout: float, rotate: bool = False) -> None:
        self.timeout = idle_timeout
        self.rotate = rotate
        self.sessions: dict[str, dict] = {}
        self.fifo: list[str] = []

    def _stale(self, sid: str, now: float) -> bool:
        return now - self.sessions[sid]["last"] >= self.timeout

    def occupant(self) -> str | None:
        for sid, s in self.sessions.items():
            if s["state"] == "active" or (s["state"] == "closing" and s["busy"]):
                return sid
        return None

    def active(self) -> str | None:
        return next((sid for sid, s in self.sessions.items() if s["state"] == "active"), None)

    def _grant(self, out: list) -> None:
        if self.fifo and self.occupant() is None:
            sid = self.fifo.pop(0)
            s = self.sessions[sid]
            s["state"] = "active"
            s["may_park"] = not s["owed"]
            s["owed"] = False
            out.append((sid, "active"))

    def _park(self, sid: str, out: list) -> None:
        self.sessions[sid]["state"] = "parked"
        self.sessions[sid]["may_park"] = False
        out.append((sid, "parked"))

    def _need(self, sid: str) -> dict:
        if sid not in self.sessions:
            raise UnknownLeaseSession(sid, "model")
        return self.sessions[sid]

    def register(self, sid: str, now: float) -> list:
        if sid in self.sessions:
            raise DuplicateLeaseSession(sid, "model")
        self.sessions[sid] = dict(state="waiting", last=now, busy=False, may_park=False, owed=False)
        return [(sid, "waiting")]

    def activity(self, sid: str, now: float) -> list:
        s = self._need(sid)
        out: list = []
        if s["state"] == "closing":
            return out
        holder_before = self.occupant()
        s["last"] = now
        if s["state"] in ("waiting", "parked"):
            s["state"] = "queued"
            s["owed"] = holder_before is not None
            self.fifo.append(sid)
            out.append((sid, "queued"))
        h = self.active()
        if h is not None and h != sid:
            hs = self.sessions[h]
            if hs["may_park"] and not hs["busy"] and self._stale(h, now):
                self._park(h, out)
        self._grant(out)
        return out

    def begin(self, sid: str) -> list:
        s = self._need(sid)
        if s["state"] != "active":
            raise NotHolder(sid, "model")
        if s["busy"]:
            raise ChunkInProgress(sid, "model")
        s["busy"] = True
        s["may_park"] = True
        return []

    def finish(self, sid: str, now: float) -> list:
        s = self._need(sid)
        if not s["busy"]:
            raise NoChunkInProgress(sid, "model")
        s["busy"] = False
        out: list = []
        if s["state"] == "active" and self.fifo:
            if self._stale(sid, now):
                self._park(sid, out)
            elif self.rotate:  # round robin: back to the tail, it has just run
                s["state"] = "queued"
                s["may_park"] = False
                s["owed"] = False
                self.fifo.append(sid)
                out.append((sid, "queued"))
        self._grant(out)
        return out

    def relinquish(self, sid: str, now: float) -> list:
        s = self._need(sid)
        if s["state"] != "active":
            raise NotHolder(sid, "model")
        if s["busy"]:
            raise ChunkInProgress(sid, "model")
        s["state"] = "parked"  # whatever its stamp, whoever waits
        s["may_park"] = False
        s["owed"] = False
        out: list = [(sid, "parked")]
        self._grant(out)
        return out

    def abort(self, sid: str) -> list:
        s = self._need(sid)
        if not s["busy"]:
            raise NoChunkInProgress(sid, "model")
        s["busy"] = False
        out: list = []
        self._grant(out)
        return out

    def tick(self, now: float) -> list:
        out: list = []
        h = self.active()
        if h is not None and self.fifo:
            hs = self.sessions[h]
            if hs["may_park"] and not hs["busy"] and self._stale(h, now):
                self._park(h, out)
        self._grant(out)
        return out

    def close(self, sid: str) -> list:
        s = self._need(sid)
        if s["state"] == "closing":
            raise SessionClosing(sid, "model")
        if sid in self.fifo:
            self.fifo.remove(sid)
        s["state"] = "closing"
        out: list = [(sid, "closing")]
        self._grant(out)
        return out

    def release(self, sid: str) -> list:
        s = self._need(sid)
        if s["state"] != "closing":
            raise NotClosing(sid, "model")
        if s["busy"]:
            raise ChunkInProgress(sid, "model")
        del self.sessions[sid]
        return []

    def view(self) -> tuple:
        return tuple(
            (sid, s["state"], s["last"], s["busy"], (self.fifo.index(sid) + 1) if sid in self.fifo else None)
            for sid, s in self.sessions.items()
        )


SESSION_IDS = st.sampled_from(["s0", "s1", "s2", "s3"])
MODEL_TIMEOUT = 1.0


class LeaseBookMachine(RuleBasedStateMachine):
    ROTATE = False

    def __init__(self) -> None:
        super().__init__()
        self.book = LeaseBook(MODEL_TIMEOUT, rotate=self.ROTATE)
        self.model = ReferenceLease(MODEL_TIMEOUT, rotate=self.ROTATE)
        self.now = 0.0
        self.holder_before: str | None = None
        # the guaranteed chunk, tracked apart from the model: who queued behind an
        # occupied lease, and who was granted after such a wait and has not run yet
        self.owed_queued: set[str] = set()
        self.owed_granted: set[str] = set()
        # parked (by the book or by relinquish) and no activity of its own since
        self.parked: set[str] = set()

    def _both(self, book_call, model_call) -> list:
        self.holder_before = self.book.holder()
        try:
            expected = model_call()
        except LeaseError as model_error:
            before = self.book.snapshot()
            with pytest.raises(type(model_error)):
                book_call()
            assert self.book.snapshot() == before
            return []
        got = book_call()
        assert [(t.session_id, t.state.value) for t in got] == expected
        return got

    def _judge(
        self, busy_before: str | None, boundary: str | None, got: list, relinquisher: str | None = None
    ) -> None:
        """The lease moves only at the running chunk's own boundary; owed chunks are
        kept (unless the holder relinquishes); parked sessions need new activity."""
        for t in got:
            if t.state in (A, P) and busy_before is not None:
                assert boundary == busy_before, f"{t} while {busy_before} is mid-chunk"
            if t.state is A:
                assert t.session_id not in self.parked, f"parked {t.session_id} granted without activity"
            if t.state is P:
                self.parked.add(t.session_id)
                if t.session_id == relinquisher:
                    assert t == got[0] and relinquisher == self.holder_before, f"{got} for relinquish"
                    self.owed_queued.discard(relinquisher)
                    self.owed_granted.discard(relinquisher)
                    continue
                assert t.session_id not in self.owed_granted, f"{t.session_id} parked before its chunk"
            if t.state is Q and t.session_id == self.holder_before:  # a yield
                assert self.ROTATE, f"{t} without rotation"
                assert boundary == t.session_id == busy_before, f"{t} outside its own chunk boundary"
                assert self.book.queued()[-1:] == (t.session_id,), "a yield re-queues at the tail"
            if t.state is A and t.session_id in self.owed_queued:
                self.owed_queued.discard(t.session_id)
                self.owed_granted.add(t.session_id)

    def _busy(self) -> str | None:
        return next((s.session_id for s in self.book.snapshot() if s.busy), None)

    @initialize()
    def three_sessions(self) -> None:
        for sid in ("s0", "s1", "s2"):
            self._both(lambda: self.book.register(sid, 0.0), lambda: self.model.register(sid, 0.0))

    @precondition(lambda self: self.book.holder() is not None)
    @rule()
    def holder_begins(self) -> None:
        self.begin(self.book.holder())

    @precondition(lambda self: self._busy() is not None)
    @rule()
    def chunk_ends(self) -> None:
        self.finish(self._busy())

    @precondition(lambda self: len(self.book) > 0)
    @rule(data=st.data())
    def known_session_acts(self, data: st.DataObject) -> None:
        self.activity(data.draw(st.sampled_from(self.book.sessions()), label="sid"))

    @rule()
    def idle_timeout_passes(self) -> None:
        self.now += MODEL_TIMEOUT
        self.tick()

    @rule(delta=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]))
    def advance(self, delta: float) -> None:
        self.now += delta

    @rule(sid=SESSION_IDS)
    def register(self, sid: str) -> None:
        self._both(lambda: self.book.register(sid, self.now), lambda: self.model.register(sid, self.now))

    @rule(sid=SESSION_IDS)
    def activity(self, sid: str) -> None:
        busy = self._busy()
        queues = sid in self.book and self.book.state(sid) in (W, P)
        occupied = not self.book.lease_free()
        if queues and occupied:
            self.owed_queued.add(sid)
        if sid in self.book and self.book.state(sid) is not C:
            self.parked.discard(sid)
        got = self._both(
            lambda: self.book.record_activity(sid, self.now), lambda: self.model.activity(sid, self.now)
        )
        self._judge(busy, None, got)

    @rule(sid=SESSION_IDS)
    def begin(self, sid: str) -> None:
        self._both(lambda: self.book.begin_chunk(sid), lambda: self.model.begin(sid))
        if sid in self.book and self.book.is_busy(sid):
            self.owed_granted.discard(sid)

    @rule(sid=SESSION_IDS)
    def finish(self, sid: str) -> None:
        busy = self._busy()
        waiters = bool(self.book.queued())
        got = self._both(
            lambda: self.book.finish_chunk(sid, self.now), lambda: self.model.finish(sid, self.now)
        )
        self._judge(busy, sid, got)
        if self.ROTATE and sid == self.holder_before == busy and waiters:
            assert self.book.state(sid) is not A, f"{sid} kept the lease while others waited"

    @precondition(lambda self: self.book.holder() is not None)
    @rule()
    def holder_relinquishes(self) -> None:
        self.relinquish(self.book.holder())

    @rule(sid=SESSION_IDS)
    def relinquish(self, sid: str) -> None:
        busy = self._busy()
        got = self._both(
            lambda: self.book.relinquish(sid, self.now), lambda: self.model.relinquish(sid, self.now)
        )
        self._judge(busy, None, got, relinquisher=sid)
        if got:
            assert self.book.state(sid) is P and self.book.queue_position(sid) is None

    @rule(sid=SESSION_IDS)
    def abort(self, sid: str) -> None:
        busy = self._busy()
        got = self._both(lambda: self.book.abort_chunk(sid), lambda: self.model.abort(sid))
        self._judge(busy, sid, got)

    @rule()
    def tick(self) -> None:
        busy = self._busy()
        got = self._both(lambda: self.book.tick(self.now), lambda: self.model.tick(self.now))
        self._judge(busy, None, got)

    @rule(sid=SESSION_IDS)
    def close(self, sid: str) -> None:
        busy = self._busy()
        got = self._both(lambda: self.book.close(sid), lambda: self.model.close(sid))
        self._judge(busy, None, got)
        if sid in self.book and self.book.state(sid) is C:
            self.owed_queued.discard(sid)
            self.owed_granted.discard(sid)
            self.parked.discard(sid)

    @rule(sid=SESSION_IDS)
    def release(self, sid: str) -> None:
        self._both(lambda: self.book.release(sid), lambda: self.model.release(sid))

    @invariant()
    def matches_the_model(self) -> None:
        view = tuple(
            (s.session_id, s.state.value, s.last_activity_at, s.busy, s.queue_position)
            for s in self.book.snapshot()
        )
        assert view == self.model.view()

    @invariant()
    def lease_invariants(self) -> None:
        snaps = self.book.snapshot()
        active = [s.session_id for s in snaps if s.state is A]
        busy = [s for s in snaps if s.busy]
        assert len(active) <= 1
        assert len(busy) <= 1
        assert self.book.holder() == (active[0] if active else None)
        if busy:
            assert busy[0].state in (A, C)
            if busy[0].state is C:
                assert not active
        queued = self.book.queued()
        assert [self.book.queue_position(sid) for sid in queued] == list(range(1, len(queued) + 1))
        assert {s.session_id for s in snaps if s.state is Q} == set(queued)
        assert all(s.queue_position is None for s in snaps if s.state is not Q)
        if queued:
            assert not self.book.lease_free(), "a free lease with waiters"
        assert {s.session_id for s in snaps if s.state is P} == self.parked


LeaseBookMachine.TestCase.settings = settings(max_examples=100, deadline=None, stateful_step_count=50)
TestLeaseBookModel = LeaseBookMachine.TestCase


class RotatingLeaseBookMachine(LeaseBookMachine):
    """The same rules and model with round robin at chunk boundaries, plus a
    rule that plays the starvation scenario: everyone keeps sending controls
    while the holder runs a chunk."""

    ROTATE = True

    @precondition(lambda self: self.book.holder() is not None)
    @rule()
    def everyone_acts_then_holder_runs_a_chunk(self) -> None:
        for sid in self.book.sessions():
            self.activity(sid)
        holder = self.book.holder()
        if holder is not None and self._busy() is None:
            self.begin(holder)
            self.finish(holder)


RotatingLeaseBookMachine.TestCase.settings = settings(
    max_examples=100, deadline=None, stateful_step_count=50
)
TestRotatingLeaseBookModel = RotatingLeaseBookMachine.TestCase


# ------------------------------------------------------------- exploration


@pytest.mark.parametrize("config", explore_lease.configurations(small=True), ids=lambda c: c.name)
def test_small_exploration_finds_no_violation(config) -> None:
    report = explore(config)
    assert report.violations == ()
    assert report.states > 100
