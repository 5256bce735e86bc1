"""What the stream runtime refuses with, each a type of its own: the API answers each with its HTTP status
(409, 503 with Retry-After, 429), so the runtime says why in a type rather than in words."""

from __future__ import annotations

__all__ = ["SessionConflict", "NoWorker", "ViewerLimit", "NO_WORKER_RETRY_AFTER"]

#: seconds a client is told to wait (Retry-After) when no worker is live
NO_WORKER_RETRY_AFTER = 10.0


class SessionConflict(RuntimeError):
    """The request conflicts with the session's state (e.g. a token for a terminal session)."""


class NoWorker(RuntimeError):
    """No worker is running or starting: a new session would wait for nothing (HTTP 503). ``retry_after`` None:
    none ever will (every slot gave up or was drained, and no agent can join), so no Retry-After is sent: it asked
    clients to retry every 10 s for ever against a server that had said it would not restart its worker."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ViewerLimit(RuntimeError):
    """The session's room already has as many viewer identities as it may hold."""
