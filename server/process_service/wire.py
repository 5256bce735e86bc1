"""The messages between a process service's proxy and its child, as attrs classes.

Each message is pickled by :func:`dumps` (a pickler that also handles
``MappingProxyType``, which contract objects hold) and written with
``send_bytes`` through the :class:`engine.supervisor.Supervisor`'s pipe.

Parent to child: :class:`Run` (once, after :class:`Ready`), :class:`Call`,
:class:`Cancel`, :class:`Taken`, :class:`Release`, :class:`OpenStream`, :class:`Credit`,
:class:`CloseStream`, :class:`Stop`.

What a call of :data:`HANDED_OVER` made in the child (a session) stays the child's until the parent
takes it (:class:`Taken`: its value loaded and a caller got it) or hands it back (:class:`Release`: it
does not load here, or nobody waits for it any more); the child then releases it itself
(``close_session`` with its own value). One the child cannot even send, or one made although the parent
cancelled its call, the child releases at once.

Child to parent: :class:`Ready` or :class:`LoadFailed` (the hello), then
:class:`Running` or :class:`RunFailed`, :class:`Result`, :class:`SessionEvent`,
:class:`ChunkOut`, :class:`StreamEnd`, :class:`Heartbeat`, :class:`Stopped`.

Made in the parent (never sent): :class:`ChildExited`, :class:`ProtocolError`.

Nothing heavy is imported here: the child imports the pipeline's own modules
(torch, say) only when it loads the pipeline.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import traceback
import types
from typing import Any, ClassVar

import attrs

from engine.worker_wire import UnloadableValue as Unreadable
from engine.worker_wire import load_value

__all__ = [
    "CREDIT_WINDOW", "HANDED_OVER", "Call", "Cancel", "ChildExited", "ChunkOut", "CloseStream", "Credit",
    "ErrorInfo", "LoadFailed", "OpenStream", "ProtocolError", "Ready", "Release", "Result", "Run", "RunFailed",
    "Running", "Sealed", "SessionEvent", "Stop", "Stopped", "StreamEnd", "Taken", "Unreadable", "dumps", "dumps_readable", "error_info",
    "loads", "seal", "unseal",
]

CREDIT_WINDOW = 2  # chunks a stream may send ahead of what the parent's consumer has taken

CALL_METHODS = frozenset({"check_options", "create_session", "push_control", "close_session"})
STREAM_METHODS = frozenset({"chunks", "stream"})
#: calls whose value owns something in the child, and the call that releases it there
HANDED_OVER = {"create_session": "close_session"}


@attrs.frozen
class ErrorInfo:
    """An exception raised in the child: its type, message, traceback, (for a ControlRejected) its reason and
    (for a PipelineContractError, a bug of the pipeline's) its detail."""

    type_name: str
    message: str
    traceback: str
    reject_reason: str | None = None
    contract_detail: str | None = None


def error_info(exc: BaseException) -> ErrorInfo:
    """Describe ``exc`` for the parent; call it inside the ``except`` block (for the traceback)."""
    from pipelines.contract import ControlRejected, PipelineContractError

    kind = type(exc)
    reason = getattr(exc, "reason", None)
    return ErrorInfo(
        f"{kind.__module__}.{kind.__qualname__}", str(exc), traceback.format_exc(),
        reason if isinstance(exc, ControlRejected) and isinstance(reason, str) else None,
        exc.detail if isinstance(exc, PipelineContractError) else None,
    )


# -- parent to child ---------------------------------------------------------------------------


@attrs.frozen
class Run:
    """Enter the service's ``running()``, after ``configure_session_capacity(capacity)`` when given;
    ``release_timeout``: how long the child's own release of what the parent never took may take."""

    capacity: int | None
    release_timeout: float = 45.0


@attrs.frozen
class Call:
    """Call ``method(*args)`` (one of :data:`CALL_METHODS`); ``wants_events`` forwards on_event."""

    call_id: int
    method: str
    args: tuple
    wants_events: bool = False


@attrs.frozen
class Cancel:
    """Cancel a pending call (the parent no longer waits for it)."""

    call_id: int


@attrs.frozen
class Taken:
    """The parent took the value of call ``call_id`` (of :data:`HANDED_OVER`): the child forgets it."""

    call_id: int


@attrs.frozen
class Release:
    """The parent could not take the value of call ``call_id`` (it does not load there, or nobody waited for it):
    the child releases it itself."""

    call_id: int


@attrs.frozen
class OpenStream:
    """Start a chunk stream (``chunks(session_id)`` or ``stream(config)``); it may run CREDIT_WINDOW ahead."""

    stream_id: int
    method: str
    arg: Any


@attrs.frozen
class Credit:
    """The parent's consumer took ``n`` chunks of the stream: ``n`` more may be sent."""

    stream_id: int
    n: int = 1


@attrs.frozen
class CloseStream:
    """Stop the stream (the child answers with :class:`StreamEnd`)."""

    stream_id: int


@attrs.frozen
class Stop:
    """Leave ``running()`` and exit."""


# -- child to parent -----------------------------------------------------------------------------


@attrs.frozen
class Ready:
    """Hello: the pipeline is loaded; the child waits for :class:`Run`."""

    kind: str
    supports_timeline: bool
    pid: int
    offered_taken: tuple[str, ...] | None = None  # the offered settings get_service took (None: not known)
    #: the session inputs the service declares it takes (``pipelines.contract.inputs_taken``), so that the parent
    #: refuses a create that gives another without importing the pipeline
    inputs_taken: tuple[str, ...] = ("prompt", "image")


@attrs.frozen
class LoadFailed:
    """Hello: loading the pipeline failed; the child exits with code 1. ``options_refused``: its ``get_service``
    takes none of the options it was given (a new child would fail the same way)."""

    traceback: str
    options_refused: bool = False


@attrs.frozen
class Running:
    """Inside ``running()``; the memory report is taken at once (or the error taking it raised)."""

    report: Any
    error: ErrorInfo | None = None


@attrs.frozen
class RunFailed:
    """``configure_session_capacity`` or entering ``running()`` raised."""

    traceback: str


@attrs.frozen
class Result:
    """The outcome of a :class:`Call`: its value (:class:`Sealed`), or an :class:`ErrorInfo` when ``ok`` is false."""

    call_id: int
    ok: bool
    value: Any


@attrs.frozen
class SessionEvent:
    """An ``on_event`` callback of the session created by call ``call_id`` (the event :class:`Sealed`)."""

    call_id: int
    event: Sealed


@attrs.frozen
class ChunkOut:
    """One chunk of a stream (:class:`Sealed`)."""

    stream_id: int
    chunk: Sealed


@attrs.frozen
class StreamEnd:
    stream_id: int
    error: ErrorInfo | None = None


@attrs.frozen
class Heartbeat:
    """The child's trio loop is alive (sent every ``HEARTBEAT_PERIOD``; silence past the deadline is death)."""


@attrs.frozen
class Stopped:
    """Left ``running()``; ``traceback`` is the error leaving it raised, if any."""

    traceback: str | None = None


# -- made by the parent ----------------------------------------------------------------------------


@attrs.frozen
class ChildExited:
    code: int | None
    expected: bool
    cause: str | None = None


@attrs.frozen
class ProtocolError:
    reason: str


# -- encoding -----------------------------------------------------------------------------------------


def _mappingproxy(value: dict[Any, Any]) -> types.MappingProxyType:
    return types.MappingProxyType(value)


def _reduce_mappingproxy(value: types.MappingProxyType) -> tuple[Any, tuple[dict[Any, Any]]]:
    return _mappingproxy, (dict(value),)


class _WirePickler(pickle.Pickler):
    dispatch_table: ClassVar[dict[Any, Any]] = {**copyreg.dispatch_table, types.MappingProxyType: _reduce_mappingproxy}


def dumps(message: Any) -> bytes:
    """Pickle one message (contract objects hold ``MappingProxyType`` values, which plain pickle refuses)."""
    buffer = io.BytesIO()
    _WirePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


class _ReadablePickler(_WirePickler):
    """Refuses what the parent could not unpickle: objects of modules named ``foreign*``, which only the child has."""

    def __init__(self, file: io.BytesIO, foreign: str) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.foreign = foreign

    def reducer_override(self, obj: Any) -> Any:
        kind = obj if isinstance(obj, type | types.FunctionType) else type(obj)
        module = getattr(kind, "__module__", None)
        if isinstance(module, str) and module.startswith(self.foreign):
            raise pickle.PicklingError(
                f"{kind.__qualname__} is defined in the pipeline file itself, which the server process cannot import"
            )
        return NotImplemented


def dumps_readable(message: Any, *, foreign: str) -> bytes:
    """Like :func:`dumps`, but raise ``pickle.PicklingError`` for an object of a module whose name starts with
    ``foreign`` (the parent could not load it: said here, in the child, with the name of the class)."""
    buffer = io.BytesIO()
    _ReadablePickler(buffer, foreign).dump(message)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


# -- the pipeline's values, sealed apart from the messages that carry them --------------------------


class Sealed:
    """A value of the pipeline's (a chunk, a call's result, an event), pickled apart from its message, so that
    one the parent cannot load (a module only the child has, a ``__setstate__`` that raises) fails only the
    call or stream it belongs to; the message around it always loads.

    The parent's reader thread loads it (:func:`open_sealed`), as it loads the message, so the trio thread
    that takes the value does no unpickling of frames."""

    __slots__ = ("data", "_loaded")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._loaded: tuple[Any, Unreadable | None] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return Sealed, (self.data,)

    def load(self) -> None:
        """Load the value now (once): its value, or why it does not load, is kept for :func:`unseal`."""
        if self._loaded is None:
            try:
                self._loaded = (load_value(self.data), None)
            except Unreadable as exc:
                self._loaded = (None, exc)
            self.data = b""  # the bytes are not needed once loaded


def seal(value: Any, *, foreign: str | None = None) -> Sealed:
    """Pickle ``value`` on its own (refusing what is of a module named ``foreign*``, as :func:`dumps_readable`)."""
    return Sealed(dumps(value) if foreign is None else dumps_readable(value, foreign=foreign))


def open_sealed(message: Any) -> Any:
    """Load the sealed value a child's message carries (called on the reader thread); returns the message."""
    sealed = getattr(message, _SEALED_FIELDS.get(type(message), ""), None)
    if isinstance(sealed, Sealed):
        sealed.load()
    return message


def unseal(sealed: Sealed) -> Any:
    """The value, or :class:`Unreadable` saying what did not load (whatever loading it raised)."""
    sealed.load()
    assert sealed._loaded is not None
    value, error = sealed._loaded
    if error is not None:
        raise error
    return value


#: the field of each child message that holds a sealed value
_SEALED_FIELDS: dict[type, str] = {ChunkOut: "chunk", SessionEvent: "event", Result: "value", Running: "report"}
