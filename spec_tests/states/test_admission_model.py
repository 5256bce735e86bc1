"""The admission book against an independent model (a Hypothesis stateful machine), and the exhaustive
explorer over small configurations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from states import IllegalTransition
from states.admission import (
    AdmissionBook,
    AdmissionTransition,
    DuplicateAdmissionSession,
    InvalidSetting,
    UnknownAdmissionSession,
)
from states.explore import explore
from states.explore_admission import configurations
from states.worker import State as WS


# --- model-based test ----------------------------------------------------------


class Model:
    """Plain lists and dicts, written straight from the rules."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.workers: dict[str, dict] = {}  # id -> {"state", "capacity", "sessions"}
        self.queue: list[str] = []
        self.holds = 0  # promotions held (the server ending queued sessions a batch at a time)
        self.requeued: set[str] = set()  # sessions given back to the queue (they may pass queue_size)
        self.order: dict[str, int] = {}  # session -> the number of its (latest) admission
        self.admitted = 0

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
        if wid is None and self.queue_size == 0:
            return ("rejected", None, None, "no_capacity"), [("rejected", s, None, None)]
        if wid is None and len(self.queue) >= self.queue_size:  # at or past its size (sessions given back): refused
            return ("rejected", None, None, "queue_full"), [("rejected", s, None, None)]
        self.order[s] = self.admitted
        self.admitted += 1
        if wid is not None:
            return ("assigned", wid, None, None), self.put(s, wid, "assigned", None)
        self.queue.append(s)
        n = len(self.queue)
        return ("queued", None, n, None), [("queued", s, None, n)]

    def release(self, s: str) -> list:
        if s in self.queue:
            position = self.queue.index(s) + 1
            self.queue.remove(s)
            return [("dequeued", s, None, position)]
        wid, worker_changes = self.take_off_worker(s)
        return [("released", s, wid, None), *worker_changes, *self.promote()]

    def take_off_worker(self, s: str) -> tuple[str, list]:
        wid = self.where(s)
        w = self.workers[wid]
        w["sessions"].remove(s)
        last = not w["sessions"]
        event = "last_session_removed" if last else "session_removed"
        if w["state"] == "busy" and last:
            w["state"] = "idle"
        out = [(wid, event, w["state"])]
        if last and w["state"] == "draining":
            w["state"] = "stopped"
            out.append((wid, "drained", "stopped"))
        return wid, out


    def requeue(self, s: str) -> list:
        """Back to the queue in admission order: behind every queued session admitted before it."""
        wid, worker_changes = self.take_off_worker(s)
        place = sum(self.order[q] < self.order[s] for q in self.queue)
        self.queue.insert(place, s)
        self.requeued.add(s)
        return [("requeued", s, wid, place + 1), *worker_changes, *self.promote()]


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

    @initialize(queue_size=st.integers(0, 3), capacity=st.integers(1, 3))
    def start(self, queue_size, capacity):
        """A book with one ready worker (more come with ``add_worker``): sessions to move from the first steps on."""
        self.book = AdmissionBook(queue_size)
        self.model = Model(queue_size)
        self.book.add_worker("w0", capacity, self.tick())
        self.model.workers["w0"] = {"state": "idle", "capacity": capacity, "sessions": []}
        assert as_tuples(self.book.worker_ready("w0", self.tick())) == [("w0", "ready", "idle")]

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

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def requeue_head(self, data):
        s = data.draw(st.sampled_from(self.seen))
        before = self.book.canonical_key()
        if self.model.where(s) is None:  # queued or gone: nothing to give back
            with pytest.raises(UnknownAdmissionSession):
                self.book.requeue_head(s, self.tick())
            assert self.book.canonical_key() == before
            return
        assert as_tuples(self.book.requeue_head(s, self.tick())) == self.model.requeue(s)

    @precondition(lambda self: any(w["sessions"] for w in self.model.workers.values()))
    @rule(data=st.data())
    def an_agent_drains_and_refuses_its_starts(self, data):
        """A worker that holds sessions drains (or has failed) and refuses each Start on its way to it, in the order
        they were sent (admitted): every session it holds is given back, one after another, and no worker has room
        for them meanwhile unless another one has."""
        holding = sorted((w for w, v in self.model.workers.items() if v["sessions"]),
                         key=lambda w: (-len(self.model.workers[w]["sessions"]), w))  # the fullest first
        wid = data.draw(st.sampled_from(holding))
        w = self.model.workers[wid]
        if w["state"] in ("idle", "busy"):
            assert as_tuples(self.book.drain_worker(wid, self.tick())) == [(wid, "drain", "draining")]
            w["state"] = "draining"
        for s in list(w["sessions"]):
            assert as_tuples(self.book.requeue_head(s, self.tick())) == self.model.requeue(s)

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
        # a session given back to the queue was admitted already: it may take the queue past its size, no other
        queued = self.book.queued_ids()
        assert len(queued) <= self.book.queue_size + sum(s in self.model.requeued for s in queued)
        if queued and len(queued) >= self.book.queue_size:  # at or past its size: no create gets through
            assert not self.book.would_admit()
        # the queue holds its sessions in the order they were admitted, those given back included
        assert [self.model.order[s] for s in queued] == sorted(self.model.order[s] for s in queued)
        if self.book.queued_ids() and not self.model.holds:  # held: room may wait for the resume
            assert not any(v.state in (WS.IDLE, WS.BUSY) and v.retained < v.capacity for v in views)
            assert self.book.snapshot().free_slots == 0


AdmissionMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestAdmissionMachine = AdmissionMachine.TestCase


# --- exhaustive exploration ----------------------------------------------------


def test_explorer_small_configurations_have_no_violations():
    for config in configurations(small=True):
        report = explore(config)
        assert report.violations == ()
        assert report.states > 1000, report.line()
