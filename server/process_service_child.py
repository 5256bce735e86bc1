"""The child side of :mod:`server.process_service`: one pipeline service in its own process.

The parent spawns :func:`child_main` (a *spawn* context process) with its end of
a duplex pipe and a plain config dict. The child arranges to die with its
parent (Linux parent-death signal plus a watchdog thread, from
:mod:`engine.worker_child`), loads the pipeline with
:func:`pipelines.loader.load_service`, reports its kind, and waits. When the
parent's proxy enters ``running()`` the child calls
``configure_session_capacity`` (when told a limit), enters
``async with service.running():`` inside ``trio.run`` and serves requests, one
trio task each, until it is told to stop or its pipe closes; then it leaves
``running()`` and exits.

Every message is a tuple, pickled by :func:`dumps` (a pickler that also handles
``MappingProxyType``, which contract objects hold) and sent with
``send_bytes``. Parent to child::

    ("run", capacity_limit_or_None)        enter running() (once, after "ready")
    ("call", call_id, method, args, wants_events)
                                           method: create_session | push_control | close_session
    ("cancel", call_id)                    cancel a pending call
    ("open", stream_id, "chunks" | "stream", session_id_or_config)
                                           start a chunk stream; it may run CREDIT_WINDOW chunks ahead
    ("credit", stream_id, n)               the parent's consumer took n chunks: n more may be sent
    ("close_stream", stream_id)            stop the stream (the child answers with "stream_end")
    ("stop",)                              leave running() and exit

Child to parent::

    ("ready", kind, supports_timeline, pid)   loaded; waiting for "run"
    ("startup_failed", traceback_text)        loading failed; the child exits with code 1
    ("running", memory_report, error_or_None) inside running(); the report is taken at once
    ("run_failed", traceback_text)            configure or entering running() raised
    ("result", call_id, ok, value_or_error)   error: (type_name, message, traceback_text, reject_reason)
    ("event", call_id, ServiceEvent)          an on_event callback of the session created by call_id
    ("chunk", stream_id, Chunk)
    ("stream_end", stream_id, error_or_None)
    ("stopped", traceback_text_or_None)       left running() (with the error it raised, if any)

Nothing heavy is imported here: the pipeline imports what it needs (torch, say)
when it is loaded, in the child only.
"""

from __future__ import annotations

import copyreg
import io
import logging
import math
import os
import pickle
import queue
import signal
import threading
import traceback
import types
from typing import Any, ClassVar

import trio

from engine.worker_child import (
    PARENT_GONE_EXIT_CODE,
    _set_parent_death_signal,
    _watch_parent,
)

__all__ = ["CREDIT_WINDOW", "SENDER_FLUSH_TIMEOUT", "child_main", "dumps", "loads"]

log = logging.getLogger("chunkline.process_service.child")

CREDIT_WINDOW = 2  # chunks a stream may send ahead of what the parent's consumer has taken
SENDER_FLUSH_TIMEOUT = 10.0  # seconds the child waits for its last messages to be written


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


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def _error_payload(exc: BaseException) -> tuple[str, str, str, str | None]:
    """(type name, message, traceback text, ControlRejected reason or None); call inside ``except``."""
    kind = type(exc)
    reason = getattr(exc, "reason", None)
    from pipelines.contract import ControlRejected

    return (
        f"{kind.__module__}.{kind.__qualname__}",
        str(exc),
        traceback.format_exc(),
        reason if isinstance(exc, ControlRejected) and isinstance(reason, str) else None,
    )


def child_main(conn: Any, config: dict[str, Any]) -> None:
    """Entry point of the service process (the target of a spawn-context Process)."""
    # the parent decides when the service stops: Ctrl-C or a SIGTERM sent to the whole process
    # group (a terminal, `timeout`, a container runtime) must not kill the model under live sessions;
    # the parent drains them and then stops this process (and SIGKILL on parent death still applies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_pid = config["parent_pid"]
    if config.get("parent_death_signal", True):
        _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(PARENT_GONE_EXIT_CODE)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()

    try:
        from pipelines.loader import load_service

        service = load_service(config["pipeline"], **config["options"])
    except BaseException:
        _send_now(conn, ("startup_failed", traceback.format_exc()))
        raise SystemExit(1) from None
    _send_now(conn, ("ready", service.kind, bool(getattr(service, "supports_timeline", False)), os.getpid()))
    try:
        message = loads(conn.recv_bytes())
    except (EOFError, OSError):  # the parent went away before running
        return
    if message[0] != "run":  # "stop" before running(): nothing was started
        return
    _Server(conn, service).serve(message[1])


def _send_now(conn: Any, message: tuple) -> None:
    try:
        conn.send_bytes(dumps(message))
    except (EOFError, OSError):
        pass


class _ChildStream:
    __slots__ = ("changed", "credits", "scope")

    def __init__(self) -> None:
        self.credits = CREDIT_WINDOW
        self.changed = trio.lowlevel.ParkingLot()
        self.scope = trio.CancelScope()


