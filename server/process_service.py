"""A pipeline service in a child process, behind a proxy with the same contract.

``worker-mode process`` runs each model worker's service in its own
*spawn* child, so the API process never imports the model (torch, say)::

    service = start_process_service("pipelines/toy_world", gpu_num=1)  # blocking: run it in a thread
    service.configure_session_capacity(4)      # optional, before running()
    async with service.running():              # the child enters the service's running()
        report = service.memory_report()       # taken by the child once running
        sid = await service.create_session(SessionConfig(), on_event=print)
        await service.push_control(sid, Control(ControlType.CONTROL_STATE, keys={"w"}))
        async for chunk in service.chunks(sid):
            ...

:func:`start_process_service` spawns the child, which loads the pipeline with
:func:`pipelines.loader.load_service` and reports its kind; it returns a
:class:`ProcessBidirectionalService` or a :class:`ProcessServerPushService`
(both :class:`ProcessService` s, and instances of the matching contract class).
The wire protocol is described in :mod:`server.process_service_child`.

Threads and trio: one *monitor* thread per service spawns the child (Linux's
parent-death signal fires when the spawning thread ends, so it must outlive the
child), reads the pipe, waits on the child's sentinel, and reaps it. Once
``running()`` is entered, every message is handed to the trio run that entered
it (through its trio token); all proxy state lives on that trio thread.

Failure: when the child dies or its pipe closes unexpectedly, within a fraction
of a second every pending call and chunk stream, and every later call, fails
with :class:`ProcessServiceFailed` ("... exited unexpectedly with code N"), the
body of ``running()`` is cancelled and ``running()`` raises that error (as an
in-process service's ``running()`` raises when its actors die).
``ControlRejected`` raised in the child is raised again as ``ControlRejected``
with the same reason; any other exception as :class:`RemoteServiceError`
carrying the child's traceback text.

Chunk streams are credit-based: the child pulls at most ``CREDIT_WINDOW``
chunks ahead of what the parent's consumer has taken, so a slow consumer holds
the service back instead of letting chunks pile up.

Closing is bounded: leaving ``running()`` (or :meth:`ProcessService.close`)
asks the child to leave the service's ``running()`` and exit, then after
``close_timeout`` seconds terminates it, then kills it ``kill_grace`` later;
it returns once the child is reaped and every pipe is closed.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    EventSink,
    MemoryReport,
    ServerPushService,
    SessionConfig,
)

from .process_service_child import CREDIT_WINDOW
from .service_process import (
    ProcessServiceClosed,
    ProcessServiceError,
    ProcessServiceFailed,
    ProcessServiceStartError,
    RemoteServiceError,
    ServiceProcess,
    _remote_error,
)

__all__ = [
    "CREDIT_WINDOW",
    "ProcessBidirectionalService",
    "ProcessServerPushService",
    "ProcessService",
    "ProcessServiceClosed",
    "ProcessServiceError",
    "ProcessServiceFailed",
    "ProcessServiceStartError",
    "RemoteServiceError",
    "start_process_service",
]

log = logging.getLogger("chunkline.process_service")


_names = itertools.count(1)


class _Pending:
    __slots__ = ("error", "event", "method", "ok", "payload")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = trio.Event()
        self.ok = False
        self.payload: Any = None
        self.error: BaseException | None = None


class _ProxyStream:
    """The parent's end of one chunk stream (``chunks()`` or ``stream()``)."""

    def __init__(self, service: ProcessService, stream_id: int, method: str) -> None:
        self._service = service
        self._id = stream_id
        self._method = method
        self._buffer: deque[Chunk] = deque()
        self._ended = False  # the child said stream_end, or the service failed or stopped
        self._error: BaseException | None = None
        self._closing = False  # the consumer closed or abandoned it
        self._changed = trio.Event()

    # called from the service's message handler
    def _on_chunk(self, chunk: Chunk) -> None:
        if not self._closing:
            self._buffer.append(chunk)
        self._wake()

    def _on_end(self, error: BaseException | None) -> None:
        self._ended = True
        if error is not None and self._error is None:
            self._error = error
        self._wake()

    def _on_failure(self, error: BaseException) -> None:
        self._buffer.clear()
        self._ended = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # the async iterator
    def __aiter__(self) -> _ProxyStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._closing:
            raise StopAsyncIteration
        try:
            while not self._buffer and not self._ended:
                await self._changed.wait()
        except BaseException:
            self._abandon()  # like an async generator: an exception out of it ends the stream
            raise
        if self._buffer:
            chunk = self._buffer.popleft()
            if not self._ended:
                self._service._send_quiet(("credit", self._id, 1))
            return chunk
        self._closing = True
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    def _abandon(self) -> None:
        if not self._closing:
            self._closing = True
            self._buffer.clear()
            if not self._ended:
                self._service._send_quiet(("close_stream", self._id))

    async def aclose(self) -> None:
        """Stop the stream and wait until the child has closed its iterator."""
        self._abandon()
        while not self._ended:
            await self._changed.wait()


