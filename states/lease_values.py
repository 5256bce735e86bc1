"""What the execution-lease book says back: its transitions, its snapshots and its typed errors.

Kept apart from the rules in :mod:`states.lease_book` so that a driver or a
publisher can name these values without reading the book; ``states.lease_book``
re-exports every name here.
"""

from __future__ import annotations

import attrs

from .lease import State

__all__ = [
    "LeaseTransition",
    "LeaseSnapshot",
    "LeaseError",
    "UnknownLeaseSession",
    "DuplicateLeaseSession",
    "SessionClosing",
    "NotHolder",
    "ChunkInProgress",
    "NoChunkInProgress",
    "NotClosing",
]


# --------------------------------------------------------------------- errors


class LeaseError(ValueError):
    """A lease-book call that does not fit the session's current situation.

    ``session_id`` names the session; the book is unchanged.
    """

    def __init__(self, session_id: str, message: str) -> None:
        self.session_id = session_id
        super().__init__(f"execution lease: session {session_id!r}: {message}")


class UnknownLeaseSession(LeaseError):
    """The session was never registered (or was already released)."""


class DuplicateLeaseSession(LeaseError):
    """``register`` of a session id the book already holds."""


class SessionClosing(LeaseError):
    """``close`` of a session that is already closing."""


class NotHolder(LeaseError):
    """``begin_chunk`` / ``relinquish`` by a session that is not the ACTIVE holder."""


class ChunkInProgress(LeaseError):
    """A chunk of this session is still running (``begin_chunk`` twice,
    ``relinquish`` or ``release`` mid-chunk)."""


class NoChunkInProgress(LeaseError):
    """``finish_chunk`` / ``abort_chunk`` with no chunk of this session running."""


class NotClosing(LeaseError):
    """``release`` of a session that has not been closed."""


# --------------------------------------------------------------------- values


@attrs.frozen
class LeaseTransition:
    """One lifecycle change the book made (publish as ``lease_<state>``)."""

    session_id: str
    state: State


@attrs.frozen
class LeaseSnapshot:
    """One session as a status publisher sees it."""

    session_id: str
    state: State
    last_activity_at: float
    busy: bool
    queue_position: int | None
