"""How a stage actor's failure reaches the sessions.

The session whose call revealed the failure keeps that call's own error; every
other session still starting work fails with :class:`ActorFailedError`, whose
``__cause__`` is the exception that broke the actor. The scheduler core owns the
sessions and decides how one fails; this only decides who fails, and with what.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from .errors import ActorFailedError

if TYPE_CHECKING:
    from .actors import StageActor
    from .runtime import SessionRuntime

__all__ = ["ActorFailures"]


class ActorFailures:
    """Fans an actor's failure out to the sessions; used under the scheduler core's lock."""

    __slots__ = ("_actors", "_sessions", "_fail", "_surfaced")

    def __init__(
        self,
        actors: Mapping[str, StageActor],
        sessions: Callable[[], Iterable[SessionRuntime]],
        fail: Callable[[SessionRuntime, BaseException], None],
    ) -> None:
        self._actors = actors
        self._sessions = sessions  # the core's live and poisoned sessions, read at the moment of failure
        self._fail = fail  # the core's way to fail one session
        self._surfaced: dict[str, BaseException] = {}  # stage -> the error that is revealing its actor's failure

    def call_failed(self, rt: SessionRuntime, stage_id: str, error: BaseException) -> None:
        """A call of ``rt`` failed: it keeps ``error``; an actor failure it revealed fails the rest."""
        self._fail(rt, error)
        self._surfaced[stage_id] = error
        try:
            health = self._actors[stage_id].health()  # may itself notice the failure and tell the listeners
        finally:
            del self._surfaced[stage_id]
        if not health.healthy:
            self.actor_failed(stage_id, health.failure_reason, error)

    def heard(self, stage_id: str, reason: str) -> None:
        """The actor's failure listener fired (during :meth:`call_failed`, its error is the cause)."""
        self.actor_failed(stage_id, reason, self._surfaced.get(stage_id))

    def actor_failed(self, stage_id: str, reason: str | None, cause: BaseException | None) -> None:
        """Fail every session still starting work, with the cause (the actor's own, when not given)."""
        if cause is None:
            cause = self._actors[stage_id].health().failure_cause
        for rt in list(self._sessions()):
            if rt.starting_accepted_work:
                failure = ActorFailedError(f"stage actor {stage_id!r} is failed: {reason}")
                failure.__cause__ = cause
                self._fail(rt, failure)
