"""Who is in a session's room, and which of its two timeouts is running (the controller's, the empty room's).

Theory of operation
-------------------
A room starts AWAITING its controller. Until the controller has come, its
deadline alone governs the session: the controller timeout runs from the start
(CONTROLLER_ABSENT), whoever else comes and goes (AWAITING, AWAITING_EMPTY), so
the session ends at that deadline as ``controller_absent``. (A viewer that
joined and left before the controller came used to start the room-empty
timeout, which with the defaults, 60 s and 30 s, passed first: anyone with a
viewer token could end a session before its controller came, as a normal end.)

Once the controller has come and is away, its timeout runs from the moment it
left (CONTROLLER_LEFT; AWAY, AWAY_EMPTY), and while nobody at all is left the
room-empty timeout runs too (AWAY_EMPTY), from the moment the room emptied.
DEADLINE ends the watch (ENDED, terminal) with the cause of the timer that
passed first, the controller's on a tie: a room the controller left last and
nobody entered again ends as ``room_empty`` after ``room_empty_timeout`` (its
normal end), one whose controller stays away while others are still here as
``controller_left``. Others can only put the end off: the room empties no
earlier than the controller left, so no viewer's join or departure brings the
end before the controller's own (``explore_room_presence`` checks it). The
controller's return ends both timers.

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
    AWAITING_EMPTY = "awaiting_empty"  # the controller never came; everyone who came has left (still awaiting it)
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
    ROOM_EMPTY = "room_empty"  # the controller had come; everyone left and nobody came back within room_empty_timeout


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

#: The timers running in each state (PRESENT and ENDED run none). Until the controller has come only its own
#: deadline runs, whatever others do; the empty room's runs only once the controller has come and left.
TIMERS: dict[State, tuple[Timer, ...]] = {
    State.AWAITING: (Timer.CONTROLLER_ABSENT,),
    State.AWAITING_EMPTY: (Timer.CONTROLLER_ABSENT,),
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
    emptied_at: float | None = None  # when the room last became empty (its timer runs only where TIMERS says)
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
