"""Lifecycle of one model worker in the stream server (one loaded service).

Theory of operation
-------------------
A worker is STARTING while it loads its pipeline; READY makes it IDLE and
eligible for admission. The admission book moves it between IDLE and BUSY as
retained sessions arrive and leave (SESSION_ADDED; SESSION_REMOVED while others
remain; LAST_SESSION_REMOVED when none does). DRAIN stops new admissions while
retained sessions finish; DRAINED (nothing retained) stops it. FAIL can strike
in any live state; a FAILED worker takes no sessions, but the sessions it still
retains are released through it one by one, so removal events keep it FAILED.
STOP retires a worker that holds nothing. FAILED and STOPPED never take work
again.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = [
    "State", "Event", "TRANSITIONS", "TERMINAL", "ELIGIBLE", "PROSPECTIVE", "DRAINABLE", "LOADING", "REFUSES_STARTS",
    "WorkerMachine",
]


class State(TableEnum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


class Event(TableEnum):
    READY = "ready"
    SESSION_ADDED = "session_added"
    SESSION_REMOVED = "session_removed"
    LAST_SESSION_REMOVED = "last_session_removed"
    DRAIN = "drain"
    DRAINED = "drained"
    FAIL = "fail"
    STOP = "stop"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.STARTING, Event.READY): State.IDLE,
    (State.IDLE, Event.SESSION_ADDED): State.BUSY,
    (State.BUSY, Event.SESSION_ADDED): State.BUSY,
    (State.BUSY, Event.SESSION_REMOVED): State.BUSY,
    (State.BUSY, Event.LAST_SESSION_REMOVED): State.IDLE,
    (State.IDLE, Event.DRAIN): State.DRAINING,
    (State.BUSY, Event.DRAIN): State.DRAINING,
    (State.DRAINING, Event.SESSION_REMOVED): State.DRAINING,
    (State.DRAINING, Event.LAST_SESSION_REMOVED): State.DRAINING,
    (State.DRAINING, Event.DRAINED): State.STOPPED,
    (State.STARTING, Event.FAIL): State.FAILED,
    (State.IDLE, Event.FAIL): State.FAILED,
    (State.BUSY, Event.FAIL): State.FAILED,
    (State.DRAINING, Event.FAIL): State.FAILED,
    (State.FAILED, Event.SESSION_REMOVED): State.FAILED,
    (State.FAILED, Event.LAST_SESSION_REMOVED): State.FAILED,
    (State.STARTING, Event.STOP): State.STOPPED,
    (State.IDLE, Event.STOP): State.STOPPED,
}

TERMINAL = frozenset({State.FAILED, State.STOPPED})

# Workers that may take a new retained session (if they have room).
ELIGIBLE = frozenset({State.IDLE, State.BUSY})
# Workers a new session may wait for: eligible now, or once loaded.
PROSPECTIVE = ELIGIBLE | {State.STARTING}

# Workers a drain takes out of admission (read from the table, never retyped).
DRAINABLE = frozenset(state for (state, event) in TRANSITIONS if event is Event.DRAIN)
# Workers whose refusal of a session, before it ran, is their own state's (they drain or failed): the session goes
# back to the queue for another worker.
REFUSES_STARTS = frozenset({State.DRAINING, State.FAILED})
# Workers still loading their pipeline: a drain must wait until they are ready.
LOADING = frozenset(state for (state, event) in TRANSITIONS if event is Event.READY)


class WorkerMachine(StateMachine[State, Event]):
    NAME = "worker"
    TABLE = TRANSITIONS
    INITIAL = State.STARTING
    TERMINAL = TERMINAL
