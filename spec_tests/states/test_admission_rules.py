"""The admission book's unit rules: workers and their events, admission (placement, queueing, rejection),
release and promotion, failure, drain, stop and capacity, snapshots and copies."""

from __future__ import annotations

import copy

import pytest

from states import IllegalTransition
from states.admission import (
    Admission,
    AdmissionBook,
    AdmissionTransition,
    DuplicateAdmissionSession,
    DuplicateWorker,
    InvalidSetting,
    UnknownAdmissionSession,
    UnknownWorker,
    WorkerTransition,
    admitted_ids,
)
from states.worker import Event as WE
from states.worker import State as WS


def book_with(*capacities: int, queue_size: int = 2, ready: bool = True) -> AdmissionBook:
    book = AdmissionBook(queue_size)
    for i, capacity in enumerate(capacities):
        book.add_worker(f"w{i}", capacity, 0.0)
        if ready:
            book.worker_ready(f"w{i}", 0.0)
    return book


def session_moves(transitions) -> list[tuple[str, str, str | None, int | None]]:
    return [
        (t.kind, t.session_id, t.worker_id, t.queue_position)
        for t in transitions
        if isinstance(t, AdmissionTransition)
    ]


def worker_moves(transitions) -> list[tuple[str, WE, WS]]:
    return [(t.worker_id, t.event, t.state) for t in transitions if isinstance(t, WorkerTransition)]


# --- workers -------------------------------------------------------------------


def test_new_worker_is_starting_and_takes_nothing_until_ready():
    book = book_with(2, queue_size=0, ready=False)
    assert book.worker_state("w0") is WS.STARTING
    admission, transitions = book.admit("s1", 1.0)
    assert admission == Admission("rejected", "s1", reason="no_capacity")
    assert session_moves(transitions) == [("rejected", "s1", None, None)]
    assert not book.holds("s1")


def test_ready_promotes_queued_heads_in_order():
    book = book_with(2, queue_size=3, ready=False)
    for s in ("s1", "s2", "s3"):
        assert book.admit(s, 1.0)[0].status == "queued"
    transitions = book.worker_ready("w0", 2.0)
    assert worker_moves(transitions)[0] == ("w0", WE.READY, WS.IDLE)
    assert session_moves(transitions) == [("promoted", "s1", "w0", 1), ("promoted", "s2", "w0", 1)]
    promoted = [t for t in transitions if isinstance(t, AdmissionTransition)]
    assert all(t.queued_at == 1.0 and t.at == 2.0 for t in promoted)
    assert book.queued_ids() == ("s3",)
    assert book.queue_position("s3") == 1
    assert book.worker_state("w0") is WS.BUSY


def test_add_worker_errors_change_nothing():
    book = book_with(1)
    before = book.canonical_key()
    with pytest.raises(DuplicateWorker) as info:
        book.add_worker("w0", 1, 0.0)
    assert info.value.worker_id == "w0"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidSetting) as err:
            book.add_worker("w9", bad, 0.0)
        assert err.value.field == "capacity"
    with pytest.raises(InvalidSetting) as err:
        book.add_worker("", 1, 0.0)
    assert err.value.field == "worker_id"
    assert book.canonical_key() == before


def test_bad_queue_size_is_named():
    for bad in (-1, True, "2"):
        with pytest.raises(InvalidSetting) as err:
            AdmissionBook(bad)  # type: ignore[arg-type]
        assert err.value.field == "queue_size"


def test_unknown_worker_is_a_key_error_naming_it():
    book = book_with(1)
    for call in (
        lambda: book.worker_ready("nope", 0.0),
        lambda: book.fail_worker("nope", 0.0),
        lambda: book.set_capacity("nope", 2, 0.0),
        lambda: book.retained("nope"),
    ):
        with pytest.raises(UnknownWorker) as err:
            call()
        assert isinstance(err.value, KeyError)
        assert err.value.worker_id == "nope"
        assert "nope" in str(err.value)


def test_worker_events_outside_the_table_raise_and_change_nothing():
    book = book_with(1)
    book.admit("s1", 0.0)
    before = book.canonical_key()
    with pytest.raises(IllegalTransition):
        book.worker_ready("w0", 1.0)  # already ready
    with pytest.raises(IllegalTransition):
        book.stop_worker("w0", 1.0)  # busy: holds a session
    book.fail_worker("w0", 1.0)
    after_fail = book.canonical_key()
    assert after_fail != before
    with pytest.raises(IllegalTransition):
        book.fail_worker("w0", 2.0)
    with pytest.raises(IllegalTransition):
        book.drain_worker("w0", 2.0)
    assert book.canonical_key() == after_fail


