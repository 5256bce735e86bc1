"""The errors of a process worker group (:mod:`engine.workers`, which exports them too)."""

from __future__ import annotations

from .errors import EngineError, FatalStageError

__all__ = [
    "WorkerCallError",
    "WorkerFatalCallError",
    "WorkerGroupClosed",
    "WorkerGroupError",
    "WorkerGroupFailed",
    "WorkerStartupError",
]


class WorkerGroupError(EngineError, RuntimeError):
    """Base of the process worker group's errors."""


class WorkerStartupError(WorkerGroupError):
    """A rank could not start (import error, factory raised, exited, timed out); no rank is left running."""


class WorkerGroupFailed(WorkerGroupError, FatalStageError):
    """The group itself is broken (a rank died, a call timed out): every pending and later call fails.

    It is a :class:`FatalStageError`, so the stage actor owning the group fails with it.
    """


class WorkerGroupClosed(WorkerGroupError):
    """The group is closing or closed."""


class WorkerCallError(WorkerGroupError):
    """A rank's method raised; only this call fails. ``remote_traceback`` is the child's traceback text."""

    def __init__(self, message: str, *, rank: int, method: str, remote_type: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class WorkerFatalCallError(WorkerCallError, FatalStageError):
    """A rank's method raised a :class:`FatalStageError` (a tensor channel's timeout, say): this call fails, and,
    as a FatalStageError, so does the stage actor that made it, as it would in one process."""
