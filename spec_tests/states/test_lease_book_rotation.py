"""The execution-lease book's rotation (round robin at chunk boundaries) and
relinquish rules."""

from __future__ import annotations

import copy

import pytest

from states.lease_book import (
    ChunkInProgress,
    LeaseBook,
    LeaseError,
    LeaseTransition,
    NotHolder,
    UnknownLeaseSession,
)

from .lease_book_helpers import A, C, P, Q, T, W, book_with, states, tr


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