class _Server:
    """Serves one running service: a reader thread feeds trio, a sender thread writes the pipe."""

    def __init__(self, conn: Any, service: Any) -> None:
        self.conn = conn
        self.service = service
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.calls: dict[int, trio.CancelScope] = {}
        self.streams: dict[int, _ChildStream] = {}
        self.nursery: trio.Nursery | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.inbox: trio.MemorySendChannel[tuple] | None = None

    # -- threads -------------------------------------------------------------------

    def serve(self, capacity: int | None) -> None:
        sender = threading.Thread(target=self._send_loop, name="process-service-sender", daemon=True)
        sender.start()
        try:
            trio.run(self._main, capacity)
        finally:
            self.outbox.put(None)
            sender.join(SENDER_FLUSH_TIMEOUT)

    def _send_loop(self) -> None:
        while True:
            data = self.outbox.get()
            if data is None:
                return
            try:
                self.conn.send_bytes(data)
            except (EOFError, OSError):
                return  # the parent is gone; the reader sees it too and stops the service

    def _recv_loop(self) -> None:
        assert self.token is not None and self.inbox is not None
        while True:
            try:
                message = loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                message = ("stop",)  # the parent closed its end: stop
            try:
                self.token.run_sync_soon(self.inbox.send_nowait, message)
            except trio.RunFinishedError:
                return
            if message[0] == "stop":
                return

    def post(self, message: tuple) -> None:
        """Queue a message for the parent (pickled here, so a pickling error is the poster's)."""
        self.outbox.put(dumps(message))

    # -- trio ------------------------------------------------------------------------

    async def _main(self, capacity: int | None) -> None:
        from pipelines.contract import BidirectionalService

        self.token = trio.lowlevel.current_trio_token()
        self.inbox, inbox = trio.open_memory_channel[tuple](math.inf)
        threading.Thread(target=self._recv_loop, name="process-service-reader", daemon=True).start()
        service = self.service
        entered = False
        try:
            if capacity is not None and isinstance(service, BidirectionalService):
                service.configure_session_capacity(capacity)
            async with service.running():
                entered = True
                self._post_report()
                async with trio.open_nursery() as nursery:
                    self.nursery = nursery
                    async for message in inbox:
                        if message[0] == "stop":
                            break
                        self._dispatch(message)
                    nursery.cancel_scope.cancel()
        except Exception:
            self.post(("stopped" if entered else "run_failed", traceback.format_exc()))
            return
        self.post(("stopped", None))

    def _post_report(self) -> None:
        try:
            report = self.service.memory_report() if hasattr(self.service, "memory_report") else None
            self.post(("running", report, None))
        except Exception as exc:
            self.post(("running", None, _error_payload(exc)))

    def _dispatch(self, message: tuple) -> None:
        assert self.nursery is not None
        kind = message[0]
        if kind == "call":
            _, call_id, method, args, wants_events = message
            scope = trio.CancelScope()
            self.calls[call_id] = scope
            self.nursery.start_soon(self._call, scope, call_id, method, args, wants_events)
        elif kind == "cancel":
            scope = self.calls.get(message[1])
            if scope is not None:
                scope.cancel()
        elif kind == "open":
            _, stream_id, method, arg = message
            stream = self.streams[stream_id] = _ChildStream()
            self.nursery.start_soon(self._stream, stream, stream_id, method, arg)
        elif kind == "credit":
            stream = self.streams.get(message[1])
            if stream is not None:
                stream.credits += message[2]
                stream.changed.unpark_all()
        elif kind == "close_stream":
            stream = self.streams.get(message[1])
            if stream is not None:
                stream.scope.cancel()
        else:
            log.warning("process service child: unknown message %r", kind)

    async def _call(self, scope: trio.CancelScope, call_id: int, method: str, args: tuple, wants_events: bool) -> None:
        from pipelines.contract import BidirectionalService

        reply: tuple | None = None
        with scope:
            try:
                service = self.service
                if not isinstance(service, BidirectionalService):
                    raise TypeError(f"{type(service).__name__} is a {service.kind} service; it has no {method}()")
                if method == "create_session":
                    (config,) = args
                    sink = self._event_sink(call_id) if wants_events else None
                    value = await service.create_session(config, on_event=sink)
                elif method == "push_control":
                    value = await service.push_control(*args)
                elif method == "close_session":
                    value = await service.close_session(*args)
                else:
                    raise ValueError(f"unknown process service method {method!r}")
                reply = ("result", call_id, True, value)
            except Exception as exc:
                reply = ("result", call_id, False, _error_payload(exc))
        self.calls.pop(call_id, None)
        if reply is None:  # cancelled by the parent, which no longer waits
            return
        try:
            self.post(reply)
        except Exception as exc:  # the value does not pickle: say so instead
            self.post(("result", call_id, False, _error_payload(exc)))

    def _event_sink(self, call_id: int) -> Any:
        def forward(event: Any) -> None:
            try:
                self.post(("event", call_id, event))
            except Exception:
                log.exception("process service child: an event could not be forwarded")

        return forward

    async def _stream(self, stream: _ChildStream, stream_id: int, method: str, arg: Any) -> None:
        error = None
        iterator = None
        with stream.scope:
            try:
                if method == "chunks":
                    iterator = self.service.chunks(arg)
                elif method == "stream":
                    iterator = self.service.stream(arg)
                else:
                    raise ValueError(f"unknown stream method {method!r}")
                while True:
                    while stream.credits <= 0:
                        await stream.changed.park()
                    try:
                        chunk = await iterator.__anext__()
                    except StopAsyncIteration:
                        break
                    stream.credits -= 1
                    self.post(("chunk", stream_id, chunk))
            except Exception as exc:
                error = _error_payload(exc)
            finally:
                closer = getattr(iterator, "aclose", None)
                if closer is not None:
                    with trio.CancelScope(shield=True):
                        try:
                            await closer()
                        except Exception as exc:
                            error = error or _error_payload(exc)
        self.streams.pop(stream_id, None)
        self.post(("stream_end", stream_id, error))
