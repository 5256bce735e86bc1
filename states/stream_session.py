"""Lifecycle of one HTTP stream session (one room, one controller).

Theory of operation
-------------------
A session is born PENDING when ``POST /v1/stream/sessions`` arrives and leaves
that state at once through the admission book: ASSIGN (a retained slot on a
worker), QUEUE (a place in the bounded FIFO) or REJECT (no slot and no room in
the queue; the record exists only long enough to answer 429).

An assigned session belongs to exactly one room runner, which reports its
progress with JOIN_ROOM -> START_PIPELINE -> RUN. Whatever ends a live session
(DELETE, the controller's ``stop``, the controller leaving, the pipeline
finishing, the session timeout) first moves it to DRAINING with DRAIN: the
runner stops taking controls, closes the pipeline session through its owner
and disconnects. When that finishes the runner settles the record with the
outcome: COMPLETE (closed), FAIL (failed) or EXPIRE (expired, when the drain
was caused by ``session_timeout``). An error before the drain fails the session
directly.

A queued session holds nothing: WITHDRAW (deleted while waiting) closes it and
EXPIRE expires it without a drain.

CLOSED, FAILED, EXPIRED and REJECTED are terminal: no event leaves them. A
terminal record is kept for a bounded time so clients can read the outcome.
"""

from __future__ import annotations

import enum

from .machine import StateMachine

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "StreamSessionMachine"]


class State(enum.Enum):
    PENDING = "pending"
    QUEUED = "queued"
    ASSIGNED = "assigned"
    JOINING_ROOM = "joining_room"
    STARTING_PIPELINE = "starting_pipeline"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"
    FAILED = "failed"
    EXPIRED = "expired"
    REJECTED = "rejected"


class Event(enum.Enum):
    ASSIGN = "assign"
    QUEUE = "queue"
    REJECT = "reject"
    JOIN_ROOM = "join_room"
    START_PIPELINE = "start_pipeline"
    RUN = "run"
    DRAIN = "drain"
    WITHDRAW = "withdraw"
    COMPLETE = "complete"
    FAIL = "fail"
    EXPIRE = "expire"


TRANSITIONS: dict[tuple[State, Event], State] = {
    # Admission decides the first move.
    (State.PENDING, Event.ASSIGN): State.ASSIGNED,
    (State.PENDING, Event.QUEUE): State.QUEUED,
    (State.PENDING, Event.REJECT): State.REJECTED,
    # Waiting in the FIFO: promoted when a slot frees, or leaves holding nothing.
    (State.QUEUED, Event.ASSIGN): State.ASSIGNED,
    (State.QUEUED, Event.WITHDRAW): State.CLOSED,
    (State.QUEUED, Event.EXPIRE): State.EXPIRED,
    (State.QUEUED, Event.FAIL): State.FAILED,  # no worker will ever run it (every slot gave up)
    # The room runner reports its progress.
    (State.ASSIGNED, Event.JOIN_ROOM): State.JOINING_ROOM,
    (State.JOINING_ROOM, Event.START_PIPELINE): State.STARTING_PIPELINE,
    (State.STARTING_PIPELINE, Event.RUN): State.RUNNING,
    # Any end of a live session drains first ...
    (State.ASSIGNED, Event.DRAIN): State.DRAINING,
    (State.JOINING_ROOM, Event.DRAIN): State.DRAINING,
    (State.STARTING_PIPELINE, Event.DRAIN): State.DRAINING,
    (State.RUNNING, Event.DRAIN): State.DRAINING,
    # ... unless an error ends it on the spot.
    (State.ASSIGNED, Event.FAIL): State.FAILED,
    (State.JOINING_ROOM, Event.FAIL): State.FAILED,
    (State.STARTING_PIPELINE, Event.FAIL): State.FAILED,
    (State.RUNNING, Event.FAIL): State.FAILED,
    # The drain settles with its outcome.
    (State.DRAINING, Event.COMPLETE): State.CLOSED,
    (State.DRAINING, Event.FAIL): State.FAILED,
    (State.DRAINING, Event.EXPIRE): State.EXPIRED,
}

TERMINAL = frozenset({State.CLOSED, State.FAILED, State.EXPIRED, State.REJECTED})

# States in which the session holds a retained slot on a worker.
RETAINING = frozenset(
    {State.ASSIGNED, State.JOINING_ROOM, State.STARTING_PIPELINE, State.RUNNING, State.DRAINING}
)


class StreamSessionMachine(StateMachine[State, Event]):
    NAME = "stream session"
    TABLE = TRANSITIONS
    INITIAL = State.PENDING
    TERMINAL = TERMINAL
