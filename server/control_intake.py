"""What a room runner does with a participant's data: every message taken or answered, none dropped unsaid.

Each message is parsed (:func:`server.protocol.parse_control`); one that is refused is answered
``control_rejected`` on ``tf.status`` to its sender alone, and counted. A ``stop`` drains the session; a control
goes to the pipeline within ``CONTROL_TIMEOUT`` (past it the pipeline stalled and its session fails), or waits,
at most :data:`EARLY_CONTROL_LIMIT` of them, until the pipeline session exists. Messages a transport could not
hand on (on LiveKit, a sender's newer message replaced them while they waited their turn: ``replaced``) are told
to their sender as ``dropped``, with how many, before the message that replaced them is read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from pipelines.contract import BidirectionalService, Control, ControlRejected, ControlType
from pipelines.pipeline_exits import exits_as_errors
from states.stream_session import DrainCause

from . import protocol
from .call_deadline import call_deadline
from .transport import DataReceived

if TYPE_CHECKING:
    from .metrics import ServerMetrics
    from .model_worker import ModelWorker
    from .registry import SessionRecord

__all__ = ["CONTROL_TIMEOUT", "EARLY_CONTROL_LIMIT", "ControlIntake"]

# seconds the service may take to take one control: past the heartbeat deadlines (a process worker's 10 s, an
# agent's 5 s by default), so a frozen worker is named as the worker's failure, not as a stalled pipeline
CONTROL_TIMEOUT = 15.0
EARLY_CONTROL_LIMIT = 64  # controls held before the pipeline session exists

#: how a runner answers one participant (``sender``) alone
Answer = Callable[[str | None, bytes], Awaitable[None]]


class ControlIntake:
    """One session's participants' data, from the room to the pipeline session (owned by its room runner)."""

    def __init__(self, record: SessionRecord, worker: ModelWorker, metrics: ServerMetrics, *, own_identity: str,
                 max_data_message_bytes: int, answer: Answer, drain: Callable[[DrainCause], None],
                 fail: Callable[[str, DrainCause], None]) -> None:
        self._record = record
        self._worker = worker
        self._metrics = metrics
        self._own_identity = own_identity
        self._max_bytes = max_data_message_bytes
        self._answer = answer
        self._drain = drain
        self._fail = fail
        self._early: deque[Control] = deque()
        self.ready = trio.Event()  # the pipeline session exists (or the pipeline streams on its own)
        #: what ``create_session`` returned: the runner closes it, even if it is no id
        self.pipeline_session: Any = None

    async def started(self, pipeline_session: Any) -> None:
        """The pipeline session exists: the controls held until now go to it, in order."""
        self.pipeline_session = pipeline_session
        self.ready.set()
        service = self._worker.service
        while self._early and isinstance(service, BidirectionalService):
            await self.apply(service, self._early.popleft())

    async def on_data(self, event: DataReceived) -> None:
        record, metrics = self._record, self._metrics
        if event.sender_identity == self._own_identity:
            return  # the runner's own messages, where a transport echoes them
        if event.replaced:
            await self._reject(event.sender_identity, "dropped", f"{event.replaced} message(s) you sent were replaced "
                               f"by a newer one while they waited their turn (faster than the room takes them)",
                               count=event.replaced)
        try:
            parsed = protocol.parse_control(
                event.payload,
                topic=event.topic,
                sender_identity=event.sender_identity,
                controller_identity=record.controller_identity,
                session_id=record.session_id,
                max_bytes=self._max_bytes,
            )
        except protocol.InvalidControl as exc:  # a wrong topic too: every refusal is answered, to its sender
            await self._reject(event.sender_identity, exc.reason, exc.detail)
            return
        if isinstance(parsed, protocol.DeliveryAck):
            return
        if parsed.type is ControlType.STOP:
            metrics.record_control(record.session_id)
            self._drain(DrainCause.STOP)
            return
        service = self._worker.service
        if not isinstance(service, BidirectionalService):  # a server-push pipeline streams on its own
            await self._reject(event.sender_identity, "no_controls",
                               "this pipeline pushes its stream and takes no controls but stop")
            return
        metrics.record_control(record.session_id)
        if not self.ready.is_set():
            if len(self._early) >= EARLY_CONTROL_LIMIT:
                await self._reject(event.sender_identity, "not_ready", "too many controls before the stream started")
                return
            self._early.append(parsed)
            return
        await self.apply(service, parsed)

    async def apply(self, service: BidirectionalService, control: Control) -> None:
        """One control to the pipeline session, within CONTROL_TIMEOUT; the service's refusal is answered."""
        assert self.pipeline_session is not None
        try:
            with call_deadline(CONTROL_TIMEOUT) as deadline, exits_as_errors("push_control"):
                await service.push_control(self.pipeline_session, control)
            if deadline.missed:
                self._fail(f"the pipeline did not take a control within {CONTROL_TIMEOUT:g} s",
                           DrainCause.PIPELINE_STALLED)
        except ControlRejected as exc:
            if self._worker.failing:  # the service lost the session with its worker: that failure is the answer, on
                return  # its way (the service's "unknown session" came first, naming its own session id)
            # every control taken came from the controller (parse_control refuses anyone else's)
            await self._reject(self._record.controller_identity, "service", exc.reason)

    async def _reject(self, sender: str | None, reason: str, detail: str, *, count: int | None = None) -> None:
        """Answer ``sender`` alone and count it; ``count``: how many messages the answer covers, said in it."""
        self._metrics.record_control_rejection(reason, count or 1)
        await self._answer(sender, protocol.rejection_message(self._record.session_id, reason, detail, count=count))
