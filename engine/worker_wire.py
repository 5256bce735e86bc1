"""The messages between a process worker group and its rank processes, as attrs frozen classes.

Both sides dispatch on a message's type (``match``), never on a position in a
tuple, and a message of any other type is an :class:`UnknownWorkerMessage`
naming what came and what was expected.

Parent to child (:mod:`engine.workers` to :mod:`engine.worker_child`):
:class:`Call`, :class:`Shutdown`.

Child to parent: the hello, :class:`RankReady` or :class:`RankStartFailed`;
then per rank per call :class:`Fetched` (for a call whose arguments hold shared memory) and one
:class:`Result` or :class:`Raised`; and :class:`Closed` after a :class:`Shutdown`.

Pickled with ``multiprocessing``'s pickler on both sides (so tensors in
arguments and values travel as they would in a plain tuple). A CPU tensor in a
value travels as a handle to its shared memory, which the rank holds until this
process fetches it: :func:`dump_value` lists those handles beside the value, so
that one this process does not load (it does not load here, or another rank's
method raised) is fetched and closed by :func:`release_shared` instead of being
held by the rank for its whole life. Nothing heavy is imported here.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import traceback
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs

from .errors import EngineError, FatalStageError, error_text, message_of
from .tensor_channel_refs import WorkerTensorRef

__all__ = [
    "Call",
    "Closed",
    "Fetched",
    "Raised",
    "RankReady",
    "RankStartFailed",
    "RemoteError",
    "Result",
    "Shutdown",
    "UnknownWorkerMessage",
    "UnloadableValue",
    "dump_arguments",
    "dump_value",
    "load_value",
    "release_shared",
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


def dump_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bytes, bytes]:
    """``(args, kwargs)`` pickled for one rank's :class:`Call` (:func:`load_value` reads them in the rank), and the
    shared-memory handles in them (as :func:`dump_value` lists a value's), which this process holds until the rank
    fetches them: a rank whose arguments do not load releases the rest itself (:func:`release_shared`)."""
    data, shared, _ = dump_value((args, kwargs))
    return data, shared


def dump_value(value: Any) -> tuple[bytes, bytes, tuple[tuple[str, int], ...]]:
    """Pickle a rank's value apart from its message: its bytes; (``b""`` when it has none) the shared-memory
    handles (``resource_sharer.DupFd``) in it, in the order they were written, pickled on their own for
    :func:`release_shared`; and the tensor-channel transfers its refs (:class:`WorkerTensorRef`) name, as
    ``(channel id, transfer id)``, for the parent to discard should the value be lost there."""
    shared: list[Any] = []
    transfers: set[tuple[str, int]] = set()

    def listed(handle: Any) -> Any:  # not a method of the pickler: a cycle would keep its memo (the tensors) alive
        shared.append(handle)
        return handle.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    def named(ref: WorkerTensorRef) -> Any:
        transfers.add((ref.channel_id, ref.transfer_id))
        return ref.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[resource_sharer.DupFd] = listed
    pickler.dispatch_table[WorkerTensorRef] = named
    try:
        pickler.dump(value)
    except BaseException:  # the handles written before the part that does not pickle: nobody will ever fetch them
        for handle in shared:
            _fetch_and_close(handle)
        raise
    return buffer.getvalue(), (bytes(ForkingPickler.dumps(shared)) if shared else b""), tuple(sorted(transfers))


def _fetch_and_close(handle: Any) -> bool:
    """Take a shared-memory handle this process offered and close it: it is offered no more. False when it was gone."""
    try:
        os.close(handle.detach())
    except (OSError, EOFError):  # its holder is gone, and its handles with it
        return False
    return True


def _counting(fetched: set[int]) -> type:
    """A ``DupFd`` that notes, by its place in the pickle, that loading fetched it (loading may stop half-way)."""
    places = itertools.count()

    class CountedDupFd(resource_sharer.DupFd):  # type: ignore[name-defined,misc]
        def __new__(cls, *args: Any) -> Any:
            handle = super().__new__(cls)
            handle.place = next(places)
            return handle

        def detach(self) -> int:
            fetched.add(self.place)
            return super().detach()

    return CountedDupFd


class _NamingUnpickler(pickle.Unpickler):
    """Names what did not load: the global that could not be found, or the last one found before loading raised;
    notes which shared-memory handles loading fetched (into ``fetched``, when given)."""

    last: str | None = None

    def __init__(self, file: io.BytesIO, fetched: set[int] | None) -> None:
        super().__init__(file)
        self.counted = None if fetched is None else _counting(fetched)

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = super().find_class(module, name)
        except Exception as exc:
            raise UnloadableValue(f"{module}.{name} cannot be imported: {error_text(exc)}") from exc
        self.last = f"{module}.{name}"
        if found is resource_sharer.DupFd and self.counted is not None:
            return self.counted
        return found


def load_value(data: bytes, fetched: set[int] | None = None) -> Any:
    """Unpickle a value a child sent apart from its message (so that one which does not load here fails only what
    it belongs to, not the reader of every message), or raise :class:`UnloadableValue` saying what did not load.
    ``fetched`` collects the places of the shared-memory handles that loading fetched, even when it fails."""
    unpickler = _NamingUnpickler(io.BytesIO(data), fetched)
    try:
        return unpickler.load()
    except UnloadableValue:
        raise
    except Exception as exc:
        after = f" (the last name it loaded: {unpickler.last})" if unpickler.last else ""
        raise UnloadableValue(f"loading it raised {error_text(exc)}{after}") from exc


def release_shared(shared: bytes, fetched: frozenset[int] | set[int] = frozenset()) -> int:
    """Fetch and close the shared-memory handles of a value that was not loaded (all but those at the places in
    ``fetched``), so the rank holds them no longer; returns how many were released."""
    released = 0
    for place, handle in enumerate(pickle.loads(shared) if shared else ()):
        if place not in fetched:
            released += _fetch_and_close(handle)
    return released


@attrs.frozen
class RemoteError:
    """An exception raised in a rank: its qualified type name, message and traceback text, and whether it is a
    :class:`~engine.errors.FatalStageError` (the rank's stage can take no more work: the parent says so too)."""

    type_name: str
    message: str
    traceback: str
    fatal: bool = False


def remote_error(exc: BaseException) -> RemoteError:
    """Describe ``exc`` for the parent; call it inside the ``except`` block (for the traceback)."""
    kind = type(exc)
    message = message_of(exc)  # a careless exception's __str__ may raise: the call fails, not the rank
    return RemoteError(f"{kind.__module__}.{kind.__qualname__}", message, traceback.format_exc(),
                       isinstance(exc, FatalStageError))


# -- parent to child ---------------------------------------------------------------------------


@attrs.frozen
class Call:
    """Run ``method(*args, **kwargs)`` on the rank object; answered by a :class:`Result` or :class:`Raised`.

    ``arguments`` is ``(args, kwargs)`` pickled apart from the message, once per rank (a CPU tensor in it travels
    as a shared-memory handle that only one process can fetch), so that arguments which do not load in the rank
    fail only this call there (a :class:`Raised` naming what did not load), not the rank."""

    call_id: int
    method: str
    arguments: bytes
    shared: bytes = b""  # the shared-memory handles in ``arguments`` (:func:`dump_arguments`)


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
class Fetched:
    """The rank loaded call ``call_id``'s arguments: it holds their shared memory now, which the parent had held for
    it until then (and releases itself for a rank that dies before it says so)."""

    call_id: int
    rank: int


@attrs.frozen
class Result:
    """One rank's return value for call ``call_id``, pickled on its own (:func:`load_value` reads it), the
    shared-memory handles in it and the tensor-channel transfers its refs name (:func:`dump_value`)."""

    call_id: int
    rank: int
    value: bytes
    shared: bytes = b""
    transfers: tuple[tuple[str, int], ...] = ()


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
