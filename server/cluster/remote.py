"""The authority's handles on a worker agent and on each session it runs.

:class:`RemoteWorker` stands where an in-process :class:`~server.model_worker.ModelWorker`
stands in the runtime (the admission book, ``runtime.workers``, health); :class:`RemoteRun`
(:mod:`server.cluster.remote_run`) stands where a :class:`~server.runner.RoomRunner` stands (``runtime.runners``): the runtime
asks it to stop, abort or settle, and it forwards to the agent. The agent's own runner
drives the session; its table events come back over the wire and are applied here to the
authoritative record, in sequence order (duplicates and late events are dropped and counted).
Who is in a session's room is kept by the runtime where the rooms are the authority's own (local rooms:
:mod:`server.room_follow`, from the session's creation); on LiveKit the runtime looks into the room until the agent's
worker is in it, and takes the agent's reports from then on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from states.liveness import LivenessBook, fenced
from states.stream_session import LIVE_MEDIA, REQUEUABLE, DrainCause, Event
from states.worker import REFUSES_STARTS

from ..option_check import NOT_CHECKED
from ..reasons import cut, echo, public_reason, without_prefix
from ..requests import OptionsRefused, SessionImageRefused
from ..tokens import MAX_IDENTITY_LENGTH
from .identity import worker_participant
from .remote_run import RemoteRun
from .session_deadlines import DRAIN_DEADLINE, NOT_FINISHED_AFTER_DRAIN, STOP_DEADLINE, start_deadline
from .start_image import MAX_IMAGE_BYTES, read_image
from .wire import (
    Channel, CheckOptions, ConnectionClosed, Goodbye, Message, OptionsChecked, Participants, Refused, SessionEvent,
    SessionFinished, Start, Stop,
)

if TYPE_CHECKING:
    from ..registry import SessionRecord
    from ..runtime import StreamRuntime

__all__ = ["RemoteWorker", "RemoteRun", "PlanView", "MAX_IMAGE_BYTES", "STOP_DEADLINE", "AUTHORITY_STOPPING",
           "GOODBYE_SEND"]

log = logging.getLogger("chunkline.cluster")

OUTBOX = 256  # messages waiting for an agent's connection; one more means it stopped reading
#: the authority's goodbye to its agents as it stops (after its own drain): an agent dials again without counting the
#: close toward its crash-loop limit (it counted, and 9 authority restarts in a minute ended every external agent)
AUTHORITY_STOPPING = "the authority is stopping"
#: seconds the authority's stop waits for a goodbye to go out (shielded: the runtime's nursery is being cancelled)
GOODBYE_SEND = 1.0


@attrs.frozen
class PlanView:
    """The capacity plan an agent reported (the metadata route shows it as the agent sent it)."""

    facts: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.facts)


class RemoteWorker:
    """One registered agent: its identity, what it reported, and its connection's outbox."""

    def __init__(
        self,
        worker_id: str,
        *,
        channel: Channel,
        node: str,
        devices: tuple[int, ...],
        launcher: str,
        pid: int,
        slot: str | None,
        liveness: LivenessBook | None = None,
        deadlines_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.worker_id = worker_id
        self._liveness = liveness  # the authority's: where a stop owed by this agent gets its deadline
        self._deadlines_changed = deadlines_changed  # the authority's sweep then looks at the new deadline
        self._stops_sent: dict[str, bool] = {}  # session id -> the Stop sent: at once (True) or at a chunk boundary
        self.channel = channel
        self.node = node
        self.gpu_ids = devices
        self.launcher = launcher
        self.pid = pid
        self.slot = slot
        self.plan: PlanView | None = None
        self.said_ready = False  # its Ready came (once a registration: a second one is a protocol error)
        self.kind: str | None = None
        self.startup_check: dict[str, Any] | None = None  # the agent's own, from its Ready
        #: the offered settings its pipeline's get_service took, with the agent's values, from its Ready
        self.settings_taken: dict[str, Any] | None = None
        #: the session inputs its pipeline's service declares it takes, from its Ready (None until then)
        self.inputs_taken: frozenset[str] | None = None
        self.worker_mode: str | None = None  # the agent's own --worker-mode, from its Ready (None until then)
        self.failure: str | None = None
        self.runs: dict[str, RemoteRun] = {}
        self.lost_cause: str | None = None
        self.stale_events = 0
        self._outbox_send, self._outbox = trio.open_memory_channel[Message](OUTBOX)
        self._pump_scope = trio.CancelScope()  # cancelled when the outbox overflows: a send stuck on the socket ends
        self._stalled: str | None = None
        self._stopping = False  # the authority stops: the pump says goodbye before it closes the connection
        self._tell_loss = False  # the authority lost the agent: the pump says why before it closes the connection
        self._checks: dict[int, _Check] = {}
        self._check_ids = itertools.count(1)

    @property
    def failing(self) -> bool:
        """Lost (the runtime's check before it promotes onto a worker; an agent's own failure is a loss)."""
        return self.lost_cause is not None

    @property
    def out_of_service(self) -> bool:
        """It takes no session (as a model worker's): lost."""
        return self.failing

    @property
    def identity(self) -> str:
        return worker_participant(self.worker_id)

    def send(self, message: Message) -> None:
        """Queue a message for the agent (in order); a full outbox means the agent stopped reading."""
        if self.lost_cause is not None:
            return
        try:
            self._outbox_send.send_nowait(message)
        except trio.WouldBlock:
            log.warning("worker %s does not keep up with what it is sent; closing its connection", self.worker_id)
            self._stalled = f"the agent does not keep up with what it is sent: {OUTBOX} messages wait for it"
            self._outbox_send.close()
            self._pump_scope.cancel()  # the pump may be stuck in a large send: the connection ends now
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the connection is gone; its loss is being handled

    async def pump(self) -> str | None:
        """Send the outbox in order. Returns why the connection is dead on this side (a send failed or took
        past its deadline, or the outbox overflowed), or None when the outbox was closed (stop or loss). On the
        authority's stop its goodbye goes out last, even as the runtime's nursery is cancelled around it; on a loss,
        the loss's cause (a tagged refusal: the agent counts it toward its crash-loop limit, as it does not count a
        connection that closed with no word, the authority gone)."""
        try:
            with self._pump_scope:
                async with self._outbox:
                    async for message in self._outbox:
                        try:
                            await self.channel.send(message)
                        except ConnectionClosed as exc:
                            return str(exc)
        finally:
            # a frame cut off half-way leaves no room for a last word after it; one cancelled before it began does
            if not self.channel.frame_cut and not self._pump_scope.cancelled_caught:
                if self._stopping:
                    await self._say_last(Goodbye(AUTHORITY_STOPPING))
                elif self._tell_loss:
                    await self.tell_loss()
        if self._stalled is not None:
            return self._stalled
        await self.channel.aclose()  # stopped or lost: the connection ends, and with it the reader
        return None

    async def tell_loss(self) -> None:
        """Tell the agent why the authority lost it (once; a tagged refusal, which the agent counts toward its crash-loop
        limit unless ``transient``: a fence, :func:`states.liveness.fenced`), then close: the pump does as the outbox
        closes, the connection's handler once the reader found the cause (its pump was cancelled). Not past a frame cut."""
        if self._tell_loss and not self.channel.frame_cut and self.lost_cause is not None:
            self._tell_loss = False
            said = f"the authority lost this worker: {self.lost_cause}"
            await self._say_last(Refused(said, transient=fenced(self.lost_cause)))

    async def _say_last(self, message: Message) -> None:
        """Tell the agent why the connection ends (a tagged frame: only the authority can say it), then close."""
        with trio.CancelScope(shield=True):
            with trio.move_on_after(GOODBYE_SEND), contextlib.suppress(ConnectionClosed):
                await self.channel.send(message)
            await self.channel.aclose()

    def stop(self) -> None:
        """The runtime is done with this worker (shutdown, its sessions drained): say goodbye and close the
        connection, so that the agent dials again without counting it as a failure."""
        self._stopping = self.lost_cause is None
        self._outbox_send.close()

    def end_service_process_now(self) -> None:
        """Nothing to end here when the authority aborts (a second signal): the agent's service runs in the agent's
        own process, which a local launcher's abort ends as this process's descendant and any other agent outlives
        (it is cut off and stops its sessions). Without it the abort raised AttributeError: a traceback, exit 1."""

    # -- option checks --

    async def check_options(self, options: dict[str, Any], image_size: tuple[int, int] | None = None) -> None:
        """The agent's pipeline checks a create's options, and its image's size when given, in one round trip:
        :class:`OptionsRefused` or :class:`SessionImageRefused` when it refuses them.

        The caller bounds the wait; a loss meanwhile ends it with the loss.
        """
        if self.lost_cause is not None:
            raise RuntimeError(f"worker lost: {self.lost_cause}")
        check = _Check(next(self._check_ids))
        self._checks[check.check_id] = check
        try:
            self.send(CheckOptions(check.check_id, options, image_size))
            await check.done.wait()
        finally:
            self._checks.pop(check.check_id, None)
        if check.answer is None:
            raise RuntimeError(f"worker lost: {self.lost_cause}")
        if check.answer.refused is not None:  # the agent's word on its pipeline's check: answered as the agent's
            raise OptionsRefused(public_reason(check.answer.refused, prefix_type=False), worker_id=self.worker_id)
        if check.answer.image_refused is not None:
            raise SessionImageRefused(public_reason(check.answer.image_refused, prefix_type=False), worker_id=self.worker_id)
        if check.answer.error is not None:  # one public line, as the agent's own would be (logged and answered)
            said = without_prefix(public_reason(check.answer.error, prefix_type=False), NOT_CHECKED)
            raise RuntimeError(f"worker {echo(self.worker_id)}: {said}")

    def on_options_checked(self, message: OptionsChecked) -> None:
        check = self._checks.get(message.check_id)
        if check is None:
            self.stale_events += 1  # its create gave up waiting
            return
        check.answer = message
        check.done.set()

    # -- sessions --

    def send_stop(self, session_id: str, cause: DrainCause, *, now: bool = False) -> None:
        """Ask the agent to stop a session at a chunk boundary, or at once (``now``): each once (a drain asked again
        sent a Stop every second for as long as the session lasted). The first starts the agent's
        :data:`STOP_DEADLINE`."""
        if session_id in self._stops_sent and (self._stops_sent[session_id] or not now):
            return  # that stop, or a stronger one, was sent
        self._stops_sent[session_id] = now
        self.send(Stop(session_id, cause.value, now=now))
        self._owe_finish(session_id, STOP_DEADLINE)

    def _owe_finish(self, session_id: str, within: float, by: str = "by its stop deadline") -> None:
        """The agent must report ``session_id`` finished within ``within`` seconds, or be lost (the loss says it was
        not reported finished ``by`` what); a deadline already owed for it stands."""
        if self._liveness is not None and self._liveness.owe_stop(self.worker_id, session_id, trio.current_time(),
                                                                  within, by=by):
            self._deadlines_changed()

    def run_ended(self, session_id: str, *, stop_owed: bool = False) -> None:
        """A session of this agent settled: it is not the agent's any more, and no stop of it is owed, unless the
        authority gave up on it before the agent answered (``stop_owed``: the agent still owes its finish, by the
        stop's deadline, or is lost)."""
        self.runs.pop(session_id, None)
        if stop_owed:
            return
        self._stops_sent.pop(session_id, None)
        if self._liveness is not None:
            self._liveness.stop_answered(self.worker_id, session_id)

    def open_runner(self, runtime: StreamRuntime, record: SessionRecord) -> RemoteRun:
        run = RemoteRun(runtime, record, self)
        self.runs[record.session_id] = run
        expect = getattr(runtime.transport, "expect_worker", None)
        if expect is not None:  # local rooms admit this agent's worker token, and no other
            expect(record.room, self.identity)
        try:
            image, suffix = read_image(record.image_path)
        except (OSError, ValueError) as exc:
            # a queued session's file may be gone or grown by its turn: that session fails, alone,
            # once the runtime has recorded this run (it is mid-way through its own book-keeping now)
            reason = f"the reference image could not be sent to the worker: {exc}"
            trio.lowlevel.current_trio_token().run_sync_soon(run.settle, reason, DrainCause.START_FAILED)
            return run
        self.send(
            Start(
                session_id=record.session_id,
                room=record.room,
                identity=self.identity,
                token=runtime.issuer.worker_token(record.room, self.identity),
                controller_identity=record.controller_identity,
                prompt=record.prompt,
                config=dict(record.config),
                image=image,
                image_suffix=suffix,
            )
        )
        runtime.spawn(run.hold_to_start, start_deadline(runtime.settings.controller_timeout))
        return run

    def on_session_event(self, message: SessionEvent, now: float) -> None:
        run = self.runs.get(message.session_id)
        if run is None or message.seq <= run.seq:
            self.stale_events += 1
            return
        run.seq = message.seq
        record = run.record
        try:
            event = Event(message.event)
        except ValueError:
            self.stale_events += 1
            return
        if message.pipeline_session_id is not None:  # a pipeline's id (a uuid, say): kept and shown, cut
            record.pipeline_session_id = cut(message.pipeline_session_id, MAX_IDENTITY_LENGTH)
        # the agent's progress moves the authority's record through its lifecycle, and its drain drains it with the
        # agent's cause (a drain the authority applied first stays); the end arrives with the finish (SessionFinished)
        if message.drain_cause and run.runtime.lifecycle.drain(record, _drain_cause(message.drain_cause),
                                                               _public(message.drain_detail)):
            # its runner drains on its own (no Stop asked for it): the finish is owed within a Stop's bounds, or the
            # agent is lost (it held the session, draining, and its slot for as long as it heartbeated)
            self._owe_finish(message.session_id, DRAIN_DEADLINE, NOT_FINISHED_AFTER_DRAIN)
        if run.runtime.lifecycle.step(record, event) and record.status in LIVE_MEDIA:
            run.media_reported = True  # the agent's runner joined its room and started its media
        run.moved()
        if run.media_reported:  # an event from before its worker joined the room names nobody: not the room's word
            run.take_participants(message.participants)

    def on_participants(self, message: Participants) -> None:
        """Who is in a running session's room now, as the agent sees it (in sequence with its events)."""
        run = self.runs.get(message.session_id)
        if run is None or message.seq <= run.seq:
            self.stale_events += 1
            return
        run.seq = message.seq
        run.take_participants(message.participants)

    def on_session_finished(self, message: SessionFinished) -> None:
        run = self.runs.get(message.session_id)
        if run is None and message.session_id in self._stops_sent:
            self.run_ended(message.session_id)  # one the authority gave up on: the stop it still owed is answered
            return
        if run is None or message.seq <= run.seq:
            self.stale_events += 1
            return
        first = run.seq == 0
        run.seq = message.seq
        if first and self._refused_as_worker(message, run):
            run.give_back()
            return
        # the session's error, kept with its record and shown to clients: one public line, as the agent's own is
        error = _public(message.error)
        if message.drain_cause:
            # the agent's runner drained first (its controller left, its room emptied): its cause, once
            run.runtime.lifecycle.drain(run.record, _drain_cause(message.drain_cause), error)
        run.told_room = message.told_room
        run.settle(error)

    def _refused_as_worker(self, message: SessionFinished, run: RemoteRun) -> bool:
        """Whether the agent refused the Start as its own state, not the session's: the refusal is the session's first
        word, and its Drain (sent before it on this connection) already made the worker draining or failed."""
        return (message.drain_cause == DrainCause.START_FAILED.value
                and run.record.status in REQUEUABLE and not run.runtime.closing
                and run.runtime.book.worker_state(self.worker_id) in REFUSES_STARTS)

    def lose(self, cause: str, *, tell: bool = True) -> None:
        """The agent is gone: every session it ran fails with the cause (the runtime releases the slots). ``tell``:
        the agent is told the cause, if its connection still takes it (not when it left after its drain)."""
        if self.lost_cause is None:
            self.lost_cause = cause
            self.failure = f"worker lost: {cause}"
            self._tell_loss = tell
        self._outbox_send.close()
        for check in self._checks.values():
            check.done.set()  # no answer will come


def _public(reason: str | None) -> str | None:
    """An agent's reason as the authority keeps and shows it: one public line."""
    return None if reason is None else public_reason(reason, prefix_type=False)


def _drain_cause(value: str) -> DrainCause:
    try:
        return DrainCause(value)
    except ValueError:
        return DrainCause.WORKER_FAILED  # an agent of this version sends only known causes


@attrs.define
class _Check:
    """One option check awaiting its agent's answer."""

    check_id: int
    done: trio.Event = attrs.Factory(trio.Event)
    answer: OptionsChecked | None = None