# --- admission -----------------------------------------------------------------


def test_assigns_least_loaded_by_normalized_load_then_retained_then_id():
    book = book_with(4, 2, queue_size=0)
    # both empty: tie on (0.0, 0) -> lower id
    assert book.admit("s1", 0.0)[0] == Admission("assigned", "s1", worker_id="w0")
    # w0 1/4 = 0.25 vs w1 0/2 = 0 -> w1
    assert book.admit("s2", 0.0)[0].worker_id == "w1"
    # w0 0.25 vs w1 0.5 -> w0
    assert book.admit("s3", 0.0)[0].worker_id == "w0"
    # w0 2/4 = 0.5 vs w1 1/2 = 0.5 -> fewer retained wins: w1
    assert book.admit("s4", 0.0)[0].worker_id == "w1"
    assert (book.retained("w0"), book.retained("w1")) == (2, 2)


def test_assign_moves_worker_idle_to_busy_through_its_machine():
    book = book_with(2)
    admission, transitions = book.admit("s1", 3.0)
    assert session_moves(transitions) == [("assigned", "s1", "w0", None)]
    assert worker_moves(transitions) == [("w0", WE.SESSION_ADDED, WS.BUSY)]
    assert admitted_ids(transitions) == [("s1", "w0")]
    _, transitions = book.admit("s2", 3.0)
    assert worker_moves(transitions) == [("w0", WE.SESSION_ADDED, WS.BUSY)]


def test_queue_then_reject_queue_full_holding_nothing():
    book = book_with(1, queue_size=2)
    book.admit("s1", 0.0)
    assert book.admit("s2", 1.0)[0] == Admission("queued", "s2", queue_position=1)
    admission, transitions = book.admit("s3", 2.0)
    assert admission == Admission("queued", "s3", queue_position=2)
    assert session_moves(transitions) == [("queued", "s3", None, 2)]
    assert transitions[0].queued_at == 2.0
    admission, transitions = book.admit("s4", 3.0)
    assert admission == Admission("rejected", "s4", reason="queue_full")
    assert session_moves(transitions) == [("rejected", "s4", None, None)]
    assert not book.holds("s4")
    with pytest.raises(UnknownAdmissionSession):
        book.release("s4", 4.0)
    # a rejected id may try again later
    book.release("s2", 5.0)
    assert book.admit("s4", 6.0)[0] == Admission("queued", "s4", queue_position=2)


def test_queue_size_zero_rejects_no_capacity():
    book = book_with(1, queue_size=0)
    book.admit("s1", 0.0)
    assert book.admit("s2", 0.0)[0] == Admission("rejected", "s2", reason="no_capacity")


def test_duplicate_admission_is_refused_and_changes_nothing():
    book = book_with(1, queue_size=1)
    book.admit("s1", 0.0)
    book.admit("s2", 0.0)
    before = book.canonical_key()
    for s in ("s1", "s2"):
        with pytest.raises(DuplicateAdmissionSession) as err:
            book.admit(s, 1.0)
        assert err.value.session_id == s
        assert isinstance(err.value, ValueError)
    with pytest.raises(InvalidSetting) as bad:
        book.admit("", 1.0)
    assert bad.value.field == "session_id"
    assert book.canonical_key() == before
    assert book.queued_at("s2") == 0.0


# --- release -------------------------------------------------------------------


def test_release_of_queued_closes_up_positions():
    book = book_with(1, queue_size=3)
    for s in ("s0", "s1", "s2", "s3"):
        book.admit(s, 0.0)
    assert [book.queue_position(s) for s in ("s1", "s2", "s3")] == [1, 2, 3]
    transitions = book.release("s2", 1.0)
    assert session_moves(transitions) == [("dequeued", "s2", None, 2)]
    assert worker_moves(transitions) == []
    assert book.queue_position("s2") is None
    assert [book.queue_position(s) for s in ("s1", "s3")] == [1, 2]
    book.release("s1", 2.0)
    assert book.queue_position("s3") == 1
    assert book.retained("w0") == 1  # a queued release frees no slot


