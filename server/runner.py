"""The room runner: one per admitted session, driving the stream-session table to a terminal state.

    assigned -> joining_room -> starting_pipeline -> running -> draining -> closed
                                                        (or failed / expired)

It joins the room as the worker, waits for the controller, creates the pipeline session, hands the room's data to its
:class:`~server.control_intake.ControlIntake` (validated controls forwarded, held until the pipeline session exists;
every refusal answered on ``tf.status``, to its sender alone),
hands its chunks to a :class:`~server.chunk_publisher.ChunkPublisher` (paced media, chunk messages, ``tf.metrics``),
and reports lifecycle and lease status. Who is in the room, and which timeout runs, is the
:class:`states.room_presence.RoomPresence` book: a controller that never joins (or leaves and does not return) within
``controller_timeout`` fails the session naming the controller, whoever else comes and goes; a room its controller
came to and that then emptied ends it after ``room_empty_timeout`` as ``room_empty``. On LiveKit a viewer that joins
over the session's seats is sent away (:func:`server.viewer_seats.over_seats`: LiveKit lets a still-valid token back
in; a local room's door holds them; an agent's session's authority sends it away, :mod:`server.cluster.seat_reports`).
Whatever ends the session (a :class:`~states.stream_session.DrainCause`, set once through the
:class:`~server.lifecycle.SessionLifecycle`), the runner drains: it closes the pipeline session through its owner,
says ``done``, leaves the room and hands the slot back, so the next queued session is admitted.

The runner gets what it needs as one value (:class:`RunnerDeps`), runs its side
tasks (the room watch, the presence timers, ``tf.metrics``, lease messages) in
its own nursery, which ends before the session does, and names its cancel scopes
after what they cancel.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any

import attrs
import trio

from pipelines.contract import BidirectionalService, Chunk, ChunkOrder, Control, ControlRejected, ControlType
from pipelines.contract import (PipelineContractError, ServiceEvent, SessionConfig, check_event_session,
                                check_service_event, checked_session_id)
from pipelines.offline_calls import telling_error
from pipelines.pipeline_exits import exits_as_errors, pipeline_exit
from states.room_presence import RoomPresence
from states.stream_session import FAILING_CAUSES, DrainCause, Event

from . import protocol
from .call_deadline import call_deadline
from .chunk_publisher import ChunkPublisher, checked_metadata
from .control_intake import CONTROL_TIMEOUT, ControlIntake
from .cluster.identity import worker_participant
from .lifecycle import runner_last_word
from .loop_holds import loop_holds
from .presence_timeouts import TIMEOUT_CAUSES, timeout_detail
from .process_service.errors import ProcessServiceError
from .pushed_stream import StreamStalled, close_stream, next_chunk
from .reasons import public_reason
from .transport import DataReceived, ParticipantJoined, ParticipantLeft, RoomConnection, TransportError
from .viewer_seats import over_seats, send_away_over_seats

if TYPE_CHECKING:
    from collections.abc import Callable

    from .lifecycle import SessionLifecycle
    from .metrics import ServerMetrics
    from .model_worker import ModelWorker
    from .registry import SessionRecord
    from .tokens import TokenIssuer
    from .transport import RoomTransport

__all__ = ["RoomRunner", "RunnerDeps", "RunnerError"]

log = logging.getLogger("chunkline.runner")

CONNECT_TIMEOUT = 10.0
DISCONNECT_TIMEOUT = 5.0
CLOSE_PIPELINE_TIMEOUT = 30.0
CREATE_PIPELINE_TIMEOUT = 60.0  # seconds the service may take to create a pipeline session
#: seconds a server-push stream may take to give a chunk after its first (its first has CREATE_PIPELINE_TIMEOUT):
#: past it the pipeline stalled and its session fails (``server.pushed_stream``; ``chunkline run`` takes it too)
CHUNK_STALL_TIMEOUT = 60.0
WORKER_CAUSE_WAIT = 10.0  # seconds a runner waits for a failing worker to say why, when its stream ended first
OUTBOX_LIMIT = 32  # service events (lease status) waiting to be sent; more are dropped and counted

#: seconds the last word (``done``, ``error``) may take: half of leaving's DISCONNECT_TIMEOUT, which word and leave
#: share (STOP_DEADLINE counts it once). A room that took nothing (a hub socket nobody reads) held the end for ever.
LAST_WORD_TIMEOUT = DISCONNECT_TIMEOUT / 2


class RunnerError(RuntimeError):
    """Why a session failed, in words a client can read on its record."""


@attrs.frozen
class RunnerDeps:
    """Everything a room runner uses from the server, handed over as one value."""

    issuer: TokenIssuer
    transport: RoomTransport
    metrics: ServerMetrics
    lifecycle: SessionLifecycle
    controller_timeout: float
    room_empty_timeout: float
    max_data_message_bytes: int
    on_finished: Callable[[RoomRunner, str | None], None]  # settles the record and frees the slot
    #: told each time someone joins or leaves the room (an agent reports it to its authority)
    on_participants: Callable[[SessionRecord], None] = lambda record: None
    #: the runtime keeps the record's participants itself, from the session's creation (local rooms: RoomFollow)
    room_followed: bool = False
    #: the runner sends away a viewer over the seats where LiveKit is the door; an agent's does not: its authority
    #: does, from the agent's reports (it holds the tokens' passes and the API key; wire protocol 9 on)
    checks_seats: bool = True
    #: told once the worker is in the room and keeps the record's participants (LiveKit: until then the runtime
    #: looked into the room itself)
    on_room_seen: Callable[[SessionRecord], None] = lambda record: None


class RoomRunner:
    def __init__(self, deps: RunnerDeps, record: SessionRecord, worker: ModelWorker) -> None:
        self.deps = deps
        self.record = record
        self.worker = worker
        self.identity = worker_participant(worker.worker_id)
        self.finished = trio.Event()
        self._failure: str | None = None  # set by fail(): the session ends failed with this reason
        self._stop = trio.Event()
        self._connection: RoomConnection | None = None
        self._publisher: ChunkPublisher | None = None  # made with the connection
        self._controls = ControlIntake(
            record, worker, deps.metrics, own_identity=self.identity, max_data_message_bytes=deps.max_data_message_bytes,
            answer=self._answer, drain=self.drain, fail=self.fail)
        self._controller_here = trio.Event()
        self._presence: RoomPresence | None = None
        self._presence_changed = trio.Event()
        self._holds = loop_holds()  # the presence deadlines leave out time a pipeline held the loop
        self._outbox_in, self._outbox = trio.open_memory_channel[bytes](OUTBOX_LIMIT)
        self._trio_token = trio.lowlevel.current_trio_token()  # a service event from another thread comes in by it
        self.dropped_service_events = 0
        #: whether the room took this runner's word of how the session ended; if not, the server says it (``settle``)
        self.told_room = False
        #: whether its worker is in its room with media (health's ``transport_connected``): from the pipeline's
        #: start, which comes after the join, until it left
        self.in_room_with_media = False
        self._session_scope = trio.CancelScope()  # cancels everything but the drain (abort)

    # -- control from the runtime ----------------------------------------------

    def drain(self, cause: DrainCause, detail: str | None = None) -> None:
        """End the session (DELETE, expiry, a timeout, stop...): the first cause is the one recorded."""
        self.deps.lifecycle.drain(self.record, cause, detail)
        self._stop.set()

    def abort(self, cause: DrainCause = DrainCause.SHUTDOWN) -> None:
        """Stop at once (shutdown past its grace): waiting is cancelled, cleanup still runs."""
        self.drain(cause)
        self._session_scope.cancel()

    def fail(self, reason: str, cause: DrainCause = DrainCause.WORKER_FAILED) -> None:
        """End at once as a failure with ``reason`` (the worker under the session died, the pipeline
        stalled): cleanup still runs."""
        if self._failure is None:
            self._failure = reason
            # the run's own failures are logged where they are caught; this one ends it by a cancel, unlogged before
            log.warning("session %s failed: %s", self.record.session_id, reason)
        self.drain(cause, reason)
        self._session_scope.cancel()

    # -- life --------------------------------------------------------------------

    async def run(self) -> None:
        error: str | None = None
        failed_by = DrainCause.PIPELINE_FAILED  # what a failure of the run itself is, unless the room or worker
        told_by_the_worker = False  # the run failed as its worker's service did: the worker's cause is the line
        try:
            with self._session_scope:
                async with trio.open_nursery() as side_tasks:
                    side_tasks.start_soon(self._send_outbox)
                    await self._run(side_tasks)
                    side_tasks.cancel_scope.cancel()
        except BaseException as raised:
            exc = pipeline_exit(raised) or raised  # the pipeline's sys.exit() ended the session "completed", and the
            if not isinstance(exc, Exception):  # runtime with it: every create after it a 500, health "healthy"
                raise
            # the error that says why: the one inside trio's single-member nursery groups, or of several at once (a
            # killed service child's stream and call) the first in the server's own words, or each named (the log
            # read "ExceptionGroup: Exceptions from Trio nursery (2 sub-exceptions)")
            cause = telling_error(exc, (RunnerError, TransportError, ProcessServiceError, PipelineContractError))
            # the record and the room hear one short line; the log keeps the traceback of what nobody expected
            # (a room that went away, or anything after fail() ended the session, is one plain line)
            # (a service child that died: its proxy's line says how, and the worker's failure, which follows, says
            # it for this session too; a traceback through the proxy and trio's internals said nothing more)
            expected = isinstance(cause, TransportError | ProcessServiceError) or self._failure is not None
            told_by_the_worker = isinstance(cause, ProcessServiceError) and self.worker.failing
            if isinstance(cause, TransportError):
                failed_by = DrainCause.TRANSPORT_FAILED
            error = public_reason(
                cause, prefix_type=not isinstance(cause, RunnerError | TransportError | PipelineContractError)
            )
            if not told_by_the_worker:
                log.warning("session %s failed: %s", self.record.session_id, error, exc_info=None if expected else cause)
        finally:
            with trio.CancelScope(shield=True):
                if self._failure is None and self.worker.failing:
                    # the service is failing as a whole: whatever ended this run, the worker's cause is the
                    # session's (never a quiet "closed"); bounded, since the cause comes once running() is left
                    with trio.move_on_after(WORKER_CAUSE_WAIT):
                        await self.worker.failed.wait()
                    if self._failure is None and told_by_the_worker:  # fail() never came to say it
                        log.warning("session %s failed: %s", self.record.session_id, error)
                    error = self._failure or error or f"worker {self.worker.worker_id} stopped"
                    failed_by = DrainCause.WORKER_FAILED
                error = self._failure or error  # a failure told by fail() wins, however the run ended
                if error is not None:  # the record says why it ends (a no-op when a cause came first)
                    self.deps.lifecycle.drain(self.record, failed_by, error)
                await self._finish(error)

    async def _run(self, side_tasks: trio.Nursery) -> None:
        record, deps = self.record, self.deps
        if not self._step(Event.JOIN_ROOM):
            return
        token = deps.issuer.worker_token(record.room, self.identity)
        # the transport bounds the connect itself and raises TransportError with the reason
        self._connection = await deps.transport.connect(record.room, self.identity, token, timeout=CONNECT_TIMEOUT)
        self._publisher = ChunkPublisher(self._connection, deps.metrics, record.session_id, self._stop)
        self._presence = RoomPresence(record.controller_identity, deps.controller_timeout, deps.room_empty_timeout,
                                      self._holds.now())
        side_tasks.start_soon(self._watch_room, side_tasks)
        side_tasks.start_soon(self._enforce_timeouts)
        await self._wait_for_controller()
        if self._stop.is_set() or not self._step(Event.START_PIPELINE):
            return
        self.in_room_with_media = True
        await self._send_status("starting_pipeline")
        service = self.worker.service
        if isinstance(service, BidirectionalService):
            await self._run_bidirectional(service, side_tasks)
        else:
            await self._run_server_push(service, side_tasks)

    def _step(self, event: Event) -> bool:
        """Apply a lifecycle step unless the session is already draining (then stop quietly)."""
        return self.deps.lifecycle.step(self.record, event)

    async def _wait_for_controller(self) -> None:
        """Until the controller is here or the session drains (the presence timer bounds the wait)."""
        async with trio.open_nursery() as waiting:
            async def until(event: trio.Event) -> None:
                await event.wait()
                waiting.cancel_scope.cancel()

            waiting.start_soon(until, self._controller_here)
            waiting.start_soon(until, self._stop)

    async def _enforce_timeouts(self) -> None:
        """Sleep until the presence book's next deadline (re-read whenever someone joins or leaves); drain on it."""
        presence = self._presence
        assert presence is not None
        while True:
            changed = self._presence_changed
            nearest = presence.deadline()
            with self._holds.deadline(math.inf if nearest is None else nearest[0]):
                await changed.wait()
                continue
            now = self._holds.now()
            # a join the room let in whose event the watch has not handed the book yet: present, not absent (one told
            # `joined` a few ms before the deadline had its session ended for not being there)
            assert self._connection is not None
            for identity in self._connection.participants() - presence.participants:
                presence.joined(identity, now)
            timer = presence.due(now)
            if timer is not None:
                deps = self.deps
                cause, detail = TIMEOUT_CAUSES[timer], timeout_detail(
                    timer, self.record.controller_identity, deps.controller_timeout, deps.room_empty_timeout)
                # said as the worker's failures are (a session failed on a timeout was in no line at all)
                failed = cause in FAILING_CAUSES
                log.log(logging.WARNING if failed else logging.INFO, "session %s %s: %s", self.record.session_id,
                        "failed" if failed else "ends", detail)
                self.drain(cause, detail)
                return

    async def _run_bidirectional(self, service: BidirectionalService, side_tasks: trio.Nursery) -> None:
        record = self.record
        config = SessionConfig(prompt=record.prompt, image_path=record.image_path, options=record.config)
        with call_deadline(CREATE_PIPELINE_TIMEOUT) as deadline:
            pipeline_id = await service.create_session(config, on_event=self._on_service_event)
        if not deadline.cut:
            self._controls.pipeline_session = pipeline_id  # closed at the end whatever comes next
        if deadline.missed:  # cut, or made past its deadline (it held trio's thread): closed, and the session fails
            raise RunnerError(f"the pipeline did not create the session within {CREATE_PIPELINE_TIMEOUT:g} s")
        record.pipeline_session_id = checked_session_id(pipeline_id)
        if not self._step(Event.RUN):
            return
        await self._controls.started(pipeline_id)
        await self._send_status("running", worker_id=self.worker.worker_id)
        side_tasks.start_soon(self._report_metrics)
        async with trio.open_nursery() as streaming:
            async def stop_streaming_on_drain() -> None:
                await self._stop.wait()
                with trio.move_on_after(CONTROL_TIMEOUT):
                    try:
                        await service.push_control(pipeline_id, Control(ControlType.STOP))
                    except ControlRejected:
                        pass
                streaming.cancel_scope.cancel()

            streaming.start_soon(stop_streaming_on_drain)
            order = ChunkOrder()
            async with contextlib.aclosing(service.chunks(pipeline_id)) as chunks:
                async for chunk in chunks:
                    await self._publish(order.check(chunk))
            streaming.cancel_scope.cancel()

    async def _run_server_push(self, service: Any, side_tasks: trio.Nursery) -> None:
        record = self.record
        config = SessionConfig(prompt=record.prompt, image_path=record.image_path, options=record.config)
        if not self._step(Event.RUN):
            return
        self._controls.ready.set()
        await self._send_status("running", worker_id=self.worker.worker_id)
        side_tasks.start_soon(self._report_metrics)
        with trio.CancelScope() as streaming:
            async def stop_streaming_on_drain() -> None:
                await self._stop.wait()
                streaming.cancel()

            side_tasks.start_soon(stop_streaming_on_drain)
            stream, order = service.stream(config), ChunkOrder()
            try:  # each chunk within its deadline: a stalled stream fails its session (server.pushed_stream)
                while (chunk := await next_chunk(stream, order, first_within=CREATE_PIPELINE_TIMEOUT,
                                                 then_within=CHUNK_STALL_TIMEOUT)) is not None:
                    await self._publish(chunk)
            except StreamStalled as stalled:
                self.fail(str(stalled), DrainCause.PIPELINE_STALLED)
            finally:  # bounded as close_session is: past it what the stream holds is in doubt, the worker replaced
                if not await close_stream(stream, CLOSE_PIPELINE_TIMEOUT):
                    self.worker.fail(f"closing session {self.record.session_id}'s stream took over "
                                     f"{CLOSE_PIPELINE_TIMEOUT:g} s")

    # -- media ---------------------------------------------------------------------

    async def _publish(self, chunk: Chunk) -> None:
        """Publish a chunk as it is received (its metadata checked first: a pipeline bug fails before any frame)."""
        assert self._publisher is not None
        message = await self._publisher.publish(checked_metadata(chunk))
        if message is not None:
            await self._send(message)

    async def _report_metrics(self) -> None:
        assert self._publisher is not None
        await self._publisher.report_metrics()

    # -- the room ----------------------------------------------------------------------

    async def _watch_room(self, side_tasks: trio.Nursery) -> None:
        """Participants, departures and controls, for the life of the connection (into the presence book); a viewer
        that joined over the session's seats (LiveKit's door lets a still-valid token back in) is sent away."""
        assert self._connection is not None and self._presence is not None
        presence, record = self._presence, self.record
        if not self.deps.room_followed:  # who is in the room is the worker's word from now on, what it sees now first
            self.deps.on_room_seen(record)
            record.participants.clear()
        for identity in self._connection.participants():
            self._joined(identity, side_tasks)
        async for event in self._connection.events():
            if isinstance(event, ParticipantJoined):
                self._joined(event.identity, side_tasks)
            elif isinstance(event, ParticipantLeft):
                presence.left(event.identity, self._holds.now())
                if not self.deps.room_followed:
                    record.participants.discard(event.identity)
                self._presence_moved()
            elif isinstance(event, DataReceived):
                await self._controls.on_data(event)

    def _joined(self, identity: str, side_tasks: trio.Nursery) -> None:
        assert self._presence is not None and self._connection is not None
        self._presence.joined(identity, self._holds.now())
        # a followed (local) room's door holds the seats, by role; elsewhere (LiveKit) a joiner is checked here, once
        # (LiveKit may tell one join twice), unless an agent's authority checks it (checks_seats)
        new = not self.deps.room_followed and identity not in self.record.participants
        if not self.deps.room_followed:
            self.record.participants.add(identity)
        if identity == self.record.controller_identity:
            self._controller_here.set()
        self._presence_moved()
        if new and self.deps.checks_seats and (why := over_seats(self.record, identity)):
            side_tasks.start_soon(send_away_over_seats, self._connection, self.record.session_id, identity, why)

    def _presence_moved(self) -> None:
        self._presence_changed.set()
        self._presence_changed = trio.Event()
        self.deps.on_participants(self.record)

    def _on_service_event(self, event: ServiceEvent) -> None:
        """From the service, at any moment and from any thread: a lease change is queued for the runner's own sender
        task. A value that is no ``ServiceEvent`` is the pipeline's bug, raised into its own call (it was dropped
        without a word); a type the room has no message for is left out (an unknown ``lease_`` type raised into the
        pipeline's call, and a call from a thread of the pipeline's used trio's channel from outside trio)."""
        check_service_event(event)
        check_event_session(event, self.record.pipeline_session_id)
        if not trio.lowlevel.in_trio_run():
            with contextlib.suppress(trio.RunFinishedError):
                self._trio_token.run_sync_soon(self._forward_service_event, event)
            return
        self._forward_service_event(event)

    def _forward_service_event(self, event: ServiceEvent) -> None:
        """In trio: a checked event to the runner's sender, when the room has a message for it."""
        if event.type not in protocol.LEASE_EVENTS or self._connection is None:
            return
        position = event.data.get("queue_position")
        if type(position) is not int or position < 0:
            position = None  # the room's message says a place in the queue, or none
        payload = protocol.lease_message(self.record.session_id, event.type, position)
        try:
            self._outbox_in.send_nowait(payload)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.dropped_service_events += 1  # bounded: a stalled room cannot make the runner hold more

    async def _send_outbox(self) -> None:
        async for payload in self._outbox:
            await self._send(payload)

    async def _send_status(self, stage: str, **data: Any) -> None:
        await self._send(protocol.status_message(self.record.session_id, stage, **data))

    async def _send(self, payload: bytes) -> None:
        """The room's news (status, chunks, the end): to every participant."""
        if self._connection is None:
            return
        try:
            await self._connection.send_data(protocol.STATUS_TOPIC, payload)
        except TransportError:
            pass

    async def _answer(self, sender: str | None, payload: bytes) -> None:
        """The answer to one participant's message goes to it alone: the others' data budgets and attention are not
        spent on it, nor do they learn what it sent. A sender the transport could not name gets none."""
        if self._connection is None or sender is None:
            return
        try:
            await self._connection.send_data(protocol.STATUS_TOPIC, payload, to=sender)
        except TransportError:
            pass

    # -- the end -------------------------------------------------------------------------

    async def _finish(self, error: str | None) -> None:
        """Drain: close the pipeline session, say done, leave, settle the record, free the slot."""
        record = self.record
        self._outbox_in.close()
        if error is None:
            self.deps.lifecycle.drain(record, DrainCause.COMPLETED)  # a no-op when a cause came first
        service = self.worker.service
        pipeline_session = self._controls.pipeline_session
        if pipeline_session is not None and isinstance(service, BidirectionalService):
            with call_deadline(CLOSE_PIPELINE_TIMEOUT) as close_deadline:
                try:
                    with exits_as_errors("close_session"):
                        await service.close_session(pipeline_session)
                except Exception as exc:
                    if isinstance(exc, ProcessServiceError) and self.worker.failing:
                        # its service child is gone, the session with it: the worker's line said how (this was a
                        # traceback of the child's death)
                        log.debug("session %s: the pipeline session went with its service: %s", record.session_id, exc)
                    else:
                        log.warning("session %s: closing the pipeline session failed", record.session_id, exc_info=exc)
                    own = isinstance(exc, PipelineContractError)  # its "pipeline bug: ..." says what it is
                    error = error or f"closing the pipeline session failed: {public_reason(exc, prefix_type=not own)}"
            if close_deadline.missed:
                error = error or "closing the pipeline session timed out"
                # what that session holds in the service is in doubt: the worker is replaced, as after a crash
                # (it stayed in service, its slot free, for the next session to be admitted onto)
                self.worker.fail(f"closing session {record.session_id}'s pipeline session took over "
                                 f"{CLOSE_PIPELINE_TIMEOUT:g} s")
        failure = error or (record.drain_detail if record.drain_cause in FAILING_CAUSES else None)
        if self._connection is not None:
            with trio.move_on_after(DISCONNECT_TIMEOUT):  # the last word and the leave, together
                with trio.move_on_after(LAST_WORD_TIMEOUT):
                    publisher = self._publisher
                    published = (0, 0) if publisher is None else (publisher.published_chunks, publisher.published_frames)
                    self.told_room = await self._say_last_word(runner_last_word(record, failure, *published))
                await self._connection.disconnect()
        self.in_room_with_media = False
        record.participants.clear()  # the worker left: nobody is in the session's room any more
        self.deps.on_finished(self, error)
        self.finished.set()

    async def _say_last_word(self, payload: bytes) -> bool:
        """Whether the room took the session's last word (if not, the server says it: ``told_room``)."""
        assert self._connection is not None
        try:
            await self._connection.send_data(protocol.STATUS_TOPIC, payload)
        except TransportError:
            return False
        return True
