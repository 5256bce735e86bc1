"""The room runner: one per admitted session, driving the stream-session table to a terminal state.

    assigned -> joining_room -> starting_pipeline -> running -> draining -> closed
                                                        (or failed / expired)

It joins the room as the worker, waits for the controller (``controller_timeout``),
creates the pipeline session, forwards validated controls (held, bounded, until
the pipeline session exists; every refusal is answered on ``tf.status``),
publishes chunks paced at their fps, and reports lifecycle, lease and chunk
status. Whatever ends the session — stop, DELETE, the session timeout, the
controller leaving, an empty room, an error — the runner drains: it closes the
pipeline session through its owner, says ``done``, leaves the room and hands
the slot back, so the next queued session is admitted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from pipelines.contract import BidirectionalService, Chunk, Control, ControlRejected, ControlType, ServiceEvent, SessionConfig
from states.stream_session import Event, State

from . import protocol
from .reasons import public_reason
from .transport import DataReceived, ParticipantJoined, ParticipantLeft, RoomConnection, TransportError

if TYPE_CHECKING:
    from .model_worker import ModelWorker
    from .registry import SessionRecord
    from .runtime import StreamRuntime

__all__ = ["RoomRunner", "RunnerError"]

log = logging.getLogger("chunkline.runner")

CONNECT_TIMEOUT = 10.0
DISCONNECT_TIMEOUT = 5.0
CLOSE_PIPELINE_TIMEOUT = 30.0
CREATE_PIPELINE_TIMEOUT = 60.0  # seconds the service may take to create a pipeline session
CONTROL_TIMEOUT = 10.0  # seconds the service may take to take one control
WORKER_CAUSE_WAIT = 10.0  # seconds a runner waits for a failing worker to say why, when its stream ended first
EARLY_CONTROL_LIMIT = 64  # controls held before the pipeline session exists
METRICS_PERIOD = 1.0


class RunnerError(RuntimeError):
    """Why a session failed, in words a client can read on its record."""


def _single_cause(exc: BaseException) -> BaseException:
    """The one error inside nested single-member exception groups (trio wraps nursery errors)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class _Pacer:
    """Deadline-based pacing at the chunk's fps, with no catch-up burst after a stall."""

    def __init__(self) -> None:
        self.next_at: float | None = None

    async def wait(self, fps: float) -> None:
        interval = 1.0 / fps
        now = trio.current_time()
        if self.next_at is None or now - self.next_at > interval:
            self.next_at = now
        await trio.sleep_until(self.next_at)
        self.next_at += interval