class ProcessService:
    """What both proxies share: the child, the message handler, calls, streams, running()."""

    kind: str

    def __init__(self, child: ServiceProcess, *, supports_timeline: bool = False) -> None:
        self._child = child
        self.supports_timeline = supports_timeline
        self._state = "loaded"  # -> starting -> running -> stopping -> stopped
        self._capacity: int | None = None
        self._failure: ProcessServiceFailed | None = None
        self._run_error: str | None = None
        self._stop_error: str | None = None
        self._report: MemoryReport | None = None
        self._report_error: tuple | None = None
        self._pending: dict[int, _Pending] = {}
        self._abandoned: dict[int, str] = {}  # call id -> method, for calls cancelled while pending
        self._streams: dict[int, _ProxyStream] = {}
        self._sinks: dict[int, EventSink] = {}
        self._session_calls: dict[str, int] = {}  # session id -> the create call its events carry
        self._ids = itertools.count(1)
        self._started: trio.Event | None = None
        self._body: trio.CancelScope | None = None
        # a proxy dropped before running() (e.g. its worker refused the configuration) stops its child
        weakref.finalize(self, child.request_stop)

    # -- facts ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._child.name

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._child.pid

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it has been reaped."""
        return self._child.exitcode

    @property
    def failure(self) -> ProcessServiceFailed | None:
        return self._failure

    def memory_report(self) -> MemoryReport | None:
        """The report the child took as soon as it was inside ``running()``."""
        if self._report_error is not None:
            raise _remote_error("memory_report", self._report_error)
        return self._report

    def close(self) -> None:
        """Stop a child whose ``running()`` was never entered (blocking, bounded; idempotent)."""
        if self._state in ("starting", "running", "stopping"):
            raise RuntimeError("close() is for a service that is not running; leave running() instead")
        self._state = "stopped"
        self._child.close()

    # -- running -------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ProcessService]:
        """The child enters the service's ``running()`` for the life of the block."""
        if self._state != "loaded":
            raise RuntimeError(f"{self.name}: running() is entered once (the service is {self._state})")
        self._state = "starting"
        self._started = trio.Event()
        for message in self._child.attach(trio.lowlevel.current_trio_token(), self._on_message):
            self._on_message(message)
        try:
            with trio.CancelScope() as self._body:
                self._send_quiet(("run", self._capacity))
                await self._started.wait()
                if self._failure is not None:
                    raise self._failure
                if self._run_error is not None:
                    raise ProcessServiceStartError(
                        f"{self.name}: the service's running() failed in the child process:\n"
                        f"--- child traceback ---\n{self._run_error}"
                    )
                self._state = "running"
                yield self
        finally:
            with trio.CancelScope(shield=True):
                await self._shutdown()
        if self._failure is not None:
            raise self._failure
        if self._stop_error is not None:
            raise RemoteServiceError(
                f"{self.name}: leaving the service's running() failed in the child process:\n"
                f"--- child traceback ---\n{self._stop_error}",
                method="running", remote_type="", remote_message="", remote_traceback=self._stop_error,
            )

    async def _shutdown(self) -> None:
        if self._state != "stopped":
            self._state = "stopping"
            self._child.request_stop()
            await trio.to_thread.run_sync(self._child.wait_closed)
            # the child's last messages and its exit were handed to trio before wait_closed returned,
            # so they have been handled (run_sync_soon is first in, first out)
        self._state = "stopped"
        self._child.detach()
        self._abort(ProcessServiceClosed(f"{self.name} stopped"))

    def _abort(self, error: ProcessServiceError) -> None:
        pending, self._pending = list(self._pending.values()), {}
        for call in pending:
            call.error = error
            call.event.set()
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream._on_failure(error)
        self._sinks.clear()
        self._session_calls.clear()
        if self._started is not None:
            self._started.set()

    def _fail(self, reason: str) -> None:
        if self._failure is not None or self._state in ("stopping", "stopped"):
            return
        self._failure = ProcessServiceFailed(f"{self.name} failed: {reason}")
        log.error("%s", self._failure)
        self._abort(self._failure)
        if self._body is not None:
            self._body.cancel()

    # -- messages (on the trio thread) ------------------------------------------------------------

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "chunk":
            stream = self._streams.get(message[1])
            if stream is not None:
                stream._on_chunk(message[2])
        elif kind == "result":
            self._on_result(message[1], message[2], message[3])
        elif kind == "event":
            sink = self._sinks.get(message[1])
            if sink is not None:
                try:
                    sink(message[2])
                except Exception:
                    log.exception("%s: an on_event callback raised", self.name)
        elif kind == "stream_end":
            stream = self._streams.pop(message[1], None)
            if stream is not None:
                error = message[2]
                stream._on_end(None if error is None else _remote_error(stream._method, error))
        elif kind == "running":
            self._report, self._report_error = message[1], message[2]
            if self._started is not None:
                self._started.set()
        elif kind == "run_failed":
            self._run_error = message[1]
            if self._started is not None:
                self._started.set()
        elif kind == "stopped":
            self._stop_error = message[1]
        elif kind == "exit":
            code = message[1]
            if self._state in ("stopping", "stopped") and code != 0:
                log.warning("%s: the service process (pid %s) was stopped with exit code %s", self.name, self.pid, code)
            self._fail(f"the service process (pid {self.pid}) exited unexpectedly with code {code}")
        elif kind == "protocol_error":
            self._fail(message[1])
            self._child.kill()
        else:
            log.warning("%s: unknown message %r from the child", self.name, kind)

    def _on_result(self, call_id: int, ok: bool, payload: Any) -> None:
        call = self._pending.pop(call_id, None)
        if call is None:
            method = self._abandoned.pop(call_id, None)
            self._sinks.pop(call_id, None)
            if method == "create_session" and ok:  # created after its caller gave up: close it
                self._start_call("close_session", (payload,))
            return
        call.ok, call.payload = ok, payload
        call.event.set()

    # -- calls ------------------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._state != "running":
            raise ProcessServiceClosed(f"{self.name} is not running (it is {self._state}); use `async with running():`")

    def _send_quiet(self, message: tuple) -> None:
        self._child.send(message)  # a failed send means the child is gone: the monitor reports it

    def _start_call(self, method: str, args: tuple, on_event: EventSink | None = None) -> tuple[int, _Pending]:
        call_id = next(self._ids)
        call = _Pending(method)
        self._pending[call_id] = call
        if on_event is not None:
            self._sinks[call_id] = on_event
        try:
            self._send_quiet(("call", call_id, method, args, on_event is not None))
        except BaseException:  # the arguments do not pickle
            self._pending.pop(call_id, None)
            self._sinks.pop(call_id, None)
            raise
        return call_id, call

    async def _call(self, method: str, args: tuple, on_event: EventSink | None = None) -> Any:
        self._check_running()
        call_id, call = self._start_call(method, args, on_event)
        try:
            await call.event.wait()
        except BaseException:
            if self._pending.pop(call_id, None) is not None:  # cancelled while the child works on it
                self._abandoned[call_id] = method
                self._send_quiet(("cancel", call_id))
            raise
        if call.error is not None:
            raise call.error
        if not call.ok:
            self._sinks.pop(call_id, None)
            raise _remote_error(method, call.payload)
        if method == "create_session" and on_event is not None:
            self._session_calls[call.payload] = call_id
        return call.payload

    def _open_stream(self, method: str, arg: Any) -> _ProxyStream:
        stream_id = next(self._ids)
        stream = _ProxyStream(self, stream_id, method)
        try:
            self._check_running()
        except ProcessServiceError as exc:
            stream._on_failure(exc)
            return stream
        self._streams[stream_id] = stream
        try:
            self._send_quiet(("open", stream_id, method, arg))
        except BaseException:  # the argument does not pickle
            del self._streams[stream_id]
            raise
        return stream