def test_release_of_assigned_promotes_head_with_worker_events():
    book = book_with(2, queue_size=2)
    for s in ("s1", "s2", "s3", "s4"):
        book.admit(s, 0.0)
    transitions = book.release("s1", 5.0)
    assert session_moves(transitions) == [("released", "s1", "w0", None), ("promoted", "s3", "w0", 1)]
    assert worker_moves(transitions) == [
        ("w0", WE.SESSION_REMOVED, WS.BUSY),
        ("w0", WE.SESSION_ADDED, WS.BUSY),
    ]
    assert book.worker_of("s3") == "w0"
    assert book.queue_position("s4") == 1


def test_last_release_makes_worker_idle():
    book = book_with(2)
    book.admit("s1", 0.0)
    transitions = book.release("s1", 1.0)
    assert worker_moves(transitions) == [("w0", WE.LAST_SESSION_REMOVED, WS.IDLE)]
    assert book.worker_state("w0") is WS.IDLE
    assert book.worker_of("s1") is None
    with pytest.raises(UnknownAdmissionSession) as err:
        book.release("s1", 2.0)
    assert err.value.session_id == "s1" and isinstance(err.value, KeyError)
    assert "s1" in str(err.value)


def test_promotion_goes_to_least_loaded_eligible_worker_not_the_releasing_failed_one():
    book = book_with(1, 1, queue_size=2)
    for s in ("s1", "s2", "s3"):
        book.admit(s, 0.0)
    book.fail_worker("w0", 1.0)
    # releasing from the failed worker frees no usable slot: s3 keeps waiting
    transitions = book.release("s1", 2.0)
    assert session_moves(transitions) == [("released", "s1", "w0", None)]
    assert worker_moves(transitions) == [("w0", WE.LAST_SESSION_REMOVED, WS.FAILED)]
    assert book.queue_position("s3") == 1
    # the healthy worker grows: s3 lands there, never on w0
    transitions = book.set_capacity("w1", 2, 3.0)
    assert session_moves(transitions) == [("promoted", "s3", "w1", 1)]
    assert book.worker_of("s3") == "w1"


def test_release_reruns_placement_over_every_eligible_worker():
    # w0 (2 slots) holds s1, s3 and fails; w1 (1 slot) holds s2; s4, s5, s6 wait.
    # Growing w1 by two places both heads there; a release on failed w0 places
    # nobody; a release on w1 places the next head on w1.
    book = book_with(2, 1, queue_size=3)
    for s in ("s1", "s2", "s3", "s4", "s5", "s6"):
        book.admit(s, 0.0)
    assert [book.worker_of(s) for s in ("s1", "s2", "s3")] == ["w0", "w1", "w0"]
    assert book.queued_ids() == ("s4", "s5", "s6")
    book.fail_worker("w0", 1.0)
    transitions = book.set_capacity("w1", 3, 2.0)
    assert session_moves(transitions) == [("promoted", "s4", "w1", 1), ("promoted", "s5", "w1", 1)]
    transitions = book.release("s1", 3.0)
    assert session_moves(transitions) == [("released", "s1", "w0", None)]
    transitions = book.release("s2", 4.0)
    assert session_moves(transitions) == [("released", "s2", "w1", None), ("promoted", "s6", "w1", 1)]
    assert book.retained("w0") == 1 and book.queued_ids() == ()


# --- failure, drain, stop, capacity --------------------------------------------


def test_failed_worker_keeps_counting_its_sessions_but_takes_no_new_ones():
    book = book_with(2, queue_size=1)
    book.admit("s1", 0.0)
    transitions = book.fail_worker("w0", 1.0)
    assert worker_moves(transitions) == [("w0", WE.FAIL, WS.FAILED)]
    assert book.retained("w0") == 1 and book.worker_of("s1") == "w0"
    assert book.admit("s2", 2.0)[0] == Admission("queued", "s2", queue_position=1)
    snap = book.snapshot()
    assert (snap.workers_total, snap.workers_failed, snap.retained, snap.queued, snap.free_slots) == (1, 1, 1, 1, 0)


