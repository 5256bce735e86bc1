"""The admission book: unit rules, a model-based Hypothesis machine, and the exhaustive explorer."""

from __future__ import annotations

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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
from states.explore import explore
from states.explore_admission import configurations
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


# --- model-based test ----------------------------------------------------------


class Model:
    """Plain lists and dicts, written straight from the rules."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.workers: dict[str, dict] = {}  # id -> {"state", "capacity", "sessions"}
        self.queue: list[str] = []
        self.holds = 0  # promotions held (the server ending queued sessions a batch at a time)

    def where(self, s: str) -> str | None:
        for wid, w in self.workers.items():
            if s in w["sessions"]:
                return wid
        return None

    def pick(self) -> str | None:
        room = [
            (len(w["sessions"]) / w["capacity"], len(w["sessions"]), wid)
            for wid, w in self.workers.items()
            if w["state"] in ("idle", "busy") and len(w["sessions"]) < w["capacity"]
        ]
        return min(room)[2] if room else None

    def put(self, s: str, wid: str, kind: str, position) -> list:
        w = self.workers[wid]
        w["sessions"].append(s)
        w["state"] = "busy"
        return [(kind, s, wid, position), (wid, "session_added", "busy")]

    def promote(self) -> list:
        out = []
        while self.queue and not self.holds and (wid := self.pick()) is not None:
            out += self.put(self.queue.pop(0), wid, "promoted", 1)
        return out

    def admit(self, s: str):
        wid = None if self.queue else self.pick()  # first come, first served: never ahead of a queued session
        if wid is not None:
            return ("assigned", wid, None, None), self.put(s, wid, "assigned", None)
        if self.queue_size == 0:
            return ("rejected", None, None, "no_capacity"), [("rejected", s, None, None)]
        if len(self.queue) >= self.queue_size:
            return ("rejected", None, None, "queue_full"), [("rejected", s, None, None)]
        self.queue.append(s)
        n = len(self.queue)
        return ("queued", None, n, None), [("queued", s, None, n)]

    def release(self, s: str) -> list:
        if s in self.queue:
            position = self.queue.index(s) + 1
            self.queue.remove(s)
            return [("dequeued", s, None, position)]
        wid = self.where(s)
        w = self.workers[wid]
        w["sessions"].remove(s)
        last = not w["sessions"]
        event = "last_session_removed" if last else "session_removed"
        if w["state"] == "busy" and last:
            w["state"] = "idle"
        out = [("released", s, wid, None), (wid, event, w["state"])]
        if last and w["state"] == "draining":
            w["state"] = "stopped"
            out.append((wid, "drained", "stopped"))
        return out + self.promote()


def as_tuples(transitions) -> list:
    out = []
    for t in transitions:
        if isinstance(t, AdmissionTransition):
            out.append((t.kind, t.session_id, t.worker_id, t.queue_position))
        else:
            out.append((t.worker_id, t.event.value, t.state.value))
    return out


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.next_session = 0
        self.now = 0.0
        self.seen: list[str] = []

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    @initialize(queue_size=st.integers(0, 3))
    def start(self, queue_size):
        self.book = AdmissionBook(queue_size)
        self.model = Model(queue_size)

    @precondition(lambda self: len(self.model.workers) < 4)
    @rule(capacity=st.integers(1, 3))
    def add_worker(self, capacity):
        wid = f"w{len(self.model.workers)}"
        assert self.book.add_worker(wid, capacity, self.tick()) == []
        self.model.workers[wid] = {"state": "starting", "capacity": capacity, "sessions": []}

    def worker_event(self, data, method, event, allowed, to_state):
        """Apply a worker-level event to both; outside the table nothing may change."""
        wid = data.draw(st.sampled_from(sorted(self.model.workers)))
        w = self.model.workers[wid]
        before = self.book.canonical_key()
        if w["state"] not in allowed:
            with pytest.raises(IllegalTransition):
                getattr(self.book, method)(wid, self.tick())
            assert self.book.canonical_key() == before
            return
        got = as_tuples(getattr(self.book, method)(wid, self.tick()))
        expected = [(wid, event, to_state(w))]
        w["state"] = to_state(w)
        if method == "drain_worker" and not w["sessions"]:
            w["state"] = "stopped"
            expected.append((wid, "drained", "stopped"))
        if method == "worker_ready":
            expected += self.model.promote()
        assert got == expected

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data())
    def worker_ready(self, data):
        self.worker_event(data, "worker_ready", "ready", {"starting"}, lambda w: "idle")

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data())
    def fail_worker(self, data):
        self.worker_event(data, "fail_worker", "fail", {"starting", "idle", "busy", "draining"}, lambda w: "failed")

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data())
    def drain_worker(self, data):
        self.worker_event(data, "drain_worker", "drain", {"idle", "busy"}, lambda w: "draining")

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data())
    def stop_worker(self, data):
        self.worker_event(data, "stop_worker", "stop", {"starting", "idle"}, lambda w: "stopped")

    @precondition(lambda self: self.model.workers)
    @rule(data=st.data(), capacity=st.integers(0, 4))
    def set_capacity(self, data, capacity):
        wid = data.draw(st.sampled_from(sorted(self.model.workers)))
        w = self.model.workers[wid]
        before = self.book.canonical_key()
        if capacity < max(1, len(w["sessions"])):
            with pytest.raises(InvalidSetting) as err:
                self.book.set_capacity(wid, capacity, self.tick())
            assert err.value.field == "capacity"
            assert self.book.canonical_key() == before
            return
        got = as_tuples(self.book.set_capacity(wid, capacity, self.tick()))
        grew = capacity > w["capacity"]
        w["capacity"] = capacity
        assert got == (self.model.promote() if grew else [])

    @rule()
    def admit(self):
        s = f"s{self.next_session}"
        self.next_session += 1
        self.seen.append(s)
        before = self.book.canonical_key()
        would = self.book.would_admit()  # the server's look before it makes a LiveKit room: a pure query
        assert self.book.canonical_key() == before
        admission, transitions = self.book.admit(s, self.tick())
        assert would == (admission.status != "rejected")
        expected_answer, expected_moves = self.model.admit(s)
        assert (admission.status, admission.worker_id, admission.queue_position, admission.reason) == expected_answer
        assert admission.session_id == s
        assert as_tuples(transitions) == expected_moves

    @rule(ahead=st.integers(0, 4))
    def admit_behind_promised_places(self, ahead):
        """Sessions promised a place (their rooms being made) take places first: admitting behind ``ahead`` of
        them answers as admitting after ``ahead`` others would, and a look behind them changes nothing."""
        before = self.book.canonical_key()
        would = self.book.would_admit(ahead)
        assert self.book.canonical_key() == before
        promised = self.book.copy()
        for index in range(ahead):
            promised.admit(f"promised-{index}", self.tick())
        assert would == promised.would_admit()
        behind = self.book.copy()
        admission, _ = behind.admit("behind", self.tick(), ahead=ahead)
        assert (admission.status != "rejected") == would
        if not would:
            assert admission.reason == ("no_capacity" if self.book.queue_size == 0 else "queue_full")
        with pytest.raises(InvalidSetting):
            self.book.admit("negative", self.tick(), ahead=-1)
        assert self.book.canonical_key() == before

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def admit_again(self, data):
        s = data.draw(st.sampled_from(self.seen))
        before = self.book.canonical_key()
        if self.model.where(s) is not None or s in self.model.queue:
            with pytest.raises(DuplicateAdmissionSession):
                self.book.admit(s, self.tick())
            assert self.book.canonical_key() == before
        else:  # rejected or released before: a fresh admission
            admission, transitions = self.book.admit(s, self.tick())
            expected_answer, expected_moves = self.model.admit(s)
            assert (admission.status, admission.worker_id, admission.queue_position, admission.reason) == expected_answer
            assert as_tuples(transitions) == expected_moves

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(self.seen))
        before = self.book.canonical_key()
        if self.model.where(s) is None and s not in self.model.queue:
            with pytest.raises(UnknownAdmissionSession):
                self.book.release(s, self.tick())
            assert self.book.canonical_key() == before
            return
        assert as_tuples(self.book.release(s, self.tick())) == self.model.release(s)

    @precondition(lambda self: self.model.holds < 2)
    @rule()
    def hold_promotions(self):
        assert self.book.hold_promotions() is None
        self.model.holds += 1
        assert self.book.promotions_held

    @rule()
    def resume_promotions(self):
        before = self.book.canonical_key()
        if not self.model.holds:
            with pytest.raises(InvalidSetting):
                self.book.resume_promotions(self.tick())
            assert self.book.canonical_key() == before
            return
        self.model.holds -= 1
        assert as_tuples(self.book.resume_promotions(self.tick())) == self.model.promote()
        assert self.book.promotions_held == bool(self.model.holds)

    @invariant()
    def agrees_with_model(self):
        model, book = self.model, self.book
        assert book.queued_ids() == tuple(model.queue)
        for i, s in enumerate(model.queue, start=1):
            assert book.queue_position(s) == i
        assert book.queue_positions() == {s: i for i, s in enumerate(model.queue, start=1)}
        views = {v.worker_id: v for v in book.workers()}
        assert sorted(views) == sorted(model.workers)
        for wid, w in model.workers.items():
            assert views[wid].state.value == w["state"]
            assert views[wid].capacity == w["capacity"]
            assert sorted(views[wid].session_ids) == sorted(w["sessions"])
        for s in self.seen:
            assert book.worker_of(s) == model.where(s)
            assert not (book.worker_of(s) and book.queue_position(s))
        snap = book.snapshot()
        assert snap.queued == len(model.queue)
        assert snap.retained == sum(len(w["sessions"]) for w in model.workers.values())

    @invariant()
    def capacity_queue_and_work_conservation(self):
        views = self.book.workers()
        assert all(v.retained <= v.capacity for v in views)
        assert len(self.book.queued_ids()) <= self.book.queue_size
        if self.book.queued_ids() and not self.model.holds:  # held: room may wait for the resume
            assert not any(v.state in (WS.IDLE, WS.BUSY) and v.retained < v.capacity for v in views)
            assert self.book.snapshot().free_slots == 0


AdmissionMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase


# --- exhaustive exploration ----------------------------------------------------


def test_explorer_small_configurations_have_no_violations():
    for config in configurations(small=True):
        report = explore(config)
        assert report.violations == ()
        assert report.states > 1000, report.line()
