"""Lifecycle of one session inside the streaming orchestrator, with its ordered shutdown.

Theory of operation
-------------------
A RUNNING session accepts ingress and has its ready work admitted to stages.
Every way out follows the same ordered shutdown, one phase per state:

1. stop admitting new work. Each way of stopping has its own state, and that
   state alone decides how the session ends and what its stage hooks are told:

   - CLOSE enters DRAINING: accepted work finishes, its outputs are delivered;
     the session settles CLOSED;
   - CANCEL (or a drain that ran past its deadline, DRAIN_TIMED_OUT) enters
     CANCELLING: waiting work is dropped; it settles CANCELLED;
   - SHUT_DOWN (the orchestrator is closing) enters SHUTTING_DOWN: as
     CANCELLING, but it settles CLOSED and hooks hear ``shutdown``;
   - FAIL enters FAILING from any of the above: it settles FAILED. No event
     leaves FAILING for another stop state, so a failure is never overwritten
     by a later cancel; that precedence is this table, not code beside it.

   A model call already running is never interrupted; its result is discarded
   unless the session is draining.
2. WORK_SETTLED: nothing of the session is in flight any more; enter
   RELEASING_STAGES, where every stage's session hook runs through its owning
   actor in reverse topological order.
3. STAGES_RELEASED: enter RELEASING_ARTIFACTS: drop buffered artifacts and
   verify that no reservation or slot is still held (a leak fails cleanup).
4. The SETTLE_* event named by ``SETTLE_EVENT[stop state]``.

Any phase that fails or misses its deadline after admission stopped
(CLEANUP_FAILED) leaves the session POISONED: its partially released state is
never reused. RETRY_CLEANUP re-enters RELEASING_STAGES, and the orchestrator
then runs only the hooks that have not yet succeeded; it applies RETRY_CLEANUP
only once nothing of the session is in flight, so a retry never releases stage
state under a running call. The machine remembers the stop state it left
RUNNING through (``stopped_as``), so a retried cleanup settles as the first
attempt would have.
"""

from __future__ import annotations


from .machine import StateMachine, TableEnum

__all__ = [
    "State", "Event", "CloseReason", "TRANSITIONS", "TERMINAL", "STOPPING", "SETTLE_EVENT", "HOOK_REASON", "ADMITTING",
    "STARTING_ACCEPTED_WORK", "EMITTING", "DROPPING_WORK", "DROPS_OUTPUTS", "ENDED_FAILED",
    "PipelineSessionMachine",
]


class State(TableEnum):
    RUNNING = "running"
    DRAINING = "draining"
    CANCELLING = "cancelling"
    SHUTTING_DOWN = "shutting_down"
    FAILING = "failing"
    RELEASING_STAGES = "releasing_stages"
    RELEASING_ARTIFACTS = "releasing_artifacts"
    CLOSED = "closed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    POISONED = "poisoned"


class Event(TableEnum):
    CLOSE = "close"
    CANCEL = "cancel"
    DRAIN_TIMED_OUT = "drain_timed_out"
    SHUT_DOWN = "shut_down"
    FAIL = "fail"
    WORK_SETTLED = "work_settled"
    STAGES_RELEASED = "stages_released"
    CLEANUP_FAILED = "cleanup_failed"
    RETRY_CLEANUP = "retry_cleanup"
    SETTLE_CLOSED = "settle_closed"
    SETTLE_CANCELLED = "settle_cancelled"
    SETTLE_FAILED = "settle_failed"


class CloseReason(TableEnum):
    """Why a session is shutting down; passed to every stage's session hook."""

    CLOSED = "closed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    SHUTDOWN = "shutdown"