def test_drain_stops_admission_and_stops_the_worker_when_empty():
    book = book_with(2, 2, queue_size=0)
    book.admit("s1", 0.0)  # w0
    transitions = book.drain_worker("w0", 1.0)
    assert worker_moves(transitions) == [("w0", WE.DRAIN, WS.DRAINING)]
    assert book.admit("s2", 2.0)[0].worker_id == "w1"
    transitions = book.release("s1", 3.0)
    assert worker_moves(transitions) == [
        ("w0", WE.LAST_SESSION_REMOVED, WS.DRAINING),
        ("w0", WE.DRAINED, WS.STOPPED),
    ]
    # an empty worker drains straight to stopped
    book.release("s2", 4.0)
    assert worker_moves(book.drain_worker("w1", 5.0)) == [
        ("w1", WE.DRAIN, WS.DRAINING),
        ("w1", WE.DRAINED, WS.STOPPED),
    ]
    assert book.snapshot().workers_stopped == 2


def test_sessions_given_back_keep_their_admission_order_and_may_pass_the_queue_size_but_no_create_does():
    """A draining worker refuses its two sessions before any worker has room: they wait in the order they were
    admitted, ahead of the session that queued behind them (each given back to the very head, they came out
    last-given first). Given back, they take the queue past its size; no create is queued while it is there."""
    book = book_with(2, queue_size=1)
    book.admit("s1", 0.0)
    book.admit("s2", 0.0)
    assert book.admit("s3", 0.0)[0] == Admission("queued", "s3", queue_position=1)
    book.drain_worker("w0", 1.0)
    assert session_moves(book.requeue_head("s1", 2.0)) == [("requeued", "s1", "w0", 1)]
    assert session_moves(book.requeue_head("s2", 3.0)) == [("requeued", "s2", "w0", 2)]
    assert book.queued_ids() == ("s1", "s2", "s3") and book.snapshot().queued == 3 > book.queue_size
    assert not book.would_admit()
    assert book.admit("s4", 4.0)[0] == Admission("rejected", "s4", reason="queue_full")
    book.add_worker("w1", 2, 5.0)
    promoted = [move[1] for move in session_moves(book.worker_ready("w1", 5.0)) if move[0] == "promoted"]
    assert promoted == ["s1", "s2"] and book.queued_ids() == ("s3",)
    assert not book.would_admit()  # at its size again: still no create
    book.release("s1", 6.0)
    assert book.worker_of("s3") == "w1" and book.admit("s5", 7.0)[0].status == "queued"


def test_stop_only_an_empty_worker():
    book = book_with(1, queue_size=0, ready=False)
    assert worker_moves(book.stop_worker("w0", 0.0)) == [("w0", WE.STOP, WS.STOPPED)]
    assert book.admit("s1", 0.0)[0].reason == "no_capacity"


def test_capacity_never_below_retained_and_errors_change_nothing():
    book = book_with(3, queue_size=2)
    for s in ("s1", "s2"):
        book.admit(s, 0.0)
    before = book.canonical_key()
    for bad in (0, 1, -3, True, 2.0):
        with pytest.raises(InvalidSetting) as err:
            book.set_capacity("w0", bad, 1.0)  # type: ignore[arg-type]
        assert err.value.field == "capacity"
    assert book.canonical_key() == before
    assert book.set_capacity("w0", 2, 1.0) == []  # equal to retained is fine
    assert book.capacity("w0") == 2
    book.admit("s3", 2.0)
    book.admit("s4", 2.0)
    transitions = book.set_capacity("w0", 5, 3.0)
    assert session_moves(transitions) == [("promoted", "s3", "w0", 1), ("promoted", "s4", "w0", 1)]


def test_snapshot_and_views():
    book = book_with(1, 2, queue_size=1, ready=False)
    book.worker_ready("w1", 0.0)
    book.admit("s1", 0.0)
    snap = book.snapshot()
    assert (snap.workers_starting, snap.workers_idle, snap.workers_busy) == (1, 0, 1)
    assert (snap.retained, snap.queued, snap.free_slots) == (1, 0, 1)
    (w0, w1) = book.workers()
    assert (w0.worker_id, w0.state, w0.retained) == ("w0", WS.STARTING, 0)
    assert (w1.session_ids, w1.capacity) == (("s1",), 2)


def test_copy_and_deepcopy_are_independent():
    book = book_with(1, queue_size=1)
    book.admit("s1", 0.0)
    for other in (book.copy(), copy.deepcopy(book)):
        assert other.canonical_key() == book.canonical_key()
        other.release("s1", 1.0)
        other.fail_worker("w0", 1.0)
        assert book.worker_of("s1") == "w0"
        assert book.worker_state("w0") is WS.BUSY
    hash(book.canonical_key())
