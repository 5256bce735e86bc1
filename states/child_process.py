"""Lifecycle of one supervised child process, as its supervisor sees it.

Theory of operation
-------------------
A child is STARTING from the moment it is spawned until its first message (its
*hello*: loaded and ready, or a startup failure) makes it RUNNING. STOP asks it
to leave on its own (a stop message); if it has not exited by the stop
deadline, TERMINATE sends SIGTERM, and KILL sends SIGKILL a grace period later.
KILL may also come at once from any live state: the owner gave up on it (a
missed heartbeat deadline, a pipe it closed while living on, a failed start).
EXIT (its sentinel fired and it was reaped) ends every live state; EXITED is
the only terminal state. Whether an exit was *expected* is not a state but a
fact the supervisor records: a stop had been requested.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "LIVE", "HEARTBEAT_WATCHED", "ChildProcessMachine", "due_signal"]


class State(TableEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    TERMINATED = "terminated"
    KILLED = "killed"
    EXITED = "exited"


class Event(TableEnum):
    HELLO = "hello"
    STOP = "stop"
    TERMINATE = "terminate"
    KILL = "kill"
    EXIT = "exit"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.STARTING, Event.HELLO): State.RUNNING,
    (State.STARTING, Event.STOP): State.STOPPING,
    (State.STARTING, Event.KILL): State.KILLED,
    (State.STARTING, Event.EXIT): State.EXITED,
    (State.RUNNING, Event.STOP): State.STOPPING,
    (State.RUNNING, Event.KILL): State.KILLED,
    (State.RUNNING, Event.EXIT): State.EXITED,
    (State.STOPPING, Event.TERMINATE): State.TERMINATED,
    (State.STOPPING, Event.KILL): State.KILLED,
    (State.STOPPING, Event.EXIT): State.EXITED,
    (State.TERMINATED, Event.KILL): State.KILLED,
    (State.TERMINATED, Event.EXIT): State.EXITED,
    (State.KILLED, Event.EXIT): State.EXITED,
}

TERMINAL = frozenset({State.EXITED})

#: States with a process that has not been reaped yet.
LIVE = frozenset(set(State) - TERMINAL)

#: The state in which a child must keep talking (its heartbeat deadline applies).
HEARTBEAT_WATCHED = frozenset({State.RUNNING})


def due_signal(state: State, *, since_stop: float, stop_timeout: float, kill_grace: float) -> Event | None:
    """The signal a child asked to stop ``since_stop`` seconds ago is due now, or None.

    SIGTERM once ``stop_timeout`` has passed, SIGKILL ``kill_grace`` after that.
    """
    if since_stop > stop_timeout + kill_grace and (state, Event.KILL) in TRANSITIONS:
        return Event.KILL
    if since_stop > stop_timeout and (state, Event.TERMINATE) in TRANSITIONS:
        return Event.TERMINATE
    return None


class ChildProcessMachine(StateMachine[State, Event]):
    NAME = "child_process"
    TABLE = TRANSITIONS
    INITIAL = State.STARTING
    TERMINAL = TERMINAL
