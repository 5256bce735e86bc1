"""What a room-presence timeout means for its session: the drain cause it ends with, and the reason in words.

The timers and when each runs are the table's (:mod:`states.room_presence`); the room runner drains its session
with the cause of the timer that passed (:mod:`server.runner`).
"""

from __future__ import annotations

from states.room_presence import Timer
from states.stream_session import DrainCause

__all__ = ["TIMEOUT_CAUSES", "timeout_detail"]

#: What each presence timeout means for the session.
TIMEOUT_CAUSES: dict[Timer, DrainCause] = {
    Timer.CONTROLLER_ABSENT: DrainCause.CONTROLLER_ABSENT,
    Timer.CONTROLLER_LEFT: DrainCause.CONTROLLER_LEFT,
    Timer.ROOM_EMPTY: DrainCause.ROOM_EMPTY,
}


def timeout_detail(timer: Timer, controller: str, controller_timeout: float, room_empty_timeout: float) -> str:
    """The record's and the room's reason for ``timer``'s end, naming the controller where it is the cause."""
    if timer is Timer.CONTROLLER_ABSENT:
        return f"the controller {controller!r} did not join within {controller_timeout:g} s"
    if timer is Timer.CONTROLLER_LEFT:
        return f"the controller {controller!r} left and did not return within {controller_timeout:g} s"
    return f"the room was empty for {room_empty_timeout:g} s"
