"""The viewer seats of an agent-hosted session on LiveKit, held by the authority from its agent's reports.

LiveKit is the door of a LiveKit room, and it lets a viewer that left back in with its still-valid token whatever the
seats; where the session's worker is the server's own, its runner sends such a viewer away
(:func:`server.viewer_seats.over_seats`). An agent's runner cannot: its transport holds no API key, and its record
has none of the passes of the viewer tokens the authority handed out. So the agent's runner checks no seats
(``RunnerDeps.checks_seats``), and the authority applies the same rule to each joiner its agent reports
(:func:`seat_joiners`), spending the joiner's pass as a join does, and removes one over the seats through its own
RoomService (:class:`ReportedRoom`, bounded like the transport's other RoomService calls), in one line of the log
naming session and identity. The joiners of one report (an agent reports a room at most every 0.5 s) are taken in
the report's order, by name: of two viewers that came within one report for the last seat, the one named later goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..transport import TransportError
from ..viewer_seats import over_seats

if TYPE_CHECKING:
    from ..registry import SessionRecord

__all__ = ["ReportedRoom", "seat_joiners"]


def seat_joiners(record: SessionRecord, reported: tuple[str, ...], *, first: bool) -> list[tuple[str, str]]:
    """Take the agent's report of who is in the session's room onto ``record`` (who left goes, each joiner comes in
    turn), and return each joiner that holds no viewer seat with why. ``first``: the agent's first word on the room
    (the authority only looked into it until then), so everyone there is a joiner, as a runner's first look is. A
    viewer over the seats stays counted until a report says it has left."""
    before = frozenset() if first else frozenset(record.participants)
    record.participants = set(before.intersection(reported))
    over = []
    for identity in dict.fromkeys(reported):
        if identity in record.participants:
            continue
        record.participants.add(identity)
        why = over_seats(record, identity)
        if why is not None:
            over.append((identity, why))
    return over


class ReportedRoom:
    """An agent-hosted session's LiveKit room as the authority can act on it: it removes a participant through the
    authority's RoomService (the shape :func:`server.viewer_seats.send_away_over_seats` takes)."""

    def __init__(self, transport: Any, room: str) -> None:
        self.transport = transport  # the authority's LiveKitTransport (it holds the API key)
        self.room = room

    async def send_away(self, identity: str, reason: str, detail: str) -> None:
        """Remove ``identity`` within the transport's ``disconnect_timeout`` (LiveKit tells it no ``reason``); raises
        TransportError when that cannot be done."""
        remove = getattr(self.transport, "remove_participant", None)
        if remove is None:
            raise TransportError(f"this server's {getattr(self.transport, 'name', '')} transport cannot remove anyone")
        await remove(self.room, identity)
