"""The engine's error tree: each error says what was wrong and what to do about it."""

from __future__ import annotations

import math
import operator
import traceback

import trio

__all__ = [
    "EngineError",
    "IngressRefused",
    "SessionStateError",
    "OutputsBusyError",
    "SessionExistsError",
    "UnknownSessionError",
    "OrchestratorClosedError",
    "InvalidStageOutput",
    "SessionCleanupError",
    "OrchestratorCloseError",
    "ActorBusyError",
    "ActorFailedError",
    "FatalStageError",
    "StageCallTimeout",
    "WrongThreadError",
    "carries",
    "drop_frame_locals",
    "error_text",
    "integer",
    "message_of",
    "seconds",
    "shown",
]

SHOWN_LIMIT = 80  # characters of a caller's value that an error message quotes


def shown(value: object, limit: int | None = SHOWN_LIMIT) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (None: whole).

    A careless caller's value may be anything: an int too long for ``repr`` (Python
    refuses more than 4300 digits), a huge container, an object whose ``repr`` raises.
    The message that names it must still be made, so that the error is the one meant.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"{'-' if value < 0 else ''}<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:
        return f"<a {type(value).__name__} whose repr failed>"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def carries(error: BaseException, *kinds: type[BaseException]) -> bool:
    """Whether ``error`` is one of ``kinds``, or a group that holds one (trio's cancellation goes on to its scope
    whatever came with it)."""
    if isinstance(error, BaseExceptionGroup):
        return error.subgroup(kinds) is not None
    return isinstance(error, kinds)


#: how many errors of a chain (causes, contexts) :func:`drop_frame_locals` looks at
CHAIN_LIMIT = 16


def drop_frame_locals(error: BaseException) -> None:
    """Drop the local variables of the finished frames in ``error``'s traceback, and in its causes' and contexts':
    a failed call's inputs (a session's tensors, in the handler's frame) lived on with the error, for as long as the
    session handle (its ``error``) or the actor (a fatal error, its health's cause) kept it. The traceback still
    names every file and line; a frame still running (the thread's loop that caught it) is left as it is."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending and len(seen) < CHAIN_LIMIT:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions


def message_of(error: BaseException) -> str:
    """``str(error)`` for a message that names another error (a stage's, a hook's), made even where that raises (an
    error's arguments' own ``repr`` may: a tensor on a device that failed), so that the error meant is still raised,
    not the one its message met."""
    try:
        return str(error)
    except Exception:
        return f"<its message could not be made: {type(error).__name__}.__str__ failed>"


def error_text(error: BaseException) -> str:
    """``"Type: message"`` naming another error (:func:`message_of`)."""
    return f"{type(error).__name__}: {message_of(error)}"


def integer(name: str, value: object, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` as a plain int (numpy's integers and an IntEnum are ints too), or a ValueError naming ``name``: an
    integer (a bool is not one) of at least ``minimum`` (and at most ``maximum``)."""
    number = None
    if not isinstance(value, (bool, float)):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    if number is None or number < minimum or maximum is not None and number > maximum:
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name} must be an int {bounds}, got {shown(value)}")
    return number


def seconds(name: str, value: object, *, zero_ok: bool = False, finite: bool = False) -> float:
    """``value`` as a number of seconds, or a ValueError naming ``name``: a number (a bool is not one), not NaN,
    > 0 (>= 0 with ``zero_ok``), and finite when ``finite`` (else ``math.inf`` means no limit)."""
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            pass
    if not (number >= 0 if zero_ok else number > 0) or (finite and not math.isfinite(number)):
        kind = "a finite number" if finite else "a number"
        raise ValueError(f"{name} must be {kind} of seconds {'>= 0' if zero_ok else '> 0'}, got {shown(value)}")
    return number


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class IngressRefused(EngineError, ValueError):
    """Ingress that can never run (wrong artifact, duplicate, behind a frontier, past the end)."""


class SessionStateError(EngineError, RuntimeError):
    """The session is not in a state that allows this call (e.g. it is closing)."""


class OutputsBusyError(EngineError, trio.BusyResourceError):
    """Another task is already waiting on the session's outputs: two readers would each miss what the other took."""


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


class StageCallTimeout(EngineError, RuntimeError):
    """A stage call ran past its actor's ``call_timeout``: the actor is failed with this as the cause, and every session
    on the actor fails (a synchronous call cannot be interrupted: its thread is left to it; an ``async`` one is
    cancelled)."""


class WrongThreadError(EngineError, RuntimeError):
    """An orchestrator or session was called from a thread other than the one its trio run is in (a plain
    thread, a stage's handler, another ``trio.run``): it is not thread-safe, so the call is refused unrun."""


class FatalStageError(Exception):
    """Raise from a stage handler when the actor's own state is broken, not just this session's.

    The actor is marked failed and every session using it fails; an ordinary
    exception fails only the invocation's session.
    """
