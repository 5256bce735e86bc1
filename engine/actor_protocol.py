"""What a stage actor is to the orchestrator: the invocation it is given, its health, the protocol it keeps.

:class:`~engine.actors.LocalStageActor` is the actor the engine ships; any object keeping
:class:`StageActor` may stand in for it (a worker group's actor, a test's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

import attrs
import outcome
import trio

from states import stage_actor as actor_table
from states.pipeline_session import CloseReason

__all__ = ["ActorHealth", "ActorState", "Completion", "SessionContext", "STAGE_ACTOR_METHODS", "StageActor",
           "StageInvocation", "TaskKey", "new_invocation", "new_task_key"]

ActorState = actor_table.State


class TaskKey(NamedTuple):
    """Identity of one invocation: who, which epoch, which sequence, which stage, which try.

    A named tuple: immutable and hashable, and made for every admission at the cost of one
    tuple (a frozen attrs class sets each field through a Python-level call).
    """

    session_id: str
    session_epoch: int
    sequence_id: int
    stage_id: str
    request_id: int


@attrs.frozen
class SessionContext:
    session_id: str
    session_epoch: int


class StageInvocation(NamedTuple):
    """One call of a stage for one sequence of one session (a named tuple: made for every call)."""

    key: TaskKey
    inputs: Mapping[str, Any]
    is_first: bool  # the session's first call at this stage (where per-session state is set up)
    is_last: bool  # the call for the session's final sequence


# Made for every admission, so built by ``tuple.__new__`` itself: a named tuple's own ``__new__`` is a
# Python function. Each takes the fields as one tuple, in order.
new_task_key = functools.partial(tuple.__new__, TaskKey)
new_invocation = functools.partial(tuple.__new__, StageInvocation)


@attrs.frozen
class ActorHealth:
    state: ActorState
    pending_invocations: int
    failure_reason: str | None = None
    # the exception that broke the actor, when one did (sessions failed by it get it as __cause__)
    failure_cause: BaseException | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def healthy(self) -> bool:
        return self.state in actor_table.TAKES_WORK

    @property
    def failed(self) -> bool:
        """The actor failed (not merely retired): its calls and hooks fail with its failure reason."""
        return self.state in actor_table.BROKEN


Completion = Callable[[StageInvocation, outcome.Outcome], None]


class StageActor(Protocol):
    """What the orchestrator needs from an actor."""

    name: str

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    def submit(self, invocation: StageInvocation, on_done: Completion) -> None: ...

    def health(self) -> ActorHealth: ...

    def is_healthy(self) -> bool: ...

    async def close_session(self, context: SessionContext, reason: CloseReason) -> None: ...

    async def barrier(self) -> None: ...

    async def aclose(self) -> None: ...


#: the methods a stage actor has (read off the protocol, so the two never differ)
STAGE_ACTOR_METHODS = tuple(name for name, member in vars(StageActor).items() if callable(member) and not name.startswith("_"))
