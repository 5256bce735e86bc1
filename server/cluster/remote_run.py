"""The authority's handle on one session an agent runs: where a :class:`~server.runner.RoomRunner` stands in the runtime.

The runtime asks a :class:`RemoteRun` to drain, abort, fail or settle its session, and it moves the authoritative
record through the runtime's lifecycle and forwards the stop to its agent (:class:`~server.cluster.remote.RemoteWorker`);
it holds the session to its start deadline, and follows who is in its room from the agent's word where the rooms are
not the authority's own (LiveKit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from states.stream_session import STARTING, DrainCause

from ..reasons import echo
from ..viewer_seats import send_away_over_seats
from .seat_reports import ReportedRoom, seat_joiners

if TYPE_CHECKING:
    from ..registry import SessionRecord
    from ..runtime import StreamRuntime
    from .remote import RemoteWorker

__all__ = ["RemoteRun"]

log = logging.getLogger("chunkline.cluster")


class RemoteRun:
    """A session running on an agent, as the runtime sees it (the shape of a RoomRunner)."""

    def __init__(self, runtime: StreamRuntime, record: SessionRecord, worker: RemoteWorker) -> None:
        self.runtime = runtime
        self.record = record
        self.worker = worker
        self.finished = trio.Event()
        self.seq = 0
        #: whether the agent's runner told the room how the session ended (its finish says so); a lost agent's
        #: never did, and the authority tells the room itself
        self.told_room = False
        self.media_reported = False  # the agent's progress took the session into LIVE_MEDIA (it joined its room)
        self._room_seen = False  # the agent said who is in the room (before, the runtime looked into it)
        self._started = trio.Event()  # it left its starting states (runs, drains or ended): the start's wait ends

    def moved(self) -> None:
        """The session's record may have moved (the agent's progress or drain, the authority's drain or end): once
        it has left its starting states, nothing waits on its start any more."""
        if self.finished.is_set() or self.record.status not in STARTING:
            self._started.set()

    @property
    def in_room_with_media(self) -> bool:
        """Whether the agent's worker is in the session's room with media, as far as the authority can tell: the
        agent said so (its runner started the pipeline, after joining) and, where the rooms are this server's own
        (local rooms), its identity is in the room. An agent that never joined (a mute one, one that only says it
        did) is not counted; on LiveKit the agent's word is all there is."""
        if not self.media_reported or self.finished.is_set():
            return False
        present = self._in_room()
        return present is None or self.worker.identity in present

    def _in_room(self) -> set[str] | None:
        """Who is in the session's room where the rooms are the authority's own (local rooms); None where they are
        not (LiveKit: the agent reports them)."""
        present = getattr(self.runtime.transport, "participants", None)
        return None if present is None else set(present(self.record.room))

    def take_participants(self, reported: tuple[str, ...]) -> None:
        """The agent's word on who is in the room, from its worker in the room (LiveKit: the runtime stops looking
        into the room itself, and sends away a joiner over the seats); where the rooms are the authority's own, it
        follows them (their door holds the seats) and the word is not taken."""
        if not self.runtime.room_follow.active and not self.finished.is_set():
            self.runtime.room_follow.handed_over(self.record)
            record, first, self._room_seen = self.record, not self._room_seen, True
            for identity, why in seat_joiners(record, reported, first=first):
                room = ReportedRoom(self.runtime.transport, record.room)
                self.runtime.spawn(send_away_over_seats, room, record.session_id, identity, why)

    def drain(self, cause: DrainCause, detail: str | None = None) -> None:
        """The authority's record drains with its cause (the first one wins); the agent stops at a chunk boundary."""
        self.runtime.lifecycle.drain(self.record, cause, detail)
        self.worker.send_stop(self.record.session_id, cause)
        self.moved()

    def abort(self, cause: DrainCause = DrainCause.SHUTDOWN) -> None:
        """Stop at once; a lost worker's sessions are settled here, failed with the cause."""
        if self.worker.lost_cause is not None:
            self.settle(f"worker lost: {self.worker.lost_cause}")
            return
        self.runtime.lifecycle.drain(self.record, cause)
        self.worker.send_stop(self.record.session_id, cause, now=True)
        self.moved()

    def fail(self, reason: str, cause: DrainCause = DrainCause.WORKER_FAILED) -> None:
        """The worker under the session is gone: settle it failed, naming the loss when there is one."""
        self.runtime.lifecycle.drain(self.record, cause, self.worker.failure or reason)
        if self.worker.lost_cause is None:
            self.worker.send_stop(self.record.session_id, cause, now=True)
        self.settle(self.worker.failure or reason)

    def give_back(self) -> None:
        """The agent refused the session as its own state before it ran: the session is queued again, for another
        worker (:meth:`StreamRuntime.requeue`); this run is over without settling it."""
        if self.finished.is_set():
            return
        self.worker.run_ended(self.record.session_id)
        forget = getattr(self.runtime.transport, "forget_worker", None)
        if forget is not None:
            forget(self.record.room)
        self.runtime.requeue(self)
        self.finished.set()
        self.moved()

    async def hold_to_start(self, within: float) -> None:
        """The agent has ``within`` seconds (:func:`~server.cluster.session_deadlines.start_deadline`) to take the
        session out of its starting states: it runs, drains or ends. Past that it fails, naming the worker and the
        deadline; the agent is told to stop it and still owes its finish (by the stop's deadline, or it is lost), and
        the slot goes to the next session. Left to the agent, a session it never spoke of again held its slot for
        ever. The wait ends as the session leaves its starting states (:meth:`moved`): it slept the whole deadline,
        140 s, after every session had started."""
        with trio.move_on_after(within):
            await self._started.wait()
            return
        if self.record.status not in STARTING:
            return
        reason = f"worker {echo(self.worker.worker_id)} did not start the session within {within:g} s"
        log.warning("session %s: %s; it fails, and the worker is told to stop it", self.record.session_id, reason)
        self.runtime.lifecycle.drain(self.record, DrainCause.START_FAILED, reason)
        self.worker.send_stop(self.record.session_id, DrainCause.START_FAILED, now=True)
        self.settle(reason, DrainCause.START_FAILED, stop_owed=True)

    def settle(self, error: str | None, cause: DrainCause = DrainCause.WORKER_FAILED, *,
               stop_owed: bool = False) -> None:
        """The session ended; failed with ``error``, it drains first with ``cause`` unless a cause came before
        (an agent's, the authority's), so that its record says why it failed. An agent of this version names the
        cause of every failure it reports: one that does not is taken as its worker's failure. ``stop_owed``: the
        agent has not answered the stop it was sent, and still owes it (:meth:`RemoteWorker.run_ended`)."""
        if self.finished.is_set():
            return
        if error is not None:
            self.runtime.lifecycle.drain(self.record, cause, error)
        self.worker.run_ended(self.record.session_id, stop_owed=stop_owed)
        self.record.participants.clear()  # the worker left, and the room's clients are sent away with the session
        forget = getattr(self.runtime.transport, "forget_worker", None)
        if forget is not None:
            forget(self.record.room)
        self.runtime.session_finished(self, error)  # type: ignore[arg-type]
        self.finished.set()
        self.moved()
