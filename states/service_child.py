"""Lifecycle of one pipeline service in a child process, as its proxy in the server sees it.

Theory of operation
-------------------
A proxy exists once its child has loaded the pipeline: LOADED. RUN (the proxy
enters ``running()``) sends the child in (STARTING); ENTERED (the child is inside
the service's ``running()`` and sent its memory report) makes it RUNNING, the
only state that takes calls and streams. RUN_FAILED (the child's ``running()``
raised on the way in) and STOP (leaving ``running()``, ``close()`` before it, or
the proxy being dropped) start the bounded shutdown, STOPPING. LOST (the child
exited or broke the wire protocol) fails a serving proxy (FAILED: every pending
and later call fails with the recorded cause); while STOPPING an exit is
expected and changes nothing. A FAILED proxy is still stopped (STOP) so that the
child is reaped and its pipe closed; CLOSED (reaped, pipe closed) ends STOPPING
in STOPPED, the only terminal state. The failure itself is a recorded fact, not a
state, so that it survives the stop.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = [
    "State", "Event", "TRANSITIONS", "TERMINAL", "TAKES_CALLS", "FAILS_WHEN_LOST", "INSIDE_RUNNING",
    "ServiceChildMachine",
]


class State(TableEnum):
    LOADED = "loaded"
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Event(TableEnum):
    RUN = "run"
    ENTERED = "entered"
    RUN_FAILED = "run_failed"
    LOST = "lost"
    STOP = "stop"
    CLOSED = "closed"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.LOADED, Event.RUN): State.STARTING,
    (State.LOADED, Event.LOST): State.FAILED,
    (State.LOADED, Event.STOP): State.STOPPING,
    (State.STARTING, Event.ENTERED): State.RUNNING,
    (State.STARTING, Event.RUN_FAILED): State.STOPPING,
    (State.STARTING, Event.LOST): State.FAILED,
    (State.STARTING, Event.STOP): State.STOPPING,
    (State.RUNNING, Event.LOST): State.FAILED,
    (State.RUNNING, Event.STOP): State.STOPPING,
    (State.FAILED, Event.LOST): State.FAILED,
    (State.FAILED, Event.STOP): State.STOPPING,
    (State.STOPPING, Event.LOST): State.STOPPING,
    (State.STOPPING, Event.CLOSED): State.STOPPED,
}

TERMINAL = frozenset({State.STOPPED})

#: The only state in which calls and chunk streams reach the child.
TAKES_CALLS = frozenset({State.RUNNING})

#: States in which losing the child is a failure (derived from the table: LOST leads to FAILED from them).
FAILS_WHEN_LOST = frozenset(
    source for (source, event), target in TRANSITIONS.items()
    if event is Event.LOST and target is State.FAILED and source is not State.FAILED
)

#: States that only ``running()`` may leave (``close()`` refuses them).
INSIDE_RUNNING = frozenset({State.STARTING, State.RUNNING, State.STOPPING})


class ServiceChildMachine(StateMachine[State, Event]):
    NAME = "service_child"
    TABLE = TRANSITIONS
    INITIAL = State.LOADED
    TERMINAL = TERMINAL
