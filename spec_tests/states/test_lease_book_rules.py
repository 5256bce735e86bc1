"""The execution-lease book's unit rules: construction, queueing, chunks, parking,
close/release, errors that change nothing, snapshots, copies and canonical keys."""

from __future__ import annotations

import copy
import math

import attrs
import pytest

from states.lease_book import (
    ChunkInProgress,
    DuplicateLeaseSession,
    LeaseBook,
    LeaseError,
    LeaseSnapshot,
    NoChunkInProgress,
    NotClosing,
    NotHolder,
    SessionClosing,
    UnknownLeaseSession,
)

from .lease_book_helpers import A, C, P, Q, T, W, book_with, states, tr


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