class ProcessBidirectionalService(ProcessService, BidirectionalService):
    """A :class:`BidirectionalService` running in a child process."""

    kind = "bidirectional"

    def configure_session_capacity(self, limit: int) -> None:
        """Recorded here and applied in the child before it enters the service's ``running()``."""
        if self._state != "loaded":
            raise RuntimeError("configure_session_capacity must be called before running()")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"session capacity must be an int >= 1, got {limit!r}")
        self._capacity = limit

    async def create_session(self, config: SessionConfig, *, on_event: EventSink | None = None) -> str:
        return await self._call("create_session", (config,), on_event)

    async def push_control(self, session_id: str, control: Control) -> None:
        await self._call("push_control", (session_id, control))

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        return self._open_stream("chunks", session_id)

    async def close_session(self, session_id: str) -> None:
        await self._call("close_session", (session_id,))
        call_id = self._session_calls.pop(session_id, None)
        if call_id is not None:
            self._sinks.pop(call_id, None)


class ProcessServerPushService(ProcessService, ServerPushService):
    """A :class:`ServerPushService` running in a child process."""

    kind = "server_push"

    def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        """The stream's chunks; the child's errors (bad options, a stream already open) come at the first chunk."""
        return self._open_stream("stream", config)


def start_process_service(
    pipeline: str | os.PathLike[str],
    *,
    startup_timeout: float = 600.0,
    close_timeout: float = 10.0,
    kill_grace: float = 2.0,
    parent_death_signal: bool = True,
    name: str | None = None,
    **options: Any,
) -> ProcessBidirectionalService | ProcessServerPushService:
    """Spawn a child that loads ``pipeline`` with ``load_service(pipeline, **options)``; return its proxy.

    Blocking (call it from a thread under trio): returns once the child has
    loaded the pipeline and reported its kind, or raises
    :class:`ProcessServiceStartError` (with the child's traceback) after the
    child has exited. ``options`` must pickle.
    """
    name = name or f"process-service-{next(_names)}"
    child = ServiceProcess(
        str(Path(pipeline)), dict(options), name=name, close_timeout=close_timeout, kill_grace=kill_grace,
        parent_death_signal=parent_death_signal,
    )
    kind, supports_timeline = child.start(startup_timeout)
    if kind == BidirectionalService.kind:
        return ProcessBidirectionalService(child, supports_timeline=supports_timeline)
    if kind == ServerPushService.kind:
        return ProcessServerPushService(child)
    child.close()
    raise ProcessServiceStartError(f"{name}: the child reported an unknown service kind {kind!r}")
