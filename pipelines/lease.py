"""The execution lease, driven in trio: one session's whole chunk at a time per service instance.

The rules live in :class:`states.lease_book.LeaseBook` (pure, table-driven);
this module only supplies the clock, waits for a turn, ticks the book so an
idle holder is parked, and reports every transition as a service event
(``lease_queued``, ``lease_granted``, ``lease_parked``) for the server to publish.
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
        rotate: bool = True,
        on_transition: Callable[[LeaseTransition], None] | None = None,
    ) -> None:
        """``rotate``: active holders take turns chunk by chunk while others wait
        (the default); False keeps the reference rule (hand over only when idle)."""
        self._book = LeaseBook(idle_timeout, rotate=rotate)
        self._on_transition = on_transition
        self._changed = trio.lowlevel.ParkingLot()

    @property
    def book(self) -> LeaseBook:
        """Read-only use: holder, queue positions, snapshots."""
        return self._book

    def _apply(self, transitions: list[LeaseTransition]) -> None:
        if transitions:
            if self._on_transition is not None:
                for transition in transitions:
                    self._on_transition(transition)
            self._changed.unpark_all()

    def register(self, session_id: str) -> None:
        self._apply(self._book.register(session_id, trio.current_time()))

    def record_activity(self, session_id: str) -> None:
        """A valid control arrived for the session (queues it, may park an idle holder)."""
        self._apply(self._book.record_activity(session_id, trio.current_time()))

    @asynccontextmanager
    async def chunk(self, session_id: str) -> AsyncIterator[None]:
        """Hold the lease for one whole chunk; waits for the session's turn first."""
        while self._book.holder() != session_id:
            if self._book.state(session_id) is State.CLOSING:
                raise LeaseClosed(f"session {session_id!r} closed while waiting for the lease")
            await self._changed.park()
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
        if self._book.state(session_id) is not State.CLOSING:
            self._apply(self._book.close(session_id))
        if not self._book.is_busy(session_id):
            self._book.release(session_id)
        self._changed.unpark_all()

    def release_closed(self, session_id: str) -> None:
        """Forget a closed session once no chunk of it runs."""
        if (
            session_id in self._book
            and self._book.state(session_id) is State.CLOSING
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
