"""The execution-lease book against an independent reference model (Hypothesis
stateful tests, with and without rotation), and a small exhaustive exploration."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from states import explore_lease
from states.explore import explore
from states.lease_book import (
    ChunkInProgress,
    DuplicateLeaseSession,
    LeaseBook,
    LeaseError,
    NoChunkInProgress,
    NotClosing,
    NotHolder,
    SessionClosing,
    UnknownLeaseSession,
)

from .lease_book_helpers import A, C, P, Q, W


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
