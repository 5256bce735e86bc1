"""The admission book: which worker retains which stream session, and who waits.

Theory of operation
-------------------
Each worker retains up to ``capacity`` sessions. A new session goes to the
least-loaded eligible worker, ordered by ``(retained / capacity, retained,
worker_id)``; eligible means the worker's state is in
:data:`states.worker.ELIGIBLE` (idle or busy) and it has room. With no room
anywhere the session joins a bounded FIFO queue, or is rejected when the queue
is disabled (``queue_size == 0``, reason ``no_capacity``) or full
(``queue_full``).

Whenever room appears — a session is released, a worker becomes ready, a
capacity grows — queued heads are promoted in FIFO order, each onto the
least-loaded eligible worker (not merely the one that freed the slot), while
any eligible worker has room. So the book is work-conserving: a non-empty
queue implies no eligible worker has room.

Queue positions are derived from the queue (1..n) each time they are asked
for, so they never go stale when someone ahead leaves; each is a prefix sum
(:class:`~states.ranked_queue.RankedQueue`), so no per-session call walks the
queue.

A session its worker refused before it ran, as the worker's own state (it
drains or failed), is given back to the queue (:meth:`AdmissionBook.requeue_head`)
in admission order: ahead of every session admitted after it, behind those
given back before it that were admitted before it. So the queue always holds
its sessions in the order they were admitted, and several given back before
any worker has room come out earliest-admitted first (each given back to the
very head, they came out last-given first). The queue's bound is on creates:
at most ``queue_size`` sessions wait that a create queued, and a create is
refused (``queue_full``) while the queue is at or past its size. A session
given back was admitted already and is never dropped for its worker's state,
so those given back may take the queue past ``queue_size``, by at most their
number (``snapshot().queued`` then exceeds it).

While the server ends many queued sessions a batch at a time
(:meth:`AdmissionBook.hold_promotions`), no queued head is promoted and a new
session queues behind the others even if a slot is free; the held promotions
happen at :meth:`AdmissionBook.resume_promotions`. Outside a hold the book is
work-conserving, as above.

A worker's state lives only in its :class:`~states.worker.WorkerMachine` and
changes only through ``apply``; the book decides which event to apply. A
FAILED or DRAINING worker takes no new session but keeps counting the sessions
it retains until each is released (the room runner releases them).

The book is pure: no clock (every mutating method takes ``now``), no lock, no
I/O. Every mutating method returns the transitions it made, in order: a list
of :class:`AdmissionTransition` (a session moved) and :class:`WorkerTransition`
(an event was applied to a worker). Both carry ``kind`` so a consumer can
filter on it. ``admit`` returns ``(Admission, transitions)``.

A method that raises changed nothing.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from . import admission_values
from .admission_values import (
    Admission,
    AdmissionSnapshot,
    AdmissionTransition,
    DuplicateAdmissionSession,
    DuplicateWorker,
    InvalidSetting,
    Transition,
    TransitionKind,
    UnknownAdmissionSession,
    UnknownWorker,
    WorkerTransition,
    WorkerView,
    admitted_ids,
)
from .ranked_queue import RankedQueue
from .worker import ELIGIBLE, PROSPECTIVE, Event as WorkerEvent, State as WorkerState, WorkerMachine

__all__ = ["AdmissionBook", *admission_values.__all__]


# --- the book ---------------------------------------------------------------


@attrs.define(slots=True)
class _Worker:
    capacity: int
    machine: WorkerMachine
    sessions: list[str]  # admission order


def _check_capacity(capacity: object) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise InvalidSetting("capacity", capacity, "must be an integer")
    if capacity < 1:
        raise InvalidSetting("capacity", capacity, "must be at least 1")
    return capacity


def _check_id(field: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidSetting(field, value, "must be a non-empty string")
    return value


class AdmissionBook:
    """Workers, their retained sessions and the bounded FIFO of waiting sessions."""

    __slots__ = ("_queue_size", "_workers", "_queue", "_assigned", "_holds", "_order", "_admissions")

    def __init__(self, queue_size: int = 0) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 0:
            raise InvalidSetting("queue_size", queue_size, "must be an integer >= 0")
        self._queue_size = queue_size
        self._workers: dict[str, _Worker] = {}
        # session id -> queued_at, in FIFO order
        self._queue = RankedQueue()
        # session id -> worker id
        self._assigned: dict[str, str] = {}
        # holds on promotion under way (hold_promotions .. resume_promotions)
        self._holds = 0
        # session id -> the number of its admission, for each session held: the queue keeps this order
        self._order: dict[str, int] = {}
        self._admissions = 0

    # -- copying (the explorer copies worlds) --

    def copy(self) -> AdmissionBook:
        """An independent copy, cheaper than ``copy.deepcopy``."""
        other = AdmissionBook.__new__(AdmissionBook)
        other._queue_size = self._queue_size
        other._workers = {
            wid: _Worker(w.capacity, WorkerMachine(w.machine.state), list(w.sessions))
            for wid, w in self._workers.items()
        }
        other._queue = self._queue.copy()
        other._assigned = dict(self._assigned)
        other._holds = self._holds
        other._order = dict(self._order)
        other._admissions = self._admissions
        return other

    def __deepcopy__(self, memo: dict) -> AdmissionBook:
        return self.copy()

    def canonical_key(self) -> Hashable:
        """Everything that decides future behaviour, without timestamps or list order that does not matter."""
        return (
            self._queue_size,
            tuple(
                (wid, w.machine.state, w.capacity, tuple(sorted(w.sessions)))
                for wid, w in sorted(self._workers.items())
            ),
            tuple(self._queue),
            self._holds,
            tuple(sorted(self._order, key=self._order.__getitem__)),  # who was admitted before whom
        )

    # -- queries --

    @property
    def queue_size(self) -> int:
        return self._queue_size

    def queue_position(self, session_id: str) -> int | None:
        """Current 1-based place in the FIFO, or None when not queued (O(log n): no walk of the queue)."""
        return self._queue.position(session_id)

    def queue_positions(self) -> dict[str, int]:
        """Every queued session's 1-based place, in one pass (a list of n sessions looked each up: n x n steps, 1.5 s
        of the event loop for 10,000 queued)."""
        return {sid: position for position, sid in enumerate(self._queue, start=1)}

    def queued_ids(self) -> tuple[str, ...]:
        """Waiting sessions, head first."""
        return tuple(self._queue)

    def queued_at(self, session_id: str) -> float | None:
        return self._queue.get(session_id)

    def worker_of(self, session_id: str) -> str | None:
        """The worker retaining the session, or None (queued or unknown)."""
        return self._assigned.get(session_id)

    def holds(self, session_id: str) -> bool:
        """Whether the session is queued or assigned."""
        return session_id in self._assigned or session_id in self._queue

    def retained(self, worker_id: str) -> int:
        return len(self._worker(worker_id).sessions)

    def capacity(self, worker_id: str) -> int:
        return self._worker(worker_id).capacity

    def worker_state(self, worker_id: str) -> WorkerState:
        return self._worker(worker_id).machine.state

    def worker(self, worker_id: str) -> WorkerView:
        w = self._worker(worker_id)
        return WorkerView(worker_id, w.machine.state, w.capacity, tuple(w.sessions))

    def workers(self) -> tuple[WorkerView, ...]:
        """Every worker, by id."""
        return tuple(self.worker(wid) for wid in sorted(self._workers))

    def can_place(self) -> bool:
        """Whether any worker takes sessions now or will once it is ready (starting, idle or busy).

        Without one, a new session could only wait for nothing: the server refuses it at once.
        """
        return any(w.machine.state in PROSPECTIVE for w in self._workers.values())

    def would_admit(self, ahead: int = 0) -> bool:
        """Whether :meth:`admit` would assign or queue a session now, with ``ahead`` sessions still to come
        before it (a pure query: nothing changes)."""
        return self._places() > ahead

    def _places(self) -> int:
        """Sessions the book would take now: free slots of eligible workers (none while sessions wait: a new one
        queues behind them), then free places in the queue."""
        free = 0 if self._queue else sum(w.capacity - len(w.sessions) for w in self._workers.values() if self._eligible(w))
        return free + max(0, self._queue_size - len(self._queue))

    def snapshot(self) -> AdmissionSnapshot:
        counts = dict.fromkeys(WorkerState, 0)
        for w in self._workers.values():
            counts[w.machine.state] += 1
        return AdmissionSnapshot(
            workers_total=len(self._workers),
            workers_starting=counts[WorkerState.STARTING],
            workers_idle=counts[WorkerState.IDLE],
            workers_busy=counts[WorkerState.BUSY],
            workers_draining=counts[WorkerState.DRAINING],
            workers_failed=counts[WorkerState.FAILED],
            workers_stopped=counts[WorkerState.STOPPED],
            queued=len(self._queue),
            retained=len(self._assigned),
            free_slots=sum(
                w.capacity - len(w.sessions) for w in self._workers.values() if self._eligible(w)
            ),
        )

    @property
    def promotions_held(self) -> bool:
        """Whether a hold keeps queued heads from being promoted (see :meth:`hold_promotions`)."""
        return self._holds > 0

    # -- holding promotions --

    def hold_promotions(self) -> None:
        """Promote no queued head until :meth:`resume_promotions` (holds nest).

        For a server ending many queued sessions a batch at a time, serving others in between: a head promoted
        between two batches would start instead of ending as it was told. Meanwhile a new session queues
        behind the waiting ones even if a slot is free (first come, first served).
        """
        self._holds += 1

    def resume_promotions(self, now: float) -> list[Transition]:
        """End one hold; with none left, promote the queue's heads onto the room that appeared meanwhile."""
        if self._holds == 0:
            raise InvalidSetting("holds", 0, "no hold on promotions to resume")
        self._holds -= 1
        return self._promote(now)

    # -- workers --

    def add_worker(self, worker_id: str, capacity: int, now: float) -> list[Transition]:
        """Register a worker in STARTING; it takes sessions only after ``worker_ready``."""
        _check_id("worker_id", worker_id)
        _check_capacity(capacity)
        if worker_id in self._workers:
            raise DuplicateWorker(worker_id)
        self._workers[worker_id] = _Worker(capacity, WorkerMachine(), [])
        return []

    def worker_ready(self, worker_id: str, now: float) -> list[Transition]:
        """READY: the worker loaded its pipeline; queued heads may now land on it."""
        out: list[Transition] = [self._apply(worker_id, WorkerEvent.READY, now)]
        out += self._promote(now)
        return out

    def fail_worker(self, worker_id: str, now: float) -> list[Transition]:
        """FAIL: no new sessions; retained ones stay counted until each is released."""
        return [self._apply(worker_id, WorkerEvent.FAIL, now)]

    def drain_worker(self, worker_id: str, now: float) -> list[Transition]:
        """DRAIN: no new sessions; the worker stops (DRAINED) once it retains none."""
        out: list[Transition] = [self._apply(worker_id, WorkerEvent.DRAIN, now)]
        if not self._workers[worker_id].sessions:
            out.append(self._apply(worker_id, WorkerEvent.DRAINED, now))
        return out

    def stop_worker(self, worker_id: str, now: float) -> list[Transition]:
        """STOP: retire a worker that holds nothing (starting or idle)."""
        return [self._apply(worker_id, WorkerEvent.STOP, now)]

    def remove_worker(self, worker_id: str, now: float) -> list[Transition]:
        """Forget a FAILED or STOPPED worker that retains nothing (a lost agent never returns
        under its id: it registers a new one), so the book stays bounded over restarts."""
        w = self._worker(worker_id)
        if not w.machine.is_terminal or w.sessions:
            raise InvalidSetting(
                "worker_id", worker_id, "only a failed or stopped worker that retains nothing can be removed"
            )
        del self._workers[worker_id]
        return []

    def set_capacity(self, worker_id: str, capacity: int, now: float) -> list[Transition]:
        """Change a worker's slot count; never below what it retains now. Growth promotes queued heads."""
        w = self._worker(worker_id)
        _check_capacity(capacity)
        if capacity < len(w.sessions):
            raise InvalidSetting(
                "capacity",
                capacity,
                f"worker {worker_id!r} retains {len(w.sessions)} sessions; cannot shrink below that",
            )
        grew = capacity > w.capacity
        w.capacity = capacity
        return self._promote(now) if grew else []

    # -- sessions --

    def admit(self, session_id: str, now: float, ahead: int = 0) -> tuple[Admission, list[Transition]]:
        """Assign to the least-loaded eligible worker, else queue, else reject.

        ``ahead``: sessions promised a place already that have not come for it yet (a server making their
        rooms); they count as taking places first, so this one is refused when they would fill them.
        Returns the admission answer and the transitions made.
        """
        _check_id("session_id", session_id)
        if session_id in self._assigned:
            raise DuplicateAdmissionSession(session_id, f"assigned to {self._assigned[session_id]!r}")
        if session_id in self._queue:
            raise DuplicateAdmissionSession(session_id, "queued")
        if ahead < 0:
            raise InvalidSetting("ahead", ahead, "must be >= 0")
        has_place = self._places() > ahead  # with no free slot, or sessions waiting, the places are the queue's
        worker_id = self._least_loaded() if has_place and not self._queue else None
        if not has_place:
            reason = "no_capacity" if self._queue_size == 0 else "queue_full"
            rejected = AdmissionTransition(session_id, "rejected", None, None, now)
            return Admission("rejected", session_id, reason=reason), [rejected]
        self._order[session_id] = self._admissions
        self._admissions += 1
        if worker_id is not None:
            assigned = self._assign(session_id, worker_id, "assigned", now, None, None)
            return Admission("assigned", session_id, worker_id=worker_id), assigned
        position = self._queue.append(session_id, now)
        queued = AdmissionTransition(session_id, "queued", None, position, now, now)
        return Admission("queued", session_id, queue_position=position), [queued]

    def release(self, session_id: str, now: float) -> list[Transition]:
        """Drop a queued session, or free an assigned session's slot and promote queued heads."""
        if session_id in self._queue:
            position = self.queue_position(session_id)
            queued_at = self._queue.pop(session_id)
            del self._order[session_id]
            return [AdmissionTransition(session_id, "dequeued", None, position, now, queued_at)]
        worker_id, worker_changes = self._take_off_worker(session_id, now)
        del self._order[session_id]
        return [AdmissionTransition(session_id, "released", worker_id, None, now), *worker_changes, *self._promote(now)]

    def requeue_head(self, session_id: str, now: float) -> list[Transition]:
        """Give an assigned session back to the queue, towards its head: its worker refused it (it drains or failed)
        before it ran. It goes in admission order: ahead of every session admitted after it (all that a create
        queued), behind those given back before it that were admitted before it. Its slot is released (a draining
        worker that retains no more is DRAINED) and the queue's heads are promoted onto the room there is (never
        onto that worker: it is not eligible). It may take the queue past ``queue_size`` (see the module)."""
        worker_id, worker_changes = self._take_off_worker(session_id, now)
        place = 1
        for queued in self._queue:  # the few given back ahead of it: the rest were admitted after it
            if self._order[queued] > self._order[session_id]:
                break
            place += 1
        self._queue.insert(place, session_id, now)
        return [AdmissionTransition(session_id, "requeued", worker_id, place, now, now), *worker_changes,
                *self._promote(now)]

    # -- internals --

    def _take_off_worker(self, session_id: str, now: float) -> tuple[str, list[Transition]]:
        """Free an assigned session's slot: its worker, and the worker's transitions (DRAINED after a draining
        worker's last session)."""
        if session_id not in self._assigned:
            raise UnknownAdmissionSession(session_id)
        worker_id = self._assigned[session_id]
        w = self._workers[worker_id]
        last = len(w.sessions) == 1
        event = WorkerEvent.LAST_SESSION_REMOVED if last else WorkerEvent.SESSION_REMOVED
        # apply first: if the table refused, nothing has changed yet
        changes: list[Transition] = [self._apply(worker_id, event, now)]
        w.sessions.remove(session_id)
        del self._assigned[session_id]
        if last and w.machine.state is WorkerState.DRAINING:
            changes.append(self._apply(worker_id, WorkerEvent.DRAINED, now))
        return worker_id, changes

    def _worker(self, worker_id: str) -> _Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise UnknownWorker(worker_id) from None

    def _apply(self, worker_id: str, event: WorkerEvent, now: float) -> WorkerTransition:
        state = self._worker(worker_id).machine.apply(event)
        return WorkerTransition(worker_id, event, state, now)

    @staticmethod
    def _eligible(w: _Worker) -> bool:
        return w.machine.state in ELIGIBLE and len(w.sessions) < w.capacity

    def _least_loaded(self) -> str | None:
        best: tuple[float, int, str] | None = None
        for wid, w in self._workers.items():
            if not self._eligible(w):
                continue
            key = (len(w.sessions) / w.capacity, len(w.sessions), wid)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def _assign(
        self,
        session_id: str,
        worker_id: str,
        kind: TransitionKind,
        now: float,
        position: int | None,
        queued_at: float | None,
    ) -> list[Transition]:
        worker_change = self._apply(worker_id, WorkerEvent.SESSION_ADDED, now)
        self._workers[worker_id].sessions.append(session_id)
        self._assigned[session_id] = worker_id
        return [
            AdmissionTransition(session_id, kind, worker_id, position, now, queued_at),
            worker_change,
        ]

    def _promote(self, now: float) -> list[Transition]:
        """Move queued heads onto the least-loaded eligible worker while one has room (none while held)."""
        out: list[Transition] = []
        while self._queue and not self._holds:
            worker_id = self._least_loaded()
            if worker_id is None:
                break
            session_id = self._queue.head()
            queued_at = self._queue.pop(session_id)
            out += self._assign(session_id, worker_id, "promoted", now, 1, queued_at)
        return out

    def __repr__(self) -> str:
        workers = ", ".join(
            f"{wid}:{w.machine.state.name}:{len(w.sessions)}/{w.capacity}"
            for wid, w in sorted(self._workers.items())
        )
        return f"<AdmissionBook workers=[{workers}] queue={list(self._queue)}/{self._queue_size}>"
