"""The execution lease, driven in trio: one session's whole chunk at a time per service instance.

Every rule lives in :class:`states.lease_book.LeaseBook` (pure, table-driven,
explored and model-tested): the FIFO, idle parking at chunk boundaries, the
guaranteed chunk after a wait, the driver's idle declaration (an idle holder
steps aside for a waiter), and that a parked session returns to the queue only
on a new control. This module only supplies the clock, waits for a turn, ticks
the book so an idle holder is parked, and reports every transition as a
service event (``lease_queued``, ``lease_granted``, ``lease_parked``) for the
server to publish.

Rotation (active holders taking turns chunk by chunk while others wait) is
off by default: the seed's rule is to hand over only when the holder is idle
(no control for ``idle_timeout``), someone waits, and a chunk has ended. A
pipeline opts in with ``rotate=True`` when it would rather share a busy model
fairly than let one continuously active session keep it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from states.lease import State
from states.lease_book import LeaseBook, LeaseTransition

__all__ = ["ExecutionLease", "LeaseClosed", "EVENT_NAMES"]

EVENT_NAMES = {State.QUEUED: "lease_queued", State.ACTIVE: "lease_granted", State.PARKED: "lease_parked"}
# a session that yielded at its chunk boundary is re-queued: reported as lease_queued


class LeaseClosed(RuntimeError):
    """The session's claim was closed while it waited for its turn."""


class ExecutionLease:
    """Serializes whole chunks across the sessions of one service instance."""

    def __init__(
        self,
        idle_timeout: float,
        *,
        rotate: bool = False,
        on_transition: Callable[[LeaseTransition], None] | None = None,
    ) -> None:
        """``idle_timeout``: seconds without a control after which a holder is idle (the server's
        ``control_idle_timeout``); ``rotate``: active holders take turns chunk by chunk (opt-in)."""
        self._book = LeaseBook(idle_timeout, rotate=rotate)
        self._on_transition = on_transition
        self._changed = trio.lowlevel.ParkingLot()

    @property
    def book(self) -> LeaseBook:
        """Read-only use: holder, queue positions, snapshots."""
        return self._book

    def _apply(self, transitions: list[LeaseTransition]) -> None:
        """Report the book's transitions and wake whoever waits for a turn."""
        if transitions:
            if self._on_transition is not None:
                for transition in transitions:
                    self._on_transition(transition)
            self._changed.unpark_all()

    def register(self, session_id: str) -> None:
        self._apply(self._book.register(session_id, trio.current_time()))

    def record_activity(self, session_id: str) -> None:
        """A valid control arrived for the session (the book decides whether it queues)."""
        self._apply(self._book.record_activity(session_id, trio.current_time()))

    def idle(self, session_id: str) -> None:
        """The session's driver has nothing to run right now (it is about to wait for input).
        Unknown or closing sessions are ignored."""
        if session_id not in self._book or self._book.closing(session_id):
            return
        self._apply(self._book.declare_idle(session_id))

    def is_idle(self, session_id: str) -> bool:
        """Whether the session's driver declared idle and has not asked for a turn since."""
        return session_id in self._book and self._book.is_idle_declared(session_id)

    @asynccontextmanager
    async def chunk(self, session_id: str) -> AsyncIterator[None]:
        """Hold the lease for one whole chunk; waits for the session's turn first.

        A session that is not queued asks for a turn (``request_turn``); a parked one
        with no control since it was parked waits until its controller sends one."""
        if session_id in self._book and not self._book.closing(session_id):
            self._apply(self._book.request_turn(session_id, trio.current_time()))
        while self._book.holder() != session_id:
            if session_id not in self._book or self._book.closing(session_id):
                raise LeaseClosed(f"session {session_id!r} closed while waiting for the lease")
            await self._changed.park()
            if session_id in self._book and not self._book.closing(session_id):
                self._apply(self._book.request_turn(session_id, trio.current_time()))
        self._apply(self._book.begin_chunk(session_id))
        try:
            yield
        except BaseException:
            self._apply(self._book.abort_chunk(session_id))
            self.release_closed(session_id)
            raise
        self._apply(self._book.finish_chunk(session_id, trio.current_time()))
        self.release_closed(session_id)

    def close(self, session_id: str) -> None:
        """End the session's claim; forgotten as soon as its running chunk (if any) ends."""
        if session_id not in self._book:
            return
        if not self._book.closing(session_id):
            self._apply(self._book.close(session_id))
        if not self._book.is_busy(session_id):
            self._book.release(session_id)
        self._changed.unpark_all()

    def release_closed(self, session_id: str) -> None:
        """Forget a closed session once no chunk of it runs."""
        if (
            session_id in self._book
            and self._book.closing(session_id)
            and not self._book.is_busy(session_id)
        ):
            self._book.release(session_id)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick the book often enough that an idle holder hands off within a quarter timeout."""
        task_status.started()
        period = self._book.idle_timeout / 4
        while True:
            await trio.sleep(period)
            self._apply(self._book.tick(trio.current_time()))
