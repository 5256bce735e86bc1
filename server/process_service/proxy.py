"""The parent's side of a process service: proxies with the service contract.

:class:`ProcessService` holds the child's :class:`~server.process_service.link.ServiceLink`,
handles the child's messages on the trio thread that entered ``running()``, and
turns calls and chunk streams into wire messages. Its lifecycle is the table in
:mod:`states.service_child`; the failure that ended it is a recorded fact.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import trio

from engine.shm_names import remove_segments_of
from pipelines.contract import (
    BidirectionalService,
    Chunk,
    Control,
    EventSink,
    MemoryReport,
    PipelineContractError,
    ServerPushService,
    SESSION_INPUTS,
    SessionConfig,
)
from states.service_child import FAILS_WHEN_LOST, INSIDE_RUNNING, TAKES_CALLS, Event, ServiceChildMachine

from . import wire
from .deadlines import CallDeadlines
from .errors import (
    ProcessServiceCallTimeout,
    ProcessServiceClosed,
    ProcessServiceError,
    ProcessServiceFailed,
    ProcessServiceStartError,
    RemoteServiceError,
    last_line,
    remote_error,
)
from .link import ServiceLink
from .stream import ProxyStream

__all__ = ["ProcessBidirectionalService", "ProcessServerPushService", "ProcessService"]

log = logging.getLogger("chunkline.process_service")


#: seconds an abort waits for a killed service child to be gone before it takes the child's shared memory
KILL_WAIT = 2.0

class _Pending:
    __slots__ = ("error", "event", "method", "ok", "payload")

    def __init__(self, method: str) -> None:
        self.method = method
        self.event = trio.Event()
        self.ok = False
        self.payload: Any = None
        self.error: BaseException | None = None


class ProcessService:
    """What both proxies share: the child, the message handler, calls, streams, running()."""

    kind: str

    def __init__(
        self,
        link: ServiceLink,
        *,
        supports_timeline: bool = False,
        inputs_taken: frozenset[str] = frozenset(SESSION_INPUTS),
        call_deadlines: CallDeadlines | None = None,
    ) -> None:
        self._link = link
        self.supports_timeline = supports_timeline
        # the child's service's declaration (pipelines.contract.inputs_taken reads it back from the proxy)
        self.takes_prompt = "prompt" in inputs_taken
        self.takes_image = "image" in inputs_taken
        self.call_deadlines = call_deadlines or CallDeadlines()
        self._life = ServiceChildMachine()
        self._capacity: int | None = None
        self._failure: ProcessServiceFailed | None = None
        self._run_error: str | None = None
        self._stop_error: str | None = None
        self._report: MemoryReport | None = None
        self._report_error: wire.ErrorInfo | None = None
        self._pending: dict[int, _Pending] = {}
        self._abandoned: dict[int, str] = {}  # call id -> method, for calls cancelled while pending
        self._streams: dict[int, ProxyStream] = {}
        self._sinks: dict[int, EventSink] = {}
        self._session_calls: dict[str, int] = {}  # session id -> the create call its events carry
        self._broken_calls: dict[int, PipelineContractError] = {}  # create call -> why its session's events broke
        self._ids = itertools.count(1)
        self._started: trio.Event | None = None
        self._body: trio.CancelScope | None = None
        # a proxy dropped before running() (e.g. its worker refused the configuration) stops its child
        weakref.finalize(self, link.request_stop)

    # -- facts ------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._link.name

    @property
    def state(self) -> Any:
        """The proxy's lifecycle state (:mod:`states.service_child`)."""
        return self._life.state

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._link.pid

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it has been reaped."""
        return self._link.exitcode

    def kill_now(self) -> None:
        """For a server about to end at once (a second signal): SIGKILL the child unless it was reaped (then its pid
        may be another process's), and take what its channels hold in /dev/shm, which its death leaves there."""
        pid = self.pid
        if pid is None or self.exitcode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        # until it is gone: a segment it makes between the kill and its death would be left (it streamed on)
        with contextlib.suppress(ChildProcessError):
            gone_by = time.monotonic() + KILL_WAIT
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < gone_by:
                time.sleep(0.005)
        remove_segments_of(pid)

    @property
    def failure(self) -> ProcessServiceFailed | None:
        return self._failure

    def memory_report(self) -> MemoryReport | None:
        """The report the child took as soon as it was inside ``running()``."""
        if self._report_error is not None:
            raise remote_error("memory_report", self._report_error)
        return self._report

    def close(self) -> None:
        """Stop a child whose ``running()`` was never entered (blocking, bounded; idempotent)."""
        if self._life.state in INSIDE_RUNNING:
            raise RuntimeError("close() is for a service that is not running; leave running() instead")
        if self._life.can(Event.STOP):
            self._life.apply(Event.STOP)
        self._link.close()
        if self._life.can(Event.CLOSED):
            self._life.apply(Event.CLOSED)

    # -- running -------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ProcessService]:
        """The child enters the service's ``running()`` for the life of the block."""
        if not self._life.can(Event.RUN):
            raise RuntimeError(f"{self.name}: running() is entered once (the service is {self._life.state.value})")
        self._life.apply(Event.RUN)
        self._started = trio.Event()
        for message in self._link.attach(trio.lowlevel.current_trio_token(), self._on_message):
            self._on_message(message)
        try:
            with trio.CancelScope() as self._body:
                self._send_quiet(wire.Run(self._capacity, self.call_deadlines.close_session))
                deadline = self.call_deadlines.running
                with trio.move_on_after(deadline) as entering:
                    await self._started.wait()
                if entering.cancelled_caught:
                    raise ProcessServiceCallTimeout(self.name, "running", deadline)
                if self._failure is not None:
                    raise self._failure
                if self._run_error is not None:
                    self._life.apply(Event.RUN_FAILED)
                    said = last_line(self._run_error, "running() failed")  # the first line says it (health showed
                    raise ProcessServiceStartError(  # "... failed in the child process:" and no more)
                        f"{self.name}: the service's running() failed in the child process: {said}\n"
                        f"--- child traceback ---\n{self._run_error}",
                        child_error=said,
                    )
                self._life.apply(Event.ENTERED)
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
        if self._life.can(Event.STOP):
            self._life.apply(Event.STOP)
        self._link.request_stop()
        await trio.to_thread.run_sync(self._link.wait_closed)
        # the child's last messages and its exit were handed to trio before wait_closed returned,
        # so they have been handled (run_sync_soon is first in, first out)
        self._life.apply(Event.CLOSED)
        self._link.detach()
        self._abort(ProcessServiceClosed(f"{self.name} stopped"))

    def _abort(self, error: ProcessServiceError) -> None:
        pending, self._pending = list(self._pending.values()), {}
        for call in pending:
            call.error = error
            call.event.set()
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.on_failure(error)
        self._sinks.clear()
        self._session_calls.clear()
        self._broken_calls.clear()
        self._abandoned.clear()  # the child is gone: no late answer will come for them
        if self._started is not None:
            self._started.set()

    def _lost(self, reason: str) -> None:
        """The child exited or broke the protocol: a failure unless a stop was under way."""
        failing = self._life.state in FAILS_WHEN_LOST
        if self._life.can(Event.LOST):
            self._life.apply(Event.LOST)
        if not failing or self._failure is not None:
            return
        self._failure = ProcessServiceFailed(f"{self.name} failed: {reason}")
        log.error("%s", self._failure)
        self._abort(self._failure)
        if self._body is not None:
            self._body.cancel()

    # -- messages (on the trio thread) ------------------------------------------------------------

    def _on_message(self, message: Any) -> None:
        match message:
            case wire.ChunkOut(stream_id=stream_id, chunk=chunk):
                stream = self._streams.get(stream_id)
                if stream is not None:
                    stream.on_chunk(chunk)
            case wire.Result(call_id=call_id, ok=ok, value=value):
                self._on_result(call_id, ok, value)
            case wire.SessionEvent(call_id=call_id, event=event):
                sink = self._sinks.get(call_id)
                if sink is not None:
                    self._on_event(call_id, sink, event)
            case wire.StreamEnd(stream_id=stream_id, error=error):
                stream = self._streams.pop(stream_id, None)
                if stream is not None:
                    stream.on_end(None if error is None else remote_error(stream.method, error))
            case wire.Running(report=report, error=error):
                self._report_error = error
                try:
                    self._report = None if report is None else wire.unseal(report)
                except wire.Unreadable as exc:
                    self._report_error = wire.ErrorInfo(
                        "pipelines.contract.PipelineContractError", "", "",
                        contract_detail=f"the memory report from the worker process does not load in the server process: {exc}",
                    )
                if self._started is not None:
                    self._started.set()
            case wire.RunFailed(traceback=text):
                self._run_error = text
                if self._started is not None:
                    self._started.set()
            case wire.Heartbeat():
                pass  # the supervisor's deadline saw it; nothing else to do
            case wire.Stopped(traceback=text):
                self._stop_error = text
            case wire.ChildExited(code=code, expected=expected, cause=cause):  # its segments went as it was reaped
                if expected and code != 0:
                    log.warning("%s: the service process (pid %s) was stopped with exit code %s", self.name, self.pid, code)
                if self._stop_error is not None:  # the service left running() by itself, failing: that is why
                    self._lost(f"the service failed in its process (pid {self.pid}): {_last_line(self._stop_error)}")
                    return
                if cause:  # its supervisor killed it, and says why (it read "exited unexpectedly", as if from outside)
                    self._lost(f"the service process (pid {self.pid}) was killed (exit code {code}): {cause} (a "
                               f"service call that never awaits holds its loop, or the process was stopped)")
                    return
                self._lost(f"the service process (pid {self.pid}) exited unexpectedly with code {code}")
            case wire.ProtocolError(reason=reason):
                self._lost(reason)
                self._link.kill(reason)
            case _:
                log.warning("%s: unknown message %r from the child", self.name, type(message).__name__)

    def _on_event(self, call_id: int, sink: EventSink, sealed: wire.Sealed) -> None:
        """Hand a session's event to its sink; one that does not load fails that session's chunks (a pipeline bug)."""
        try:
            event = wire.unseal(sealed)
        except wire.Unreadable as exc:
            self._break_session(call_id, PipelineContractError(
                f"an event of the session from the worker process does not load in the server process: {exc}"))
            return
        try:
            sink(event)
        except PipelineContractError as exc:  # the sink refused it (one naming another session): as in-process
            self._break_session(call_id, exc)
        except Exception:
            log.exception("%s: an on_event callback raised", self.name)

    def _break_session(self, call_id: int, error: PipelineContractError) -> None:
        """The session made by call ``call_id`` fails its chunks with ``error`` (its pipeline's bug)."""
        self._broken_calls[call_id] = error
        for stream in self._streams.values():
            if stream.method == "chunks" and self._session_calls.get(stream.arg) == call_id:
                stream.on_broken(error)

    def _on_result(self, call_id: int, ok: bool, payload: Any) -> None:
        call = self._pending.pop(call_id, None)
        if call is None:
            method = self._abandoned.pop(call_id, None)
            self._sinks.pop(call_id, None)
            self._broken_calls.pop(call_id, None)
            if ok and method in wire.HANDED_OVER:  # made after its caller gave up: the child releases it
                self._send_quiet(wire.Release(call_id))
            return
        call.ok, call.payload = ok, payload
        call.event.set()

    # -- calls ------------------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._life.state not in TAKES_CALLS:
            raise ProcessServiceClosed(
                f"{self.name} is not running (it is {self._life.state.value}); use `async with running():`"
            )

    def _send_quiet(self, message: Any) -> None:
        self._link.send(message)  # a failed send means the child is gone: its exit is reported

    def _start_call(self, method: str, args: tuple, on_event: EventSink | None = None) -> tuple[int, _Pending]:
        call_id = next(self._ids)
        call = _Pending(method)
        self._pending[call_id] = call
        if on_event is not None:
            self._sinks[call_id] = on_event
        try:
            self._send_quiet(wire.Call(call_id, method, args, on_event is not None))
        except BaseException:  # the arguments do not pickle
            self._pending.pop(call_id, None)
            self._sinks.pop(call_id, None)
            raise
        return call_id, call

    async def _call(self, method: str, args: tuple, on_event: EventSink | None = None) -> Any:
        self._check_running()
        deadline = self.call_deadlines.of(method)
        call_id, call = self._start_call(method, args, on_event)
        try:
            with trio.move_on_after(deadline) as waiting:
                await call.event.wait()
        except BaseException:
            self._give_up(call_id, call)  # cancelled while the child works on it
            raise
        if waiting.cancelled_caught:
            self._give_up(call_id, call)
            raise ProcessServiceCallTimeout(self.name, method, deadline)
        if call.error is not None:
            raise call.error
        if not call.ok:
            self._sinks.pop(call_id, None)
            self._broken_calls.pop(call_id, None)
            raise remote_error(method, call.payload)
        try:
            value = wire.unseal(call.payload)
        except wire.Unreadable as exc:
            self._sinks.pop(call_id, None)
            self._broken_calls.pop(call_id, None)
            if method in wire.HANDED_OVER:  # nothing here can refer to what it made: the child releases it
                self._send_quiet(wire.Release(call_id))
            raise PipelineContractError(
                f"the value {method} returned in the worker process does not load in the server process: {exc}"
            ) from None
        if method in wire.HANDED_OVER:
            self._send_quiet(wire.Taken(call_id))  # the caller has it now (and releases it)
        if method == "create_session" and on_event is not None:
            self._session_calls[value] = call_id
        return value

    async def refused_input(self, options: Mapping[str, Any] | None,
                            image_size: tuple[int, int] | None) -> tuple[str, str] | None:
        """:func:`pipelines.input_checks.refused_input` of the child's service: a create's options and image in one call."""
        return await self._call("check_options", (None if options is None else dict(options), image_size))

    async def check_options(self, options: Mapping[str, Any]) -> None:
        """The child's service checks the options; its refusal is a ``ValueError`` here, with its text."""
        if (refused := await self.refused_input(options, None)) is not None:
            raise ValueError(refused[1])

    async def check_image(self, width: int, height: int) -> None:
        """The child's service checks an image's size; its refusal is a ``ValueError`` here, with its text."""
        if (refused := await self.refused_input(None, (width, height))) is not None:
            raise ValueError(refused[1])

    def _give_up(self, call_id: int, call: _Pending) -> None:
        """Nobody waits for the call any more: cancel it in the child (its late answer is dropped there or here).
        One answered just as its caller gave up hands what it made back to the child."""
        if self._pending.pop(call_id, None) is not None:
            self._abandoned[call_id] = call.method
            self._send_quiet(wire.Cancel(call_id))
        elif call.ok and call.method in wire.HANDED_OVER:
            self._sinks.pop(call_id, None)
            self._broken_calls.pop(call_id, None)
            self._send_quiet(wire.Release(call_id))

    def _open_stream(self, method: str, arg: Any) -> ProxyStream:
        stream_id = next(self._ids)
        stream = ProxyStream(self._send_quiet, stream_id, method, arg)
        try:
            self._check_running()
        except ProcessServiceError as exc:
            stream.on_failure(exc)
            return stream
        broken = self._broken_calls.get(self._session_calls.get(arg, -1)) if method == "chunks" else None
        if broken is not None:
            stream.on_failure(broken)
            return stream
        self._streams[stream_id] = stream
        try:
            self._send_quiet(wire.OpenStream(stream_id, method, arg))
        except BaseException:  # the argument does not pickle
            del self._streams[stream_id]
            raise
        return stream


class ProcessBidirectionalService(ProcessService, BidirectionalService):
    """A :class:`BidirectionalService` running in a child process."""

    kind = "bidirectional"

    def configure_session_capacity(self, limit: int) -> None:
        """Recorded here and applied in the child before it enters the service's ``running()``."""
        if not self._life.can(Event.RUN):
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
            self._broken_calls.pop(call_id, None)


class ProcessServerPushService(ProcessService, ServerPushService):
    """A :class:`ServerPushService` running in a child process."""

    kind = "server_push"

    def stream(self, config: SessionConfig) -> AsyncIterator[Chunk]:
        """The stream's chunks; the child's errors (bad options, a stream already open) come at the first chunk."""
        return self._open_stream("stream", config)


def _last_line(traceback_text: str) -> str:
    """A child traceback's last line, ``Type: message``: what failed (a killed stage rank, named), in one line."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no reason given"
