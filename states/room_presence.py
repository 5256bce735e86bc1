"""Who is in a session's room, and which of its two timeouts is running (the controller's, the empty room's).

Theory of operation
-------------------
A room starts AWAITING its controller. While the controller is not there, the
controller timeout runs: from the start of the session for a controller that
never joined (CONTROLLER_ABSENT), from the moment it left for one that left
(CONTROLLER_LEFT; state AWAY). The room-empty timeout runs only once the room
was emptied *after someone had joined* (AWAITING_EMPTY, AWAY_EMPTY): a room
nobody has entered yet is waiting for its controller, not empty. A join cancels
the timer it ends (the controller's return ends both). DEADLINE ends the watch
(ENDED, terminal) with the cause of the timer that passed first.

:class:`RoomPresence` is the pure book over this table: it turns joins and
departures into events, keeps the timers' start times, and answers when the
next deadline is and what it means (``deadline``), and whether one has passed
(``due``). It takes ``now`` as an argument and holds no clock.
"""

from __future__ import annotations


import attrs

from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "Timer", "TRANSITIONS", "TERMINAL", "TIMERS", "RoomPresence", "RoomPresenceMachine"]


class State(TableEnum):
    AWAITING = "awaiting"  # the controller has not joined yet; nobody, or others, are here
    AWAITING_EMPTY = "awaiting_empty"  # the controller never came; everyone who came has left
    PRESENT = "present"  # the controller is here
    AWAY = "away"  # the controller left; others are still here
    AWAY_EMPTY = "away_empty"  # the controller left; nobody is here
    ENDED = "ended"  # a timeout passed


class Event(TableEnum):
    CONTROLLER_JOINED = "controller_joined"
    CONTROLLER_LEFT = "controller_left"  # others remain
    CONTROLLER_LEFT_LAST = "controller_left_last"  # nobody remains
    OTHER_JOINED = "other_joined"  # someone else joined while the controller is not here
    LAST_OTHER_LEFT = "last_other_left"  # the controller is not here and nobody remains
    DEADLINE = "deadline"


class Timer(TableEnum):
    """The timeouts, named by the drain cause they produce."""

    CONTROLLER_ABSENT = "controller_absent"  # never joined within controller_timeout
    CONTROLLER_LEFT = "controller_left"  # left and did not return within controller_timeout
    ROOM_EMPTY = "room_empty"  # everyone left and nobody came back within room_empty_timeout


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.AWAITING, Event.CONTROLLER_JOINED): State.PRESENT,
    (State.AWAITING, Event.OTHER_JOINED): State.AWAITING,
    (State.AWAITING, Event.LAST_OTHER_LEFT): State.AWAITING_EMPTY,
    (State.AWAITING, Event.DEADLINE): State.ENDED,
    (State.AWAITING_EMPTY, Event.CONTROLLER_JOINED): State.PRESENT,
    (State.AWAITING_EMPTY, Event.OTHER_JOINED): State.AWAITING,
    (State.AWAITING_EMPTY, Event.DEADLINE): State.ENDED,
    (State.PRESENT, Event.CONTROLLER_LEFT): State.AWAY,
    (State.PRESENT, Event.CONTROLLER_LEFT_LAST): State.AWAY_EMPTY,
    (State.AWAY, Event.CONTROLLER_JOINED): State.PRESENT,
    (State.AWAY, Event.OTHER_JOINED): State.AWAY,
    (State.AWAY, Event.LAST_OTHER_LEFT): State.AWAY_EMPTY,
    (State.AWAY, Event.DEADLINE): State.ENDED,
    (State.AWAY_EMPTY, Event.CONTROLLER_JOINED): State.PRESENT,
    (State.AWAY_EMPTY, Event.OTHER_JOINED): State.AWAY,
    (State.AWAY_EMPTY, Event.DEADLINE): State.ENDED,
}

TERMINAL = frozenset({State.ENDED})

#: The timers running in each state (PRESENT and ENDED run none).
TIMERS: dict[State, tuple[Timer, ...]] = {
    State.AWAITING: (Timer.CONTROLLER_ABSENT,),
    State.AWAITING_EMPTY: (Timer.CONTROLLER_ABSENT, Timer.ROOM_EMPTY),
    State.PRESENT: (),
    State.AWAY: (Timer.CONTROLLER_LEFT,),
    State.AWAY_EMPTY: (Timer.CONTROLLER_LEFT, Timer.ROOM_EMPTY),
    State.ENDED: (),
}


class RoomPresenceMachine(StateMachine[State, Event]):
    NAME = "room presence"
    TABLE = TRANSITIONS
    INITIAL = State.AWAITING
    TERMINAL = TERMINAL


@attrs.define
class RoomPresence:
    """The presence book of one room (see the module docs); ``participants`` excludes the worker itself."""

    controller: str
    controller_timeout: float
    room_empty_timeout: float
    started_at: float
    machine: RoomPresenceMachine = attrs.Factory(RoomPresenceMachine)
    participants: set[str] = attrs.Factory(set)
    left_at: float | None = None  # when the controller last left
    emptied_at: float | None = None  # when the room last became empty after someone had joined
    ended_by: Timer | None = None

    def __attrs_post_init__(self) -> None:
        for value, name in ((self.controller_timeout, "controller_timeout"), (self.room_empty_timeout, "room_empty_timeout")):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")

    @property
    def state(self) -> State:
        return self.machine.state

    def joined(self, identity: str, now: float) -> None:
        if self.machine.is_terminal or identity in self.participants:
            return
        self.participants.add(identity)
        event = Event.CONTROLLER_JOINED if identity == self.controller else Event.OTHER_JOINED
        if self.machine.can(event):
            self.machine.apply(event)
            self.emptied_at = None

    def left(self, identity: str, now: float) -> None:
        if self.machine.is_terminal or identity not in self.participants:
            return
        self.participants.discard(identity)
        if identity == self.controller:
            event = Event.CONTROLLER_LEFT_LAST if not self.participants else Event.CONTROLLER_LEFT
            self.left_at = now
        elif not self.participants and self.controller not in self.participants:
            event = Event.LAST_OTHER_LEFT
        else:
            return
        if self.machine.can(event):
            self.machine.apply(event)
            if not self.participants:
                self.emptied_at = now

    def deadline(self) -> tuple[float, Timer] | None:
        """The next deadline and the timer it belongs to (the earliest; the controller's first on a tie)."""
        due: list[tuple[float, int, Timer]] = []
        for order, timer in enumerate(TIMERS[self.machine.state]):
            if timer is Timer.CONTROLLER_ABSENT:
                due.append((self.started_at + self.controller_timeout, order, timer))
            elif timer is Timer.CONTROLLER_LEFT and self.left_at is not None:
                due.append((self.left_at + self.controller_timeout, order, timer))
            elif timer is Timer.ROOM_EMPTY and self.emptied_at is not None:
                due.append((self.emptied_at + self.room_empty_timeout, order, timer))
        if not due:
            return None
        at, _, timer = min(due)
        return at, timer

    def due(self, now: float) -> Timer | None:
        """The timer whose deadline has passed at ``now`` (ending the watch), or None."""
        nearest = self.deadline()
        if nearest is None or now < nearest[0]:
            return None
        self.machine.apply(Event.DEADLINE)
        self.ended_by = nearest[1]
        return nearest[1]
