"""The messages between a process worker group and its rank processes, as attrs frozen classes.

Both sides dispatch on a message's type (``match``), never on a position in a
tuple, and a message of any other type is an :class:`UnknownWorkerMessage`
naming what came and what was expected.

Parent to child (:mod:`engine.workers` to :mod:`engine.worker_child`):
:class:`Call`, :class:`Shutdown`.

Child to parent: the hello, :class:`RankReady` or :class:`RankStartFailed`;
then one :class:`Result` or :class:`Raised` per rank per call; and
:class:`Closed` after a :class:`Shutdown`.

Pickled with ``multiprocessing``'s pickler on both sides (so tensors in
arguments and values travel as they would in a plain tuple). Nothing heavy is
imported here.
"""

from __future__ import annotations

import io
import pickle
import traceback
from typing import Any

import attrs

from .errors import EngineError

__all__ = [
    "Call",
    "Closed",
    "Raised",
    "RankReady",
    "RankStartFailed",
    "RemoteError",
    "Result",
    "Shutdown",
    "UnknownWorkerMessage",
    "UnloadableValue",
    "load_value",
    "remote_error",
]


class UnknownWorkerMessage(EngineError, TypeError):
    """A message that is none of the types its receiver takes (a version skew or a bug on the sender's side)."""

    def __init__(self, received: object, *, sender: str, expected: tuple[type, ...]) -> None:
        self.received = received
        self.sender = sender
        names = ", ".join(kind.__name__ for kind in expected)
        super().__init__(f"{sender} sent an unknown worker message {type(received).__qualname__} "
                         f"({received!r:.200}); expected one of: {names}")


class UnloadableValue(EngineError, ValueError):
    """A value pickled in a child process does not load in this one; the message says what did not load."""


class _NamingUnpickler(pickle.Unpickler):
    """Names what did not load: the global that could not be found, or the last one found before loading raised."""

    last: str | None = None

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = super().find_class(module, name)
        except Exception as exc:
            raise UnloadableValue(f"{module}.{name} cannot be imported: {type(exc).__name__}: {exc}") from exc
        self.last = f"{module}.{name}"
        return found


def load_value(data: bytes) -> Any:
    """Unpickle a value a child sent apart from its message (so that one which does not load here fails only what
    it belongs to, not the reader of every message), or raise :class:`UnloadableValue` saying what did not load."""
    unpickler = _NamingUnpickler(io.BytesIO(data))
    try:
        return unpickler.load()
    except UnloadableValue:
        raise
    except Exception as exc:
        after = f" (the last name it loaded: {unpickler.last})" if unpickler.last else ""
        raise UnloadableValue(f"loading it raised {type(exc).__name__}: {exc}{after}") from exc


@attrs.frozen
class RemoteError:
    """An exception raised in a rank: its qualified type name, message and traceback text."""

    type_name: str
    message: str
    traceback: str


def remote_error(exc: BaseException) -> RemoteError:
    """Describe ``exc`` for the parent; call it inside the ``except`` block (for the traceback)."""
    kind = type(exc)
    return RemoteError(f"{kind.__module__}.{kind.__qualname__}", str(exc), traceback.format_exc())


# -- parent to child ---------------------------------------------------------------------------


@attrs.frozen
class Call:
    """Run ``method(*args, **kwargs)`` on the rank object; answered by a :class:`Result` or :class:`Raised`."""

    call_id: int
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@attrs.frozen
class Shutdown:
    """Run the rank object's ``close()`` (if it has one), answer :class:`Closed` and exit."""


# -- child to parent ---------------------------------------------------------------------------


@attrs.frozen
class RankReady:
    """The hello of a rank that built its rank object."""

    rank: int
    pid: int


@attrs.frozen
class RankStartFailed:
    """The hello of a rank whose factory (or its import) raised; ``traceback`` is the child's."""

    rank: int
    traceback: str


@attrs.frozen
class Result:
    """One rank's return value for call ``call_id``, pickled on its own (:func:`load_value` reads it)."""

    call_id: int
    rank: int
    value: bytes


@attrs.frozen
class Raised:
    """One rank's method raised for call ``call_id`` (only that call fails)."""

    call_id: int
    rank: int
    error: RemoteError


@attrs.frozen
class Closed:
    """The rank ran its ``close()``; ``error`` is its traceback when that raised."""

    rank: int
    error: str | None