TRANSITIONS: dict[tuple[State, Event], State] = {
    # 1. stop admitting: one state per way of stopping
    (State.RUNNING, Event.CLOSE): State.DRAINING,
    (State.RUNNING, Event.CANCEL): State.CANCELLING,
    (State.RUNNING, Event.SHUT_DOWN): State.SHUTTING_DOWN,
    (State.RUNNING, Event.FAIL): State.FAILING,
    (State.DRAINING, Event.CANCEL): State.CANCELLING,
    (State.DRAINING, Event.DRAIN_TIMED_OUT): State.CANCELLING,
    (State.DRAINING, Event.SHUT_DOWN): State.SHUTTING_DOWN,
    (State.DRAINING, Event.FAIL): State.FAILING,
    (State.CANCELLING, Event.FAIL): State.FAILING,
    (State.SHUTTING_DOWN, Event.FAIL): State.FAILING,
    # 2. accepted work settled; release stage state through the owners
    (State.DRAINING, Event.WORK_SETTLED): State.RELEASING_STAGES,
    (State.CANCELLING, Event.WORK_SETTLED): State.RELEASING_STAGES,
    (State.SHUTTING_DOWN, Event.WORK_SETTLED): State.RELEASING_STAGES,
    (State.FAILING, Event.WORK_SETTLED): State.RELEASING_STAGES,
    # 3. release artifact references and check the reservations
    (State.RELEASING_STAGES, Event.STAGES_RELEASED): State.RELEASING_ARTIFACTS,
    # 4. settle as the stop state decided
    (State.RELEASING_ARTIFACTS, Event.SETTLE_CLOSED): State.CLOSED,
    (State.RELEASING_ARTIFACTS, Event.SETTLE_CANCELLED): State.CANCELLED,
    (State.RELEASING_ARTIFACTS, Event.SETTLE_FAILED): State.FAILED,
    # a failed phase poisons the session; cleanup may be retried
    (State.DRAINING, Event.CLEANUP_FAILED): State.POISONED,
    (State.CANCELLING, Event.CLEANUP_FAILED): State.POISONED,
    (State.SHUTTING_DOWN, Event.CLEANUP_FAILED): State.POISONED,
    (State.FAILING, Event.CLEANUP_FAILED): State.POISONED,
    (State.RELEASING_STAGES, Event.CLEANUP_FAILED): State.POISONED,
    (State.RELEASING_ARTIFACTS, Event.CLEANUP_FAILED): State.POISONED,
    (State.POISONED, Event.RETRY_CLEANUP): State.RELEASING_STAGES,
}

TERMINAL = frozenset({State.CLOSED, State.CANCELLED, State.FAILED})

# The states that stop admission, each with how the session settles and what its hooks hear.
STOPPING = frozenset({State.DRAINING, State.CANCELLING, State.SHUTTING_DOWN, State.FAILING})
SETTLE_EVENT = {
    State.DRAINING: Event.SETTLE_CLOSED,
    State.CANCELLING: Event.SETTLE_CANCELLED,
    State.SHUTTING_DOWN: Event.SETTLE_CLOSED,
    State.FAILING: Event.SETTLE_FAILED,
}
HOOK_REASON = {
    State.DRAINING: CloseReason.CLOSED,
    State.CANCELLING: CloseReason.CANCELLED,
    State.SHUTTING_DOWN: CloseReason.SHUTDOWN,
    State.FAILING: CloseReason.FAILED,
}

# States in which new work may still be admitted for the session.
ADMITTING = frozenset({State.RUNNING})
# States in which already-accepted work may still be started (and its results kept).
STARTING_ACCEPTED_WORK = frozenset({State.RUNNING, State.DRAINING})
# States in which outputs may still come (accepted work still starts, and its results are kept).
EMITTING = STARTING_ACCEPTED_WORK
# States in which accepted work that waits is dropped.
DROPPING_WORK = frozenset({State.CANCELLING, State.SHUTTING_DOWN, State.FAILING})
# Each stop event, with whether it drops the outputs already emitted and not yet read: a close (and a drain past its
# deadline) leaves them to be read, a cancel, a shutdown and a failure drop them with the work that waits.
DROPS_OUTPUTS = {
    Event.CLOSE: False, Event.DRAIN_TIMED_OUT: False, Event.CANCEL: True, Event.SHUT_DOWN: True, Event.FAIL: True,
}
# The state of a session that ended because it failed (its error says why).
ENDED_FAILED = frozenset({State.FAILED})

# Stop events a caller applies at once, even while another shutdown of the session is under way
# (which holds the session's lifecycle until it ends): a cancel cuts a running drain short, as
# the DRAINING -> CANCELLING row allows. Any other stop waits for the shutdown under way.
PREEMPTS_SHUTDOWN = frozenset({Event.CANCEL})


class PipelineSessionMachine(StateMachine[State, Event]):
    NAME = "pipeline session"
    TABLE = TRANSITIONS
    INITIAL = State.RUNNING
    TERMINAL = TERMINAL

    # ``admitting`` and ``starting_accepted_work``: the state's membership in ADMITTING and
    # STARTING_ACCEPTED_WORK, looked up once per transition (the scheduler asks on every admission)
    __slots__ = ("stopped_as", "admitting", "starting_accepted_work")

    def __init__(self, state: State | None = None) -> None:
        super().__init__(state)
        self.stopped_as: State | None = self.state if self.state in STOPPING else None
        self._classify(self.state)

    def apply(self, event: Event) -> State:
        new_state = super().apply(event)
        if new_state in STOPPING:
            self.stopped_as = new_state
        self._classify(new_state)
        return new_state

    def _classify(self, state: State) -> None:
        self.admitting = state in ADMITTING
        self.starting_accepted_work = state in STARTING_ACCEPTED_WORK

    @property
    def settle_event(self) -> Event:
        """The SETTLE_* event of the stop state the session left RUNNING through."""
        return SETTLE_EVENT[self.stopped_as or State.DRAINING]

    @property
    def hook_reason(self) -> CloseReason:
        """What the stage hooks are told, from the same stop state."""
        return HOOK_REASON[self.stopped_as or State.DRAINING]