class RoomRunner:
    def __init__(self, runtime: StreamRuntime, record: SessionRecord, worker: ModelWorker) -> None:
        self.runtime = runtime
        self.record = record
        self.worker = worker
        self.identity = f"chunkline-{worker.worker_id}"
        self.finished = trio.Event()
        self._stop_cause: str | None = None
        self._failure: str | None = None  # set by fail(): the session ends failed with this reason
        self._stop = trio.Event()
        self._connection: RoomConnection | None = None
        self._pipeline_session: str | None = None
        self._pipeline_ready = trio.Event()
        self._early_controls: deque[Control] = deque()
        self._controller_here = trio.Event()
        self._published_chunks = 0
        self._published_frames = 0
        self._chunk_times: deque[float] = deque(maxlen=32)
        self._last_latency: float | None = None
        self._rtf: float | None = None
        self._frames_per_chunk = 0
        self._pacer = _Pacer()
        self._scope = trio.CancelScope()

    # -- control from the runtime ----------------------------------------------

    def stop(self, cause: str) -> None:
        """End the session (DELETE, expiry, departure...): the first cause is the one recorded."""
        if self._stop_cause is None:
            self._stop_cause = cause
        self._stop.set()

    def abort(self) -> None:
        """Stop at once (server shutdown past its grace): waiting is cancelled, cleanup still runs."""
        self.stop("shutdown")
        self._scope.cancel()

    def fail(self, reason: str) -> None:
        """End at once as a failure with ``reason`` (the worker under the session died): cleanup still runs."""
        if self._failure is None:
            self._failure = reason
        self.stop("failed")
        self._scope.cancel()

    @property
    def stop_cause(self) -> str | None:
        return self._stop_cause

    # -- life --------------------------------------------------------------------

    async def run(self) -> None:
        error: str | None = None
        try:
            with self._scope:
                await self._run()
        except Exception as exc:
            cause = _single_cause(exc)
            # the record and the room hear one short line; the log keeps the traceback
            error = public_reason(cause, prefix_type=not isinstance(cause, RunnerError | TransportError))
            log.warning("session %s failed: %s", self.record.session_id, error, exc_info=cause)
        finally:
            with trio.CancelScope(shield=True):
                if self._failure is None and self.worker.failing:
                    # the service is failing as a whole: whatever ended this run, the worker's cause is the
                    # session's (never a quiet "closed"); bounded, since the cause comes once running() is left
                    with trio.move_on_after(WORKER_CAUSE_WAIT):
                        await self.worker.failed.wait()
                    error = self._failure or error or f"worker {self.worker.worker_id} stopped"
                error = self._failure or error  # a failure told by fail() wins, however the run ended
                await self._finish(error)

    async def _run(self) -> None:
        record, runtime = self.record, self.runtime
        if not self._advance(Event.JOIN_ROOM):
            return
        token = runtime.issuer.worker_token(record.room, self.identity)
        # the transport bounds the connect itself and raises TransportError with the reason
        self._connection = await runtime.transport.connect(record.room, self.identity, token, timeout=CONNECT_TIMEOUT)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_room)
            await self._wait_for_controller()
            if self._stop.is_set():
                nursery.cancel_scope.cancel()
                return
            if not self._advance(Event.START_PIPELINE):
                nursery.cancel_scope.cancel()
                return
            await self._send_status("starting_pipeline")
            service = self.worker.service
            if isinstance(service, BidirectionalService):
                await self._run_bidirectional(service, nursery)
            else:
                await self._run_server_push(service, nursery)
            nursery.cancel_scope.cancel()

    def _advance(self, event: Event) -> bool:
        """Apply a lifecycle step unless the session is already draining (then stop quietly)."""
        # a stop before the pipeline session exists still lets it start and then end cleanly
        # (RUN), so the controller hears "running" then "done" rather than nothing
        if self.record.status is State.DRAINING or (self._stop.is_set() and event is not Event.RUN):
            return False
        self.runtime.registry.apply(self.record, event, now=trio.current_time())
        return True

    async def _wait_for_controller(self) -> None:
        controller = self.record.controller_identity
        assert self._connection is not None
        if controller in self._connection.participants():
            self._controller_here.set()
        with trio.move_on_after(self.runtime.settings.controller_timeout):
            async with trio.open_nursery() as waiting:
                async def until(event: trio.Event) -> None:
                    await event.wait()
                    waiting.cancel_scope.cancel()

                waiting.start_soon(until, self._controller_here)
                waiting.start_soon(until, self._stop)
        if not self._controller_here.is_set() and not self._stop.is_set():
            raise RunnerError(
                f"the controller {controller!r} did not join within {self.runtime.settings.controller_timeout:g} s"
            )

    async def _run_bidirectional(self, service: BidirectionalService, nursery: trio.Nursery) -> None:
        record = self.record
        config = SessionConfig(prompt=record.prompt, image_path=record.image_path, options=record.config)
        with trio.move_on_after(CREATE_PIPELINE_TIMEOUT) as deadline:
            pipeline_id = await service.create_session(config, on_event=self._on_service_event)
        if deadline.cancelled_caught:
            raise RunnerError(f"the pipeline did not create the session within {CREATE_PIPELINE_TIMEOUT:g} s")
        self._pipeline_session = pipeline_id
        record.pipeline_session_id = pipeline_id
        if not self._advance(Event.RUN):
            return
        self._pipeline_ready.set()
        while self._early_controls:
            await self._apply_control(service, self._early_controls.popleft())
        await self._send_status("running", worker_id=self.worker.worker_id)
        nursery.start_soon(self._publish_metrics)
        async with trio.open_nursery() as streaming:
            async def stop_on_request() -> None:
                await self._stop.wait()
                with trio.move_on_after(CONTROL_TIMEOUT):
                    try:
                        await service.push_control(pipeline_id, Control(ControlType.STOP))
                    except ControlRejected:
                        pass
                streaming.cancel_scope.cancel()

            streaming.start_soon(stop_on_request)
            async with contextlib.aclosing(service.chunks(pipeline_id)) as chunks:
                async for chunk in chunks:
                    await self._publish(chunk)
            streaming.cancel_scope.cancel()

    async def _run_server_push(self, service: Any, nursery: trio.Nursery) -> None:
        record = self.record
        config = SessionConfig(prompt=record.prompt, image_path=record.image_path, options=record.config)
        if not self._advance(Event.RUN):
            return
        self._pipeline_ready.set()
        await self._send_status("running", worker_id=self.worker.worker_id)
        nursery.start_soon(self._publish_metrics)
        with trio.CancelScope() as streaming:
            async def stop_on_request() -> None:
                await self._stop.wait()
                streaming.cancel()

            nursery.start_soon(stop_on_request)
            stream = service.stream(config)
            try:
                async for chunk in stream:
                    await self._publish(chunk)
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with trio.CancelScope(shield=True):
                        await aclose()

    # -- media ---------------------------------------------------------------------

    async def _publish(self, chunk: Chunk) -> None:
        assert self._connection is not None
        pacer = self._pacer
        metrics = self.runtime.metrics
        started = time.time()
        for frame in chunk.frames:
            if self._stop.is_set():
                return
            await pacer.wait(chunk.fps)
            await self._connection.publish_frame(frame, chunk.fps)
            self._published_frames += 1
        if chunk.audio is not None and not self._stop.is_set():
            await self._connection.publish_audio(chunk.audio)
        self._published_chunks += 1
        self._frames_per_chunk = chunk.frame_count
        now = trio.current_time()
        self._chunk_times.append(now)
        metrics.record_chunk_published(self.record.session_id, chunk.frame_count)
        latency = chunk.metadata.get("control_to_output_seconds")
        if isinstance(latency, int | float) and math.isfinite(latency):
            self._last_latency = float(latency)
        compute = sum(v for v in chunk.metadata.get("stage_times", {}).values() if isinstance(v, int | float))
        if compute:
            metrics.record_chunk_processed(compute)
            self._rtf = compute / chunk.media_seconds
        data = {
            **{k: v for k, v in chunk.metadata.items()},
            "frames": chunk.frame_count,
            "fps": chunk.fps,
            "applied_controls": dict(chunk.applied_controls),
            "publish_started_at": started,
            "publish_finished_at": time.time(),
        }
        await self._send(protocol.chunk_message(self.record.session_id, chunk.index, data))

    async def _publish_metrics(self) -> None:
        """Lossy ``tf.metrics`` every second: chunk period, fps, RTF, control-to-output latency."""
        assert self._connection is not None
        while True:
            await trio.sleep(METRICS_PERIOD)
            times = list(self._chunk_times)
            period = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            payload = protocol.metrics_message(
                self.record.session_id,
                chunk_period_seconds=period,
                published_fps=None if period is None else self._frames_per_chunk / period,
                real_time_factor=self._rtf,
                control_to_output_seconds=self._last_latency,
                published_frames=self._published_frames,
            )
            try:
                await self._connection.send_data(protocol.METRICS_TOPIC, payload, reliable=False)
            except TransportError:
                return

    # -- the room ----------------------------------------------------------------------

    async def _watch_room(self) -> None:
        """Participants, departures and controls, for the life of the connection."""
        assert self._connection is not None
        settings = self.runtime.settings
        record = self.record
        record.participants = set(self._connection.participants())
        departure: trio.CancelScope | None = None
        emptiness: trio.CancelScope | None = None
        async with trio.open_nursery() as timers:
            async def close_after(delay: float, cause: str, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await trio.sleep(delay)
                    self.stop(cause)

            if not record.participants:
                emptiness = await timers.start(close_after, settings.room_empty_timeout, "room_empty")
            async for event in self._connection.events():
                if isinstance(event, ParticipantJoined):
                    record.participants.add(event.identity)
                    if emptiness is not None:
                        emptiness.cancel()
                        emptiness = None
                    if event.identity == record.controller_identity:
                        self._controller_here.set()
                        if departure is not None:
                            departure.cancel()
                            departure = None
                elif isinstance(event, ParticipantLeft):
                    record.participants.discard(event.identity)
                    if event.identity == record.controller_identity and departure is None:
                        departure = await timers.start(close_after, settings.controller_timeout, "controller_left")
                    if not record.participants and emptiness is None:
                        emptiness = await timers.start(close_after, settings.room_empty_timeout, "room_empty")
                elif isinstance(event, DataReceived):
                    await self._on_data(event)

    async def _on_data(self, event: DataReceived) -> None:
        record = self.record
        metrics = self.runtime.metrics
        try:
            parsed = protocol.parse_control(
                event.payload,
                topic=event.topic,
                sender_identity=event.sender_identity,
                controller_identity=record.controller_identity,
                session_id=record.session_id,
                max_bytes=self.runtime.settings.max_data_message_bytes,
            )
        except protocol.ControlRejection as exc:
            if event.topic != protocol.CONTROL_TOPIC:
                return  # data on other topics (status echoes, app data) is not for the runner
            metrics.record_control_rejection(exc.reason)
            await self._send(protocol.rejection_message(record.session_id, exc.reason, exc.detail))
            return
        if isinstance(parsed, protocol.DeliveryAck):
            return
        metrics.record_control(record.session_id)
        if parsed.type is ControlType.STOP:
            self.stop("stop")
            return
        service = self.worker.service
        if not self._pipeline_ready.is_set():
            if len(self._early_controls) >= EARLY_CONTROL_LIMIT:
                metrics.record_control_rejection("not_ready")
                await self._send(
                    protocol.rejection_message(record.session_id, "not_ready", "too many controls before the stream started")
                )
                return
            self._early_controls.append(parsed)
            return
        if isinstance(service, BidirectionalService):
            await self._apply_control(service, parsed)

    async def _apply_control(self, service: BidirectionalService, control: Control) -> None:
        assert self._pipeline_session is not None
        try:
            with trio.move_on_after(CONTROL_TIMEOUT) as deadline:
                await service.push_control(self._pipeline_session, control)
            if deadline.cancelled_caught:
                self.fail(f"the pipeline did not take a control within {CONTROL_TIMEOUT:g} s")
        except ControlRejected as exc:
            self.runtime.metrics.record_control_rejection("service")
            await self._send(protocol.rejection_message(self.record.session_id, "service", exc.reason))

    def _on_service_event(self, event: ServiceEvent) -> None:
        if event.type.startswith("lease_") and self._connection is not None:
            position = event.data.get("queue_position")
            payload = protocol.lease_message(self.record.session_id, event.type, position)
            self.runtime.spawn(self._send, payload)

    async def _send_status(self, stage: str, **data: Any) -> None:
        await self._send(protocol.status_message(self.record.session_id, stage, **data))

    async def _send(self, payload: bytes) -> None:
        if self._connection is None:
            return
        try:
            await self._connection.send_data(protocol.STATUS_TOPIC, payload)
        except TransportError:
            pass

    # -- the end -------------------------------------------------------------------------

    async def _finish(self, error: str | None) -> None:
        """Drain: close the pipeline session, say done, leave, settle the record, free the slot."""
        record, runtime = self.record, self.runtime
        now = trio.current_time()
        if record.status is not State.DRAINING and not record.is_terminal:
            if error is None and record.machine.can(Event.DRAIN):
                runtime.registry.apply(record, Event.DRAIN, now=now)
                record.drain_cause = record.drain_cause or self._stop_cause or "completed"
        service = self.worker.service
        if self._pipeline_session is not None and isinstance(service, BidirectionalService):
            with trio.move_on_after(CLOSE_PIPELINE_TIMEOUT) as scope:
                try:
                    await service.close_session(self._pipeline_session)
                except Exception as exc:
                    log.warning("session %s: closing the pipeline session failed", record.session_id, exc_info=exc)
                    error = error or f"closing the pipeline session failed: {public_reason(exc)}"
            if scope.cancelled_caught:
                error = error or "closing the pipeline session timed out"
        if self._connection is not None:
            if error is None:
                await self._send(
                    protocol.done_message(record.session_id, self._published_chunks, self._published_frames)
                )
            else:
                await self._send(protocol.error_message(record.session_id, "session_failed", error))
            with trio.move_on_after(DISCONNECT_TIMEOUT):
                await self._connection.disconnect()
        record.participants.clear()  # the worker left: nobody is in the session's room any more
        runtime.session_finished(self, error)
        self.finished.set()
