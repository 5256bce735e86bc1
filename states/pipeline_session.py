"""Lifecycle of one session inside the streaming orchestrator, with its ordered shutdown.

Theory of operation
-------------------
A RUNNING session accepts ingress and has its ready work admitted to stages.
Every way out follows the same ordered shutdown, one phase per state:

1. stop admitting new work — CLOSE enters DRAINING (accepted work finishes and
   its outputs are still delivered); CANCEL or FAIL enters CANCELLING (work
   that waits is cancelled; a model call already running is never interrupted,
   its result is discarded). A drain that runs past its deadline is CANCELled.
2. WORK_SETTLED: nothing of the session is in flight any more; enter
   RELEASING_STAGES, where every stage's session hook runs through its owning
   actor in reverse topological order.
3. STAGES_RELEASED: enter RELEASING_ARTIFACTS — drop buffered artifacts and
   verify no capacity slot is still held (a leak is counted and fails cleanup).
4. SETTLE_<outcome>: the session is CLOSED, CANCELLED or FAILED, as the reason
   recorded when shutdown began says.

Any phase that fails or misses its deadline after admission stopped
(CLEANUP_FAILED) leaves the session POISONED: its partially released state is
never reused. RETRY_CLEANUP re-enters RELEASING_STAGES, and the orchestrator
then runs only the hooks that have not yet succeeded. The orchestrator applies
RETRY_CLEANUP only once nothing of the session is in flight (a drain that timed
out may have left a model call running), so a retry never releases stage state
under a running call.
"""

from __future__ import annotations

import enum

from .machine import StateMachine

__all__ = ["State", "Event", "CloseReason", "TRANSITIONS", "TERMINAL", "PipelineSessionMachine"]


class State(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"
    CANCELLING = "cancelling"
    RELEASING_STAGES = "releasing_stages"
    RELEASING_ARTIFACTS = "releasing_artifacts"
    CLOSED = "closed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    POISONED = "poisoned"


class Event(enum.Enum):
    CLOSE = "close"
    CANCEL = "cancel"
    FAIL = "fail"
    WORK_SETTLED = "work_settled"
    STAGES_RELEASED = "stages_released"
    CLEANUP_FAILED = "cleanup_failed"
    RETRY_CLEANUP = "retry_cleanup"
    SETTLE_CLOSED = "settle_closed"
    SETTLE_CANCELLED = "settle_cancelled"
    SETTLE_FAILED = "settle_failed"


class CloseReason(enum.Enum):
    """Why a session is shutting down; passed to every stage's session hook."""

    CLOSED = "closed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    SHUTDOWN = "shutdown"


TRANSITIONS: dict[tuple[State, Event], State] = {
    # 1. stop admitting
    (State.RUNNING, Event.CLOSE): State.DRAINING,
    (State.RUNNING, Event.CANCEL): State.CANCELLING,
    (State.RUNNING, Event.FAIL): State.CANCELLING,
    (State.DRAINING, Event.CANCEL): State.CANCELLING,
    (State.DRAINING, Event.FAIL): State.CANCELLING,
    (State.CANCELLING, Event.FAIL): State.CANCELLING,
    # 2. accepted work settled; release stage state through the owners
    (State.DRAINING, Event.WORK_SETTLED): State.RELEASING_STAGES,
    (State.CANCELLING, Event.WORK_SETTLED): State.RELEASING_STAGES,
    # 3. release artifact references and check the slots
    (State.RELEASING_STAGES, Event.STAGES_RELEASED): State.RELEASING_ARTIFACTS,
    # 4. settle with the recorded reason
    (State.RELEASING_ARTIFACTS, Event.SETTLE_CLOSED): State.CLOSED,
    (State.RELEASING_ARTIFACTS, Event.SETTLE_CANCELLED): State.CANCELLED,
    (State.RELEASING_ARTIFACTS, Event.SETTLE_FAILED): State.FAILED,
    # a failed phase poisons the session; cleanup may be retried
    (State.DRAINING, Event.CLEANUP_FAILED): State.POISONED,
    (State.CANCELLING, Event.CLEANUP_FAILED): State.POISONED,
    (State.RELEASING_STAGES, Event.CLEANUP_FAILED): State.POISONED,
    (State.RELEASING_ARTIFACTS, Event.CLEANUP_FAILED): State.POISONED,
    (State.POISONED, Event.RETRY_CLEANUP): State.RELEASING_STAGES,
}

TERMINAL = frozenset({State.CLOSED, State.CANCELLED, State.FAILED})

# States in which new work may still be admitted for the session.
ADMITTING = frozenset({State.RUNNING})
# States in which already-accepted work may still be started.
STARTING_ACCEPTED_WORK = frozenset({State.RUNNING, State.DRAINING})

SETTLE_EVENT = {
    CloseReason.CLOSED: Event.SETTLE_CLOSED,
    CloseReason.SHUTDOWN: Event.SETTLE_CLOSED,
    CloseReason.CANCELLED: Event.SETTLE_CANCELLED,
    CloseReason.FAILED: Event.SETTLE_FAILED,
}


class PipelineSessionMachine(StateMachine[State, Event]):
    NAME = "pipeline session"
    TABLE = TRANSITIONS
    INITIAL = State.RUNNING
    TERMINAL = TERMINAL
