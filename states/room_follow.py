"""Who keeps the count of a session's room from its creation: the runtime (watching or looking into it) or its worker.

Theory of operation
-------------------
A session's room is followed from the session's creation (NEW is only the moment
before). How is the transport's to say, so the first event names it. WATCH, where
the rooms tell the runtime each join and leave (local rooms), makes it WATCHED for
the session's whole life: the runtime keeps the record's participants and its
runners leave them alone, so a HAND_OVER there changes nothing. LOOK_INTO, where the
rooms can only be listed (LiveKit's RoomService), makes it LOOKED_INTO: the runtime
looks into the room, and a look's result (LOOKED) is taken only in this state.
HAND_OVER (the session's worker is in the room and says who is there from now on)
makes it HANDED_OVER: the record's participants are the worker's to keep, and a look
under way then is dropped, as LOOKED is not in HANDED_OVER's row (nor in ENDED's).
LEAVE_TO_WORKER, where the runtime sees no room at all, makes it LEFT_TO_WORKER at
once: the worker keeps the count from when it is in the room, and nothing lists it.
STOP (the session ended; allowed in every state but ENDED) makes it ENDED, the only
terminal state; the record's participants are cleared then only where they were the
runtime's to keep (:data:`RUNTIME_KEEPS`): a session that ended queued had no runner
to clear them.

CHECK is a token request's look into the room, for that request's refusal check (an
identity in the room gets no second token: LiveKit would drop the holder). It is in
the rows of the states where the room can be listed: LOOKED_INTO (its answer is a
look like the poll's, taken into the record) and HANDED_OVER. The worker's word
reaches the record a moment after a participant's join returns (its room events, an
agent's reports paced at one a session every 0.5 s), so a token asked for in that
moment would be granted; a fresh list closes it, adding who it saw to that one check
only: the count stays the worker's (a list's answer has no place in the order of the
worker's joins and leaves, and would put back someone who just left). Not in
WATCHED (the record follows each join as it happens) nor LEFT_TO_WORKER (no list).

:class:`RoomFollowBook` is the pure book over the live sessions' machines: it
answers which rooms are followed, whether a look is due or its result taken, whether
a token's check lists the room, and whether a stop clears the count; the server's
``RoomFollow`` drives it and does the watching, the looking and the clearing.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "STARTS", "RUNTIME_KEEPS", "RoomFollowMachine",
           "RoomFollowBook"]


class State(TableEnum):
    NEW = "new"  # the session is being created; nobody follows its room yet
    WATCHED = "watched"  # the room tells the runtime each join and leave, for the session's whole life
    LOOKED_INTO = "looked_into"  # the runtime lists who is in the room until the session's worker is in it
    HANDED_OVER = "handed_over"  # the session's worker keeps the count; a token's check still lists the room
    LEFT_TO_WORKER = "left_to_worker"  # the runtime sees no room: the worker keeps the count, nothing lists it
    ENDED = "ended"  # the session ended: its room is not followed any more


class Event(TableEnum):
    WATCH = "watch"  # start, where the rooms tell their joins and leaves (local rooms)
    LOOK_INTO = "look_into"  # start, where the rooms can only be listed (LiveKit)
    LEAVE_TO_WORKER = "leave_to_worker"  # start, where the runtime sees no room
    HAND_OVER = "hand_over"  # the session's worker is in the room and says who is there
    LOOKED = "looked"  # a look's result arrived, and is taken
    CHECK = "check"  # a token is asked for: the room is listed for that request's refusal check
    STOP = "stop"  # the session ended


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.WATCH): State.WATCHED,
    (State.NEW, Event.LOOK_INTO): State.LOOKED_INTO,
    (State.NEW, Event.LEAVE_TO_WORKER): State.LEFT_TO_WORKER,
    (State.NEW, Event.STOP): State.ENDED,
    (State.WATCHED, Event.HAND_OVER): State.WATCHED,
    (State.WATCHED, Event.STOP): State.ENDED,
    (State.LOOKED_INTO, Event.LOOKED): State.LOOKED_INTO,
    (State.LOOKED_INTO, Event.CHECK): State.LOOKED_INTO,
    (State.LOOKED_INTO, Event.HAND_OVER): State.HANDED_OVER,
    (State.LOOKED_INTO, Event.STOP): State.ENDED,
    (State.HANDED_OVER, Event.HAND_OVER): State.HANDED_OVER,
    (State.HANDED_OVER, Event.CHECK): State.HANDED_OVER,
    (State.HANDED_OVER, Event.STOP): State.ENDED,
    (State.LEFT_TO_WORKER, Event.HAND_OVER): State.LEFT_TO_WORKER,
    (State.LEFT_TO_WORKER, Event.STOP): State.ENDED,
}

TERMINAL = frozenset({State.ENDED})

#: The events that start following a room (one per transport kind; derived from the table: they leave NEW).
STARTS = frozenset(event for (source, event) in TRANSITIONS if source is State.NEW and event is not Event.STOP)
#: States in which the runtime keeps the record's participants (its room is followed): cleared when it stops.
RUNTIME_KEEPS = frozenset({State.WATCHED, State.LOOKED_INTO})


class RoomFollowMachine(StateMachine[State, Event]):
    NAME = "room follow"
    TABLE = TRANSITIONS
    INITIAL = State.NEW
    TERMINAL = TERMINAL


@attrs.define
class RoomFollowBook:
    """Every live session's room-follow machine, in the order the sessions were created (see the module docs).

    ``start_with`` is the transport's start event (one of :data:`STARTS`). A session the book does not hold (ended,
    or never started) is followed by nobody: a hand-over or a look's result for it changes nothing, and its stop
    clears nothing, so a stop may come twice.
    """

    start_with: Event
    machines: dict[Hashable, RoomFollowMachine] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        if self.start_with not in STARTS:
            raise ValueError(f"start_with must be one of {sorted(e.name for e in STARTS)}, got {self.start_with!r}")

    def state(self, session: Hashable) -> State | None:
        """The session's state, or None where the book does not hold it (ended, or never started)."""
        machine = self.machines.get(session)
        return None if machine is None else machine.state

    def start(self, session: Hashable) -> None:
        """Follow the room of a session just created (a second start of one session raises IllegalTransition)."""
        machine = self.machines.setdefault(session, RoomFollowMachine())
        machine.apply(self.start_with)

    def hand_over(self, session: Hashable) -> None:
        """The session's worker is in its room and says who is there from now on."""
        machine = self.machines.get(session)
        if machine is not None:
            machine.apply(Event.HAND_OVER)

    def looks_into(self, session: Hashable) -> bool:
        """Whether the runtime looks into the session's room now (a look's result would be taken)."""
        machine = self.machines.get(session)
        return machine is not None and machine.can(Event.LOOKED)

    def check(self, session: Hashable) -> bool:
        """A token is asked for: whether the room is listed for that request's refusal check (CHECK in the
        session's row: looked into, or handed over on LiveKit). The list's answer goes into the record only as a
        look's result (:meth:`take_look`)."""
        machine = self.machines.get(session)
        if machine is None or not machine.can(Event.CHECK):
            return False
        machine.apply(Event.CHECK)
        return True

    def take_look(self, session: Hashable) -> bool:
        """A look's result arrived: whether it is taken (False once the session was handed over, or ended)."""
        if not self.looks_into(session):
            return False
        self.machines[session].apply(Event.LOOKED)
        return True

    def stop(self, session: Hashable) -> bool:
        """The session ended: whether its record's participants are cleared (they were the runtime's to keep).
        Idempotent: the ended machine leaves the book."""
        machine = self.machines.pop(session, None)
        if machine is None:
            return False
        kept = machine.state in RUNTIME_KEEPS
        machine.apply(Event.STOP)
        return kept

    def followed(self) -> frozenset[Hashable]:
        """The sessions whose rooms the runtime follows now (watched, or looked into)."""
        return frozenset(session for session, machine in self.machines.items() if machine.state in RUNTIME_KEEPS)

    def looked_into(self) -> list[Hashable]:
        """The sessions whose rooms the runtime looks into now, in the order they were created."""
        return [session for session, machine in self.machines.items() if machine.can(Event.LOOKED)]
