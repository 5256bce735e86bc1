"""Who is in each session's local room, kept on its record from the session's creation to its end.

A queued session's room takes joins (the controller's controls are held for its worker), so its record must
count them before any worker runs it: its ``participant_count``, and the token check that refuses an identity
already in the room, read the record. The local rooms tell one listener a room of each join and leave
(``LocalRooms.watch_participants``; a second listener would replace the first), so that listener has one owner:
the runtime, through this table, for the session's whole life. Runners (in-process or an agent's) subscribe to
nothing and leave the record's participants to it.

On LiveKit the server sees no room: nothing is followed here, and a session counts who its worker reports once
one runs it (a queued session counts nobody).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .cluster.identity import worker_participant

if TYPE_CHECKING:
    from .registry import SessionRecord

__all__ = ["RoomFollow"]


class RoomFollow:
    """The runtime's one subscription to each live session's room (local rooms only)."""

    def __init__(self, transport: Any) -> None:
        self._watch: Callable[[str, Callable[[frozenset[str]], None]], None] | None = getattr(
            transport, "watch_participants", None)
        self._unwatch: Callable[[str], None] | None = getattr(transport, "unwatch_participants", None)
        self.followed: set[str] = set()  # the session ids whose rooms are watched now

    @property
    def active(self) -> bool:
        """Whether rooms are followed here (local rooms): runners then leave the records' participants alone."""
        return self._watch is not None

    def start(self, record: SessionRecord) -> None:
        """Follow the room of a session just admitted or queued, until :meth:`stop`."""
        if self._watch is None:
            return
        self.followed.add(record.session_id)
        self._watch(record.room, lambda present: moved(record, present))

    def stop(self, record: SessionRecord) -> None:
        """The session ended: its room is not followed any more, and it counts nobody (its room's clients are sent
        away with it; a session that ended queued had no runner to clear them). Idempotent."""
        if record.session_id in self.followed and self._unwatch is not None:
            self.followed.discard(record.session_id)
            self._unwatch(record.room)
            record.participants.clear()


def moved(record: SessionRecord, present: frozenset[str]) -> None:
    """The room says who is in it now: the record counts them, its worker left out (an ended session nobody)."""
    if record.is_terminal:
        return
    worker = None if record.worker_id is None else worker_participant(record.worker_id)
    record.participants = set(present - {worker})
