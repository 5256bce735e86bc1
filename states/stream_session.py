"""Lifecycle of one HTTP stream session (one room, one controller).

Theory of operation
-------------------
A session is born PENDING when ``POST /v1/stream/sessions`` arrives and leaves
that state at once through the admission book: ASSIGN (a retained slot on a
worker), QUEUE (a place in the bounded FIFO) or REJECT (no slot and no room in
the queue; the record exists only long enough to answer 429).

An assigned session belongs to exactly one room runner, which reports its
progress with JOIN_ROOM -> START_PIPELINE -> RUN. Whatever ends a live session
first moves it to DRAINING with DRAIN, and the DRAIN carries its
:class:`DrainCause` (DELETE, the controller's ``stop``, the session timeout, a
controller that never joined or left for good, an empty room, the pipeline
finishing, shutdown, or the session failing on its own: its pipeline, its
room or its worker). DRAIN happens once, so the cause is set once: the first
cause wins, and a later one (a timeout just after a DELETE) changes nothing. The
runner stops taking controls, closes the pipeline session through its owner and
disconnects; then the record settles with the event :func:`settle_event` names
for its cause: EXPIRE for the session timeout, FAIL for the controller's
causes (the session did not get the controller it was for), COMPLETE for the
rest -- or FAIL whatever the cause when the drain itself failed. An error before
any drain drains with the cause of that failure first, so that a failed session
says why it ended (it said nothing: a null cause); FAIL straight from a live
state stays in the table for a record that settles without one.

An assigned session its worker refused before it ran, because of the worker's
own state (the worker drains or failed, and said so first), is REQUEUEd: back
to QUEUED at the head of the queue, for the next free worker.

A queued session holds nothing: WITHDRAW (deleted while waiting) closes it and
EXPIRE expires it without a drain.

CLOSED, FAILED, EXPIRED and REJECTED are terminal: no event leaves them. A
terminal record is kept for a bounded time so clients can read the outcome.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = [
    "State", "Event", "DrainCause", "TRANSITIONS", "TERMINAL", "RUNNER_PROGRESS", "RETAINING", "LIVE_MEDIA", "TAKES_VIEWERS", "SETTLES_WITH", "QUEUED_ENDS_WITH",
    "FAILING_CAUSES", "REQUEUABLE", "STARTING", "DRAINED", "IN_QUEUE",
    "StreamSessionMachine", "settle_event",
]


class State(TableEnum):
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


class Event(TableEnum):
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
    REQUEUE = "requeue"


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
    # Its worker refused it before it ran, as the worker's own state (it drains or failed): back to the queue's head.
    (State.ASSIGNED, Event.REQUEUE): State.QUEUED,
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

#: The events a room runner reports as plain progress (``SessionLifecycle.step``, an agent's session events). A drain
#: comes with its cause and the end with its outcome, each through its own call: never as bare progress, which
#: would drain a record with no cause or settle it with no outcome.
RUNNER_PROGRESS = frozenset({Event.JOIN_ROOM, Event.START_PIPELINE, Event.RUN})

#: The states a session may be given back to the queue from (its worker refused it before it ran; read from the table).
REQUEUABLE = frozenset(state for (state, event) in TRANSITIONS if event is Event.REQUEUE)

#: The state of a session waiting in the queue for a worker: it holds nothing, so it ends by leaving the queue
#: (withdrawn, expired, or ended with the queue), never by a drain.
IN_QUEUE = frozenset({State.QUEUED})

# States in which the session holds a retained slot on a worker.
RETAINING = frozenset(
    {State.ASSIGNED, State.JOINING_ROOM, State.STARTING_PIPELINE, State.RUNNING, State.DRAINING}
)


#: States of a session placed on a worker that has not started running it yet: those its room runner's progress
#: moves on from (read from the table). A worker agent that leaves a session here past the authority's start deadline
#: (``server.cluster.session_deadlines.start_deadline``) fails it: it held its slot for ever.
STARTING = frozenset(state for (state, event) in TRANSITIONS if event in RUNNER_PROGRESS)

# States in which the worker is in the room with its media (the seed's "transport connected").
LIVE_MEDIA = frozenset({State.STARTING_PIPELINE, State.RUNNING, State.DRAINING})


def _leads_to(goal: State) -> frozenset[State]:
    """``goal`` and every state with a path to it in the table."""
    reached = {goal}
    while True:
        more = {state for (state, _), after in TRANSITIONS.items() if after in reached} - reached
        if not more:
            return frozenset(reached)
        reached |= more


#: States a viewer token is handed out in: those the session may still run in (read from the table). A draining
#: session is ending: a viewer it let in would see its last frames, if any, and then the room close.
TAKES_VIEWERS = _leads_to(State.RUNNING)


class DrainCause(TableEnum):
    """Why a session ends: recorded once, with a live session's DRAIN or with a queued session's end."""

    DELETED = "deleted"  # DELETE /v1/stream/sessions/{id}
    STOP = "stop"  # the controller's stop message
    EXPIRED = "expired"  # session_timeout
    CONTROLLER_ABSENT = "controller_absent"  # the controller never joined within controller_timeout
    CONTROLLER_LEFT = "controller_left"  # the controller left and did not return within controller_timeout
    ROOM_EMPTY = "room_empty"  # the controller came, everyone left and nobody returned within room_empty_timeout
    COMPLETED = "completed"  # the pipeline's stream ended
    SHUTDOWN = "shutdown"  # the server is shutting down
    WORKER_FAILED = "worker_failed"  # the model worker hosting it failed
    PIPELINE_STALLED = "pipeline_stalled"  # a control not taken, or a server-push stream's chunk not given, within its deadline
    WORKER_DRAIN = "worker_drain"  # its worker drains (POST /v1/service/workers/{id}/drain, SIGTERM to an agent)
    PIPELINE_FAILED = "pipeline_failed"  # the pipeline raised, broke its contract or did not create the session in time
    TRANSPORT_FAILED = "transport_failed"  # the worker could not join its room, or lost it
    START_FAILED = "start_failed"  # the worker could not start the session (its agent refused it, its image was not sent)


#: The event that settles a drain that itself went well, by its cause.
SETTLES_WITH: dict[DrainCause, Event] = {
    DrainCause.DELETED: Event.COMPLETE,
    DrainCause.STOP: Event.COMPLETE,
    DrainCause.EXPIRED: Event.EXPIRE,
    DrainCause.CONTROLLER_ABSENT: Event.FAIL,
    DrainCause.CONTROLLER_LEFT: Event.FAIL,
    DrainCause.ROOM_EMPTY: Event.COMPLETE,
    DrainCause.COMPLETED: Event.COMPLETE,
    DrainCause.SHUTDOWN: Event.COMPLETE,
    DrainCause.WORKER_FAILED: Event.FAIL,
    DrainCause.PIPELINE_STALLED: Event.FAIL,
    DrainCause.WORKER_DRAIN: Event.COMPLETE,
    DrainCause.PIPELINE_FAILED: Event.FAIL,
    DrainCause.TRANSPORT_FAILED: Event.FAIL,
    DrainCause.START_FAILED: Event.FAIL,
}


#: The event that ends a queued session, by why it ends. A queued session holds no worker, so it never drains; one
#: the server will never run (it shuts down, no worker can take it, or the last worker that could was drained) fails
#: with the reason, as it never ran.
QUEUED_ENDS_WITH: dict[DrainCause, Event] = {
    DrainCause.DELETED: Event.WITHDRAW,
    DrainCause.EXPIRED: Event.EXPIRE,
    DrainCause.SHUTDOWN: Event.FAIL,
    DrainCause.WORKER_FAILED: Event.FAIL,
    DrainCause.WORKER_DRAIN: Event.FAIL,
}


#: Causes whose drain fails the session (derived from SETTLES_WITH).
FAILING_CAUSES = frozenset(cause for cause, event in SETTLES_WITH.items() if event is Event.FAIL)

#: The states a drain that went well settles in (read from the table): a session that ended in one was drained; one
#: that failed meanwhile (its worker lost during the drain) was not, whatever its drain cause.
DRAINED = frozenset(TRANSITIONS[(State.DRAINING, event)] for event in SETTLES_WITH.values() if event is not Event.FAIL)


def settle_event(cause: DrainCause | None, *, failed: bool) -> Event:
    """The event that ends a drain: FAIL when it failed, else what its cause settles with."""
    if failed:
        return Event.FAIL
    return SETTLES_WITH[cause] if cause is not None else Event.COMPLETE


class StreamSessionMachine(StateMachine[State, Event]):
    NAME = "stream session"
    TABLE = TRANSITIONS
    INITIAL = State.PENDING
    TERMINAL = TERMINAL
