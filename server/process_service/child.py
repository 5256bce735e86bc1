"""The child side of a process service: one pipeline service in its own process.

The proxy's :class:`engine.supervisor.Supervisor` spawns :func:`child_main` (a
*spawn* context process) with its end of a duplex pipe and a plain config dict.
The child binds its life to its parent (:func:`engine.supervised_child.bind_to_parent`),
sets the environment it was given (e.g. ``CUDA_VISIBLE_DEVICES``), loads the
pipeline with :func:`pipelines.loader.load_service`, says hello
(:class:`~server.process_service.wire.Ready`) and waits. On
:class:`~server.process_service.wire.Run` it calls ``configure_session_capacity``
(when told a limit), enters ``async with service.running():`` inside
``trio.run`` and serves requests, one trio task each, until it is told to stop
or its pipe closes; then it leaves ``running()`` and exits. The messages are in
:mod:`server.process_service.wire`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import traceback
from typing import Any

import trio

from engine.supervised_child import bind_to_parent, ignore_group_stop_signals
from pipelines.contract import check_service_event
from pipelines.pipeline_exits import exits_as_errors

from . import wire

__all__ = ["SENDER_FLUSH_TIMEOUT", "child_main"]

log = logging.getLogger("chunkline.process_service.child")

SENDER_FLUSH_TIMEOUT = 10.0  # seconds the child waits for its last messages to be written
HEARTBEAT_PERIOD = 1.0  # seconds between the child's heartbeats while its trio loop runs


def child_main(conn: Any, config: dict[str, Any]) -> None:
    """Entry point of the service process (the target of a spawn-context Process)."""
    # the parent decides when the service stops: Ctrl-C, a SIGTERM or a closed terminal's SIGHUP sent to the whole
    # process group (a terminal, `timeout`, systemd, a container runtime) must not kill the model under live
    # sessions; the parent drains them and then stops this process (and SIGKILL on parent death still applies)
    ignore_group_stop_signals()
    bind_to_parent(config)
    os.environ.update(config.get("environment") or {})
    from pipelines.contract import inputs_taken
    from pipelines.loader import OptionsNotAccepted, load_service, offered_taken

    try:
        service = load_service(config["pipeline"], offered=config.get("offered"), **config["options"])
    except BaseException as exc:
        _send_now(conn, wire.LoadFailed(traceback.format_exc(), isinstance(exc, OptionsNotAccepted)))
        raise SystemExit(1) from None
    taken = offered_taken(service)
    _send_now(conn, wire.Ready(service.kind, bool(getattr(service, "supports_timeline", False)), os.getpid(),
                               None if taken is None else tuple(sorted(taken)), tuple(sorted(inputs_taken(service)))))
    try:
        message = wire.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the parent went away before running
        return
    if not isinstance(message, wire.Run):  # Stop before running(): nothing was started
        return
    _Server(conn, service, message.release_timeout).serve(message.capacity)


def _seal(value: Any) -> wire.Sealed:
    """A value of the pipeline's for the parent (refusing, here, what is of the pipeline file's own module)."""
    from pipelines.loader import FILE_MODULE_PREFIX

    return wire.seal(value, foreign=FILE_MODULE_PREFIX)


def _send_now(conn: Any, message: Any) -> None:
    try:
        conn.send_bytes(wire.dumps(message))
    except (EOFError, OSError):
        pass


class _ChildStream:
    __slots__ = ("changed", "credits", "scope")

    def __init__(self) -> None:
        self.credits = wire.CREDIT_WINDOW
        self.changed = trio.lowlevel.ParkingLot()
        self.scope = trio.CancelScope()


class _Server:
    """Serves one running service: a reader thread feeds trio, a sender thread writes the pipe."""

    def __init__(self, conn: Any, service: Any, release_timeout: float) -> None:
        self.conn = conn
        self.service = service
        self.release_timeout = release_timeout
        self.unclaimed: dict[int, tuple[str, Any]] = {}  # call id -> (its method, what it made), until taken or released
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.calls: dict[int, trio.CancelScope] = {}
        self.streams: dict[int, _ChildStream] = {}
        self.nursery: trio.Nursery | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.inbox: trio.MemorySendChannel[Any] | None = None

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
                message = wire.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                message = wire.Stop()  # the parent closed its end: stop
            try:
                self.token.run_sync_soon(self.inbox.send_nowait, message)
            except trio.RunFinishedError:
                return
            if isinstance(message, wire.Stop):
                return

    def post(self, message: Any) -> None:
        """Queue a message for the parent (pickled here, so a pickling error is the poster's)."""
        self.outbox.put(wire.dumps(message))

    def post_chunk(self, stream_id: int, chunk: Any, index: int) -> None:
        """Queue chunk ``index`` of a stream, or raise PipelineContractError if the parent could not read it."""
        from pipelines.contract import PipelineContractError
        from pipelines.loader import FILE_MODULE_PREFIX

        try:
            data = wire.dumps(wire.ChunkOut(stream_id, wire.seal(chunk, foreign=FILE_MODULE_PREFIX)))
        except Exception as exc:
            raise PipelineContractError(
                f"chunk {index} cannot be sent from the worker process (a Chunk's metadata and applied_controls "
                f"must be plain data that pickles): {type(exc).__name__}: {exc}"
            ) from exc
        self.outbox.put(data)

    # -- trio ------------------------------------------------------------------------

    async def _main(self, capacity: int | None) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.inbox, inbox = trio.open_memory_channel[Any](math.inf)
        threading.Thread(target=self._recv_loop, name="process-service-reader", daemon=True).start()
        service = self.service
        async with trio.open_nursery() as heart:
            heart.start_soon(self._beat)
            try:
                await self._run_service(service, capacity, inbox)
            finally:
                heart.cancel_scope.cancel()

    async def _beat(self) -> None:
        """Tell the parent this loop is alive; a frozen or blocked child goes silent and is declared failed."""
        while True:
            self.post(wire.Heartbeat())
            await trio.sleep(HEARTBEAT_PERIOD)

    async def _run_service(self, service: Any, capacity: int | None, inbox: Any) -> None:
        from pipelines.contract import BidirectionalService

        entered = False
        try:
            # the pipeline's sys.exit() is its bug, said as its errors are (the child exited 1, the code and
            # the cause lost, and each replacement met it anew: the failure named the child's pid)
            with exits_as_errors("running()"):
                if capacity is not None and isinstance(service, BidirectionalService):
                    service.configure_session_capacity(capacity)
                async with service.running():
                    entered = True
                    self._post_report()
                    async with trio.open_nursery() as nursery:
                        self.nursery = nursery
                        async for message in inbox:
                            if isinstance(message, wire.Stop):
                                break
                            self._dispatch(message)
                        nursery.cancel_scope.cancel()
        except Exception:
            self.post(wire.Stopped(traceback.format_exc()) if entered else wire.RunFailed(traceback.format_exc()))
            return
        self.post(wire.Stopped(None))

    def _post_report(self) -> None:
        try:
            report = self.service.memory_report() if hasattr(self.service, "memory_report") else None
            self.post(wire.Running(None if report is None else _seal(report), None))
        except Exception as exc:
            self.post(wire.Running(None, wire.error_info(exc)))

    def _dispatch(self, message: Any) -> None:
        assert self.nursery is not None
        match message:
            case wire.Call():
                scope = trio.CancelScope()
                self.calls[message.call_id] = scope
                self.nursery.start_soon(self._call, scope, message)
            case wire.Cancel(call_id=call_id):
                scope = self.calls.get(call_id)
                if scope is not None:
                    scope.cancel()
            case wire.Taken(call_id=call_id):
                self.unclaimed.pop(call_id, None)
            case wire.Release(call_id=call_id):
                made = self.unclaimed.pop(call_id, None)
                if made is not None:
                    self.nursery.start_soon(self._release, *made)
            case wire.OpenStream():
                stream = self.streams[message.stream_id] = _ChildStream()
                self.nursery.start_soon(self._stream, stream, message)
            case wire.Credit(stream_id=stream_id, n=n):
                stream = self.streams.get(stream_id)
                if stream is not None:
                    stream.credits += n
                    stream.changed.unpark_all()
            case wire.CloseStream(stream_id=stream_id):
                stream = self.streams.get(stream_id)
                if stream is not None:
                    stream.scope.cancel()
            case _:
                log.warning("process service child: unknown message %r", type(message).__name__)

    async def _made_by(self, method: str, args: tuple[Any, ...], call_id: int, wants_events: bool) -> Any:
        """What the service's ``method`` returns for ``args``."""
        from pipelines.contract import BidirectionalService
        from pipelines.input_checks import refused_input

        service = self.service
        if method == "check_options":  # a refusal is the answer ((input, its text)), not a failed call
            return await refused_input(service, *args)
        if not isinstance(service, BidirectionalService):
            raise TypeError(f"{type(service).__name__} is a {service.kind} service; it has no {method}()")
        if method == "create_session":
            (config,) = args
            return await service.create_session(config, on_event=self._event_sink(call_id) if wants_events else None)
        if method == "push_control":
            return await service.push_control(*args)
        if method == "close_session":
            return await service.close_session(*args)
        raise ValueError(f"unknown process service method {method!r}")

    async def _call(self, scope: trio.CancelScope, message: wire.Call) -> None:
        call_id, method, args = message.call_id, message.method, message.args
        reply: wire.Result | None = None
        with scope:
            try:
                with exits_as_errors(method):
                    value = await self._made_by(method, args, call_id, message.wants_events)
                if method in wire.HANDED_OVER and scope.cancel_called:  # made although the parent gave up on it
                    await self._release(method, value)
                else:
                    reply = wire.Result(call_id, True, await self._sealed(method, value))
                    if method in wire.HANDED_OVER:
                        self.unclaimed[call_id] = (method, value)  # the parent takes it or hands it back
            except Exception as exc:
                reply = wire.Result(call_id, False, wire.error_info(exc))
        self.calls.pop(call_id, None)
        if reply is None:  # cancelled by the parent, which no longer waits: the answer lets it forget the call
            reply = wire.Result(call_id, False, wire.ErrorInfo("trio.Cancelled", "cancelled by the parent", "", None))
        self.post(reply)

    async def _sealed(self, method: str, value: Any) -> wire.Sealed:
        """The call's value for the parent; one that cannot be sent is a pipeline bug, and what it made (a session)
        is released here, since the parent never gets hold of it."""
        from pipelines.contract import PipelineContractError

        try:
            return _seal(value)
        except Exception as exc:
            if method in wire.HANDED_OVER:
                await self._release(method, value)
            raise PipelineContractError(
                f"the value {method} returned cannot be sent from the worker process: {type(exc).__name__}: {exc}"
            ) from exc

    async def _release(self, method: str, value: Any) -> None:
        """Release what a call made that the parent never took (``close_session`` for a session), bounded."""
        releaser = wire.HANDED_OVER[method]
        with trio.CancelScope(shield=True), trio.move_on_after(self.release_timeout) as late:
            try:
                await getattr(self.service, releaser)(value)
            except Exception:
                log.exception("process service child: %s() of what %s() made, which the server never took, raised",
                              releaser, method)
        if late.cancelled_caught:
            log.error("process service child: %s() of what %s() made, which the server never took, did not end "
                      "within %g s", releaser, method, self.release_timeout)

    def _event_sink(self, call_id: int) -> Any:
        def forward(event: Any) -> None:
            check_service_event(event)  # the pipeline's bug, raised into its own call, as in-process
            try:
                self.post(wire.SessionEvent(call_id, _seal(event)))
            except Exception:
                log.exception("process service child: an event could not be forwarded")

        return forward

    async def _stream(self, stream: _ChildStream, message: wire.OpenStream) -> None:
        from pipelines.contract import ChunkOrder

        stream_id = message.stream_id
        error = None
        iterator = None
        order = ChunkOrder()  # checked here: what is not a Chunk may not even pickle, or unpickle in the parent
        with stream.scope:
            try:
                with exits_as_errors():  # the pipeline's sys.exit() ended the child, code and cause lost
                    if message.method == "chunks":
                        iterator = self.service.chunks(message.arg)
                    elif message.method == "stream":
                        iterator = self.service.stream(message.arg)
                    else:
                        raise ValueError(f"unknown stream method {message.method!r}")
                    while True:
                        while stream.credits <= 0:
                            await stream.changed.park()
                        try:
                            chunk = order.check(await iterator.__anext__())
                        except StopAsyncIteration:
                            break
                        stream.credits -= 1
                        self.post_chunk(stream_id, chunk, chunk.index)
            except Exception as exc:
                error = wire.error_info(exc)
            finally:
                closer = getattr(iterator, "aclose", None)
                if closer is not None:
                    with trio.CancelScope(shield=True):
                        try:
                            with exits_as_errors():
                                await closer()
                        except Exception as exc:
                            error = error or wire.error_info(exc)
        self.streams.pop(stream_id, None)
        self.post(wire.StreamEnd(stream_id, error))
