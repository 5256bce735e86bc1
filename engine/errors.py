"""The engine's error tree: each error says what was wrong and what to do about it."""

from __future__ import annotations

__all__ = [
    "EngineError",
    "IngressRefused",
    "SessionStateError",
    "SessionExistsError",
    "UnknownSessionError",
    "OrchestratorClosedError",
    "InvalidStageOutput",
    "SessionCleanupError",
    "OrchestratorCloseError",
    "ActorBusyError",
    "ActorFailedError",
    "FatalStageError",
]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class IngressRefused(EngineError, ValueError):
    """Ingress that can never run (wrong artifact, duplicate, behind a frontier, past the end)."""


class SessionStateError(EngineError, RuntimeError):
    """The session is not in a state that allows this call (e.g. it is closing)."""


class SessionExistsError(EngineError, ValueError):
    """A session with this id is still running or poisoned; close or retry its cleanup first."""


class UnknownSessionError(EngineError, KeyError):
    """No session with this id is known to the orchestrator."""


class OrchestratorClosedError(EngineError, RuntimeError):
    """The orchestrator is closing or closed and takes no new sessions."""


class InvalidStageOutput(EngineError, ValueError):
    """A stage returned artifacts other than exactly the ones its spec produces."""


class SessionCleanupError(EngineError, RuntimeError):
    """A shutdown phase failed; the session is poisoned and its cleanup may be retried."""


class OrchestratorCloseError(EngineError, RuntimeError):
    """Closing the orchestrator could not close every session or actor (all were attempted)."""


class ActorBusyError(EngineError, RuntimeError):
    """The actor's mailbox is full; the scheduler retries later."""


class ActorFailedError(EngineError, RuntimeError):
    """The actor itself failed (not one invocation); every session on it fails."""


class FatalStageError(Exception):
    """Raise from a stage handler when the actor's own state is broken, not just this session's.

    The actor is marked failed and every session using it fails; an ordinary
    exception fails only the invocation's session.
    """
