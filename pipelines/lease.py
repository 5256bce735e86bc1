"""The execution lease, driven in trio: one session's whole chunk at a time per service instance.

The rules live in :class:`states.lease_book.LeaseBook` (pure, table-driven);
this module only supplies the clock, waits for a turn, ticks the book so an
idle holder is parked, and reports every transition as a service event
(``lease_queued``, ``lease_granted``, ``lease_parked``) for the server to publish.

A session's driver says when it has nothing to run (``idle``: it is about to
wait for input). While it stays idle it never keeps the lease from a waiter:
as soon as it holds the lease between chunks and someone is queued -- it
declared idle as the holder, a waiter queued later, or the book granted it the
lease after a yield re-queued it -- the driver relinquishes for it (book
``relinquish``), instead of leaving everyone to wait for ``idle_timeout``.
With nobody waiting an idle holder keeps the lease (handing it to nobody would
only publish a park and a re-grant). ``chunk`` clears the mark.
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
        self._idle: set[str] = set()  # drivers that said they have nothing to run

    @property
    def book(self) -> LeaseBook:
        """Read-only use: holder, queue positions, snapshots."""
        return self._book

    def _apply(self, transitions: list[LeaseTransition]) -> None:
        """Report the transitions; then, while the holder is a session marked
        idle, between chunks, and someone waits, relinquish for it (and report
        that too). Every change of the FIFO comes through here."""
        while True:
            if transitions:
                if self._on_transition is not None:
                    for transition in transitions:
                        self._on_transition(transition)
                self._changed.unpark_all()
            holder = self._book.holder()
            if (
                holder is None
                or holder not in self._idle
                or self._book.is_busy(holder)
                or not self._book.queued()
            ):
                return
            # terminates: each round parks one session, and a parked one is
            # granted again only after activity, which this loop never makes
            transitions = self._book.relinquish(holder, trio.current_time())

    def register(self, session_id: str) -> None:
        self._apply(self._book.register(session_id, trio.current_time()))

    def record_activity(self, session_id: str) -> None:
        """A valid control arrived for the session (queues it, may park an idle holder).

        A session whose driver declared idle and is not queued (parked, or
        never asked) is not queued by a control: its driver queues it when it
        enters ``chunk``, if the control gave it something to run. Queuing it
        here would only grant it the lease and relinquish it again at once.
        """
        if session_id in self._idle and self._book.state(session_id) in (State.WAITING, State.PARKED):
            return
        self._apply(self._book.record_activity(session_id, trio.current_time()))

    def idle(self, session_id: str) -> None:
        """The session's driver has nothing to run right now (it is about to wait
        for input). Until the driver next enters ``chunk``, whenever the session
        holds the lease between chunks while someone waits it relinquishes it
        at once (now, when a waiter queues, at the end of a running chunk, or
        right after a grant). Unknown or closing sessions are ignored."""
        if session_id not in self._book or self._book.state(session_id) is State.CLOSING:
            return
        self._idle.add(session_id)
        self._apply([])

    def is_idle(self, session_id: str) -> bool:
        """Whether the session's driver declared idle and has not entered ``chunk`` since."""
        return session_id in self._idle

    @asynccontextmanager
    async def chunk(self, session_id: str) -> AsyncIterator[None]:
        """Hold the lease for one whole chunk; waits for the session's turn first.

        Entering clears the session's idle mark; a session that is not queued
        (never asked, or parked / relinquished) asks again (``record_activity``)
        rather than waiting for a turn that would never come."""
        self._idle.discard(session_id)
        while self._book.holder() != session_id:
            if session_id not in self._book or self._book.state(session_id) is State.CLOSING:
                raise LeaseClosed(f"session {session_id!r} closed while waiting for the lease")
            if self._book.state(session_id) in (State.WAITING, State.PARKED):
                self.record_activity(session_id)
                continue
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
        self._idle.discard(session_id)
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
