"""Lifecycle of one stage actor (the single owner of a stage's state).

Theory of operation
-------------------
An actor is STARTING until its task (and, for synchronous handlers, its
dedicated thread) is up; STARTED makes it RUNNING. A handler raising fails only
that invocation's session; FAIL is for the actor itself — its loop, its thread
or its worker group died — and fails every session on it. FAILED is terminal:
a failed owner never runs work again. CLOSE retires a healthy actor after its
queued work finished; closing an actor that already failed keeps it FAILED
(the caller checks ``can`` first), so its failure reason is never hidden.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = ["State", "Event", "TRANSITIONS", "TERMINAL", "TAKES_WORK", "BROKEN", "RETIRED", "NOT_STARTED", "StageActorMachine"]


class State(TableEnum):
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    CLOSED = "closed"


class Event(TableEnum):
    STARTED = "started"
    FAIL = "fail"
    CLOSE = "close"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.STARTING, Event.STARTED): State.RUNNING,
    (State.STARTING, Event.FAIL): State.FAILED,
    (State.RUNNING, Event.FAIL): State.FAILED,
    (State.STARTING, Event.CLOSE): State.CLOSED,
    (State.RUNNING, Event.CLOSE): State.CLOSED,
}

TERMINAL = frozenset({State.FAILED, State.CLOSED})
TAKES_WORK = frozenset({State.RUNNING})  # the states whose actor accepts and runs invocations
#: The actor failed: every call and hook fails with its failure, and it holds no usable session state.
BROKEN = frozenset({State.FAILED})
#: The actor was retired whole: it takes no more work, and nothing of it failed.
RETIRED = frozenset({State.CLOSED})
#: The actor's task has not started: closing it has nothing to wait for.
NOT_STARTED = frozenset({State.STARTING})


class StageActorMachine(StateMachine[State, Event]):
    NAME = "stage actor"
    TABLE = TRANSITIONS
    INITIAL = State.STARTING
    TERMINAL = TERMINAL

    # ``takes_work``: the state's membership in TAKES_WORK, looked up once per transition
    # (the actor asks on every submit and every completion)
    __slots__ = ("takes_work",)

    def __init__(self, state: State | None = None) -> None:
        super().__init__(state)
        self.takes_work = self.state in TAKES_WORK

    def apply(self, event: Event) -> State:
        new_state = super().apply(event)
        self.takes_work = new_state in TAKES_WORK
        return new_state
