"""Lifecycle of one worker process group (``engine.workers.ProcessWorkerGroup``).

Theory of operation
-------------------
A group is NEW until START spawns its ranks (STARTING). READY (every rank said
hello) makes it RUNNING, the only state that takes calls. START_FAILED (a rank
could not load, exited or was late) closes it at once: every rank is killed
and reaped before ``start`` raises. FAIL (a rank died, a call timed out, the
monitor crashed) makes a RUNNING group FAILED: every pending and later call
fails with the recorded reason. CLOSE (from NEW, RUNNING or FAILED) begins the
bounded shutdown, CLOSING, in which a rank's exit is expected (it was asked to
stop), so no FAIL comes; CLOSED ends it once every rank is reaped and every
pipe closed. A NEW group closes at once. CLOSED takes nothing again.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "TAKES_CALLS", "ProcessGroupMachine", "on_rank_exit"]


class State(TableEnum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    CLOSING = "closing"
    CLOSED = "closed"


class Event(TableEnum):
    START = "start"
    READY = "ready"
    START_FAILED = "start_failed"
    FAIL = "fail"
    CLOSE = "close"
    CLOSED = "closed"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.START): State.STARTING,
    (State.NEW, Event.CLOSE): State.CLOSED,
    (State.STARTING, Event.READY): State.RUNNING,
    (State.STARTING, Event.START_FAILED): State.CLOSED,
    (State.RUNNING, Event.FAIL): State.FAILED,
    (State.RUNNING, Event.CLOSE): State.CLOSING,
    (State.FAILED, Event.CLOSE): State.CLOSING,
    (State.CLOSING, Event.CLOSED): State.CLOSED,
}

TERMINAL = frozenset({State.CLOSED})

#: The only state in which a call is sent to the ranks.
TAKES_CALLS = frozenset({State.RUNNING})


def on_rank_exit(state: State, *, expected: bool) -> Event | None:
    """The event a rank's exit means for a group in ``state``: FAIL for an unexpected one while it serves."""
    if not expected and (state, Event.FAIL) in TRANSITIONS:
        return Event.FAIL
    return None


class ProcessGroupMachine(StateMachine[State, Event]):
    NAME = "process_group"
    TABLE = TRANSITIONS
    INITIAL = State.NEW
    TERMINAL = TERMINAL
