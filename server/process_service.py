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
import multiprocessing
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import Any

import trio

from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    ControlRejected,
    EventSink,
    MemoryReport,
    ServerPushService,
    SessionConfig,
)

from .process_service_child import CREDIT_WINDOW, child_main, dumps, loads

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

MONITOR_POLL = 0.1  # seconds between the monitor's checks of stop deadlines
PIPE_CLOSED_GRACE = 1.0  # seconds a child that closed its pipe gets to exit before it is killed

_names = itertools.count(1)


class ProcessServiceError(RuntimeError):
    """Base of the process service's errors."""


class ProcessServiceStartError(ProcessServiceError):
    """The child could not load the pipeline (with its traceback), exited, or was not ready in time."""


class ProcessServiceFailed(ProcessServiceError):
    """The child died or its pipe closed unexpectedly: every pending and later call fails with this."""


class ProcessServiceClosed(ProcessServiceError):
    """The service is not running (before ``running()``, or after it was left)."""


class RemoteServiceError(ProcessServiceError):
    """The service raised in the child; ``remote_traceback`` is the child's traceback text."""

    def __init__(self, message: str, *, method: str, remote_type: str, remote_message: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback


def _remote_error(method: str, payload: tuple[str, str, str, str | None]) -> Exception:
    kind, message, tb, reason = payload
    if reason is not None:
        return ControlRejected(reason)
    return RemoteServiceError(
        f"{method}() raised {kind}: {message}\n--- child traceback ---\n{tb}",
        method=method, remote_type=kind, remote_message=message, remote_traceback=tb,
    )


# -- the child process (thread side) ---------------------------------------------------------


class _ChildProcess:
    """Spawns, watches and reaps one service process; thread-safe; knows nothing of trio state."""

    def __init__(
        self,
        pipeline: str,
        options: dict[str, Any],
        *,
        name: str,
        close_timeout: float,
        kill_grace: float,
        parent_death_signal: bool,
    ) -> None:
        self.pipeline = pipeline
        self.options = options
        self.name = name
        self.close_timeout = close_timeout
        self.kill_grace = kill_grace
        self.parent_death_signal = parent_death_signal
        self.pid: int | None = None
        self.exitcode: int | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._conn_closed = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._handler: Callable[[tuple], None] | None = None
        self._early: list[tuple] = []
        self._detached = False
        self._startup: tuple | None = None
        self._ready = threading.Event()
        self._exited = threading.Event()
        self._stop_at: float | None = None
        self._kill_now = False
        self._monitor = threading.Thread(target=self._run, name=f"{name}-monitor", daemon=True)

    # -- start ---------------------------------------------------------------------------

    def start(self, timeout: float) -> tuple[str, bool]:
        """Spawn the child and wait until it reports its kind; raises ProcessServiceStartError."""
        self._monitor.start()
        if not self._ready.wait(timeout):
            self.kill()
            self.wait_closed()
            raise ProcessServiceStartError(f"{self.name}: loading {self.pipeline!r} did not finish within {timeout:g}s")
        outcome = self._startup
        assert outcome is not None
        if outcome[0] == "ready":
            return str(outcome[1]), bool(outcome[2])
        self.close()
        if outcome[0] == "startup_failed":
            raise ProcessServiceStartError(
                f"{self.name}: loading {self.pipeline!r} in the child process failed:\n--- child traceback ---\n{outcome[1]}"
            )
        if outcome[0] == "spawn_failed":
            raise ProcessServiceStartError(f"{self.name}: could not start the child process: {outcome[1]}")
        raise ProcessServiceStartError(
            f"{self.name}: the child process (pid {self.pid}) exited during startup with code {self.exitcode}"
        )

    # -- the monitor thread ------------------------------------------------------------------

    def _run(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        config = {
            "pipeline": self.pipeline,
            "options": self.options,
            "parent_pid": os.getpid(),
            "parent_death_signal": self.parent_death_signal,
        }
        parent_conn = child_conn = None
        try:
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            # not daemonic: the service may start worker processes of its own (process
            # placement); its lifetime is still bound to ours (parent-death signal, watchdog,
            # and the bounded stop in close())
            proc = ctx.Process(target=child_main, args=(child_conn, config), name=self.name, daemon=False)
            proc.start()
        except BaseException as exc:
            for conn in (parent_conn, child_conn):
                if conn is not None:
                    conn.close()
            self._startup = ("spawn_failed", repr(exc))
            self._ready.set()
            self._exited.set()
            return
        child_conn.close()
        self._proc, self._conn, self.pid = proc, parent_conn, proc.pid
        try:
            self._watch(proc, parent_conn)
        finally:
            proc.join()  # its sentinel fired (or it was killed): this does not block long
            with self._send_lock:
                self._conn_closed = True
                parent_conn.close()
            self.exitcode = proc.exitcode
            proc.close()
            if not self._ready.is_set():
                self._startup = ("exited", self.exitcode)
                self._ready.set()
            self._deliver(("exit", self.exitcode))
            self._exited.set()

    def _watch(self, proc: Any, conn: Any) -> None:
        conn_open = True
        pipe_closed_at: float | None = None
        terminated = killed = False
        while True:
            waitables = [proc.sentinel, conn] if conn_open else [proc.sentinel]
            ready = wait_ready(waitables, MONITOR_POLL)
            if conn_open and conn in ready:
                conn_open = self._read(conn)
            if proc.sentinel in ready:
                while conn_open and conn.poll():  # messages sent just before it exited
                    conn_open = self._read(conn)
                return
            now = time.monotonic()
            if not conn_open and pipe_closed_at is None:
                pipe_closed_at = now
            with self._lock:
                stop_at, kill_now = self._stop_at, self._kill_now
            if kill_now and not killed:
                proc.kill()
                killed = True
            elif pipe_closed_at is not None and stop_at is None and now - pipe_closed_at > PIPE_CLOSED_GRACE and not killed:
                proc.kill()  # it closed its pipe but lives on: it can serve nobody
                killed = True
            elif stop_at is not None:
                if now - stop_at > self.close_timeout and not terminated:
                    proc.terminate()
                    terminated = True
                if now - stop_at > self.close_timeout + self.kill_grace and not killed:
                    proc.kill()
                    killed = True

    def _read(self, conn: Any) -> bool:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return False  # the child is exiting; its sentinel says how
        try:
            message = loads(data)
        except Exception as exc:
            message = ("protocol_error", f"a message from the child could not be read: {exc!r}")
        if not self._ready.is_set() and message[0] in ("ready", "startup_failed"):
            self._startup = message
            self._ready.set()
            return True
        self._deliver(message)
        return True

    def _deliver(self, message: tuple) -> None:
        with self._lock:
            if self._detached:
                return
            token, handler = self._token, self._handler
            if token is None or handler is None:
                self._early.append(message)
                return
        try:
            token.run_sync_soon(handler, message)
        except trio.RunFinishedError:
            pass

    # -- used from the trio thread (or any thread) ----------------------------------------------

    def attach(self, token: trio.lowlevel.TrioToken, handler: Callable[[tuple], None]) -> list[tuple]:
        """Deliver messages to ``handler`` on the trio run of ``token``; returns those that came before."""
        with self._lock:
            self._token, self._handler = token, handler
            early, self._early = self._early, []
        return early

    def detach(self) -> None:
        with self._lock:
            self._detached = True
            self._token = self._handler = None
            self._early = []

    def send(self, message: tuple) -> bool:
        """Send a message; False when the child is gone (the monitor reports how)."""
        data = dumps(message)
        with self._send_lock:
            if self._conn_closed or self._conn is None:
                return False
            try:
                self._conn.send_bytes(data)
            except OSError:
                return False
        return True

    def request_stop(self) -> None:
        """Ask the child to stop (non-blocking); it is terminated, then killed, if it does not."""
        with self._lock:
            if self._stop_at is not None:
                return
            self._stop_at = time.monotonic()
        self.send(("stop",))

    def kill(self) -> None:
        with self._lock:
            self._kill_now = True
            if self._stop_at is None:
                self._stop_at = time.monotonic()

    def wait_closed(self) -> None:
        """Wait until the child is reaped and the pipe closed (bounded once a stop was requested)."""
        bound = self.close_timeout + 3 * self.kill_grace + 5.0
        if not self._exited.wait(bound):  # pragma: no cover - kill did not take
            log.error("%s: child pid %s still not reaped after %gs", self.name, self.pid, bound)
        self._monitor.join(bound)

    def close(self) -> None:
        """Stop the child and wait for it (bounded); idempotent; blocking."""
        if self._monitor.ident is None:
            return
        self.request_stop()
        self.wait_closed()


# -- the proxies (trio side) -------------------------------------------------------------------------


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

    def __init__(self, child: _ChildProcess, *, supports_timeline: bool = False) -> None:
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
    child = _ChildProcess(
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
