"""A local room's members and their bounded queues: each browser client, a remote worker agent, the room.

:mod:`server.transport.local` runs the hub (admission, the sockets' tasks, the in-process worker's
connection); what it keeps per room and per participant, and every bound on what a participant that
does not read can make the server hold, is here.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..json_limits import MAX_JSON_VALUES, payload_body
from ..tokens import MAX_IDENTITY_LENGTH
from .backlog_budget import BacklogBudget
from .base import DataReceived, ParticipantJoined, RoomEvent
from .data_pace import DATA_BYTE_BURST
from .refusals import refused
from .worker_inbox import EVENT_BACKLOG, WORKER_TAKE_TIMEOUT, WorkerInbox

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .local import WorkerConnection

__all__ = [
    "ENVELOPE_BYTES", "EVENT_BACKLOG", "FRAME_BACKLOG", "HELD_FOR_WORKER", "HELD_FOR_WORKER_BYTES",
    "TEXT_BACKLOG", "TEXT_BACKLOG_BYTES", "RemoteWorkerPresence", "Room", "Subscriber", "compact_json", "data_message",
    "largest_fanned_out", "largest_sent", "text_backlog_bytes",
]

FRAME_BACKLOG = 2  # media messages kept per slow subscriber (newest win)
#: unsent data messages a client may fall behind by before it is sent away: twice what a participant's burst
#: (DATA_BURST, 500) and the worker's answer to each make the room send at once
TEXT_BACKLOG = 2048
#: ... and the characters of them (ASCII JSON: bytes) it may fall behind by: four times a participant's burst of
#: text (DATA_BYTE_BURST), so that what one may legally send never sends an honest viewer away
TEXT_BACKLOG_BYTES = 1024 * 1024
ENVELOPE_BYTES = 256  # what a client's message may hold past --max-data-message-bytes: its envelope (topic, keys)
#: how much a message's text can grow as the room re-encodes it for its fan-out: three times its bytes (JSON writes a
#: two-byte character as ``\u00e9``), 16 characters for each of its values (the space after a separator, a float's
#: digits written out: ``1e15`` is ``1000000000000000.0``), and the room's framing with its sender's identity
REENCODED_GROWTH = 3
GROWTH_PER_VALUE = 16
FAN_OUT_FRAMING = 64 + MAX_IDENTITY_LENGTH
HELD_FOR_WORKER = 32  # data messages a room holds for a worker that has not joined yet (controls are small)
HELD_FOR_WORKER_BYTES = 64 * 1024  # ... and their bytes: a queued session's room holds this at most


@attrs.define(eq=False)
class Subscriber:
    """A browser participant: its queues are drained by its WebSocket task."""

    identity: str
    role: str
    can_publish_data: bool
    texts: deque = attrs.Factory(deque)  # data and participant messages: never dropped (bounded below)
    media: deque = attrs.Factory(lambda: deque(maxlen=FRAME_BACKLOG))
    ready: trio.Event = attrs.Factory(trio.Event)
    presence: trio.CancelScope = attrs.Factory(trio.CancelScope)  # cancelled to send the client away
    #: the server's budget for every socket's queued text together (the LocalRooms'); past it the furthest behind go
    backlog: BacklogBudget = attrs.field(factory=BacklogBudget, kw_only=True)
    #: the characters of text it may fall behind by (:func:`text_backlog_bytes` of the room's message size)
    text_limit: int = attrs.field(default=TEXT_BACKLOG_BYTES, kw_only=True)
    too_slow: bool = False
    dropped_frames: int = 0
    text_size: int = 0  # characters queued in ``texts``
    leaving: bool = False  # send what is queued, then leave
    #: times the text queue was replaced (sent away, gone): a send begun before it does not take the new head
    replaced: int = 0
    #: told each refusal this client is sent, by reason, with how many messages it answers (LocalRooms.on_refused)
    on_refused: Callable[[str, int], None] = attrs.field(default=lambda reason, count: None, kw_only=True)

    def refuse(self, reason: str, detail: str | None = None, *, count: int = 1) -> None:
        """Tell the client why its message (``count`` of them) was not passed on (:func:`.refusals.refused`); counted
        once queued (a client being sent away is told, and counted, only that)."""
        self.push_text(refused(reason, detail))
        if not self.too_slow:  # queued: not dropped for a client already sent away, nor one this sends away
            self.on_refused(reason, count)

    def push_text(self, message: str) -> None:
        if self.too_slow:
            return
        if len(self.texts) >= TEXT_BACKLOG or self.text_size + len(message) > self.text_limit:
            # a client that does not read its reliable messages is sent away rather than
            # letting its queue grow without bound (LiveKit drops such subscribers too)
            self.send_away()
            return
        self.texts.append(message)
        self.text_size += len(message)
        self.ready.set()
        self.backlog.add(self, len(message))  # past the server's budget, whoever is furthest behind is sent away

    def send_away(self, reason: str = "too_slow", detail: str | None = None) -> None:
        """Too slow (or another refusal ``reason``: the worker sends it away): what is queued goes, the client is told
        the refusal and sent away."""
        if self.too_slow:
            return
        self.too_slow = True  # nothing more is queued for it
        self.backlog.release(self)
        self.texts.clear()
        self.replaced += 1
        self.on_refused(reason, 1)
        message = refused(reason, detail)
        self.texts.append(message)
        self.text_size = len(message)
        self.presence.cancel()
        self.ready.set()

    def gone(self) -> None:
        """The client left: nothing it still has queued is sent or counted."""
        self.backlog.release(self)
        self.texts.clear()
        self.replaced += 1
        self.text_size = 0

    def leave(self) -> None:
        """Send what is queued, then leave (the session ended): no send is cut short, so the socket closes
        cleanly after the last message."""
        self.leaving = True
        self.ready.set()

    async def send_oldest_text(self, send: Callable[[str | bytes], Awaitable[None]]) -> None:
        """Send the oldest queued text; it leaves the queue only once sent, and only if the queue was not replaced
        meanwhile: a send can return after it delivered and yielded (a trio channel's, a socket's), and the worker
        may have sent the client away in that gap, leaving its refusal at the head."""
        replaced = self.replaced
        await send(self.texts[0])
        if replaced == self.replaced:
            self._sent_text()

    def _sent_text(self) -> None:
        """The oldest queued text message has been sent."""
        size = len(self.texts.popleft())
        self.text_size -= size
        if not self.too_slow:  # a refusal is not counted (sending away released the rest)
            self.backlog.sent(self, size)

    def push_media(self, message: bytes) -> None:
        if len(self.media) == self.media.maxlen:
            self.dropped_frames += 1
        self.media.append(message)
        self.ready.set()


@attrs.define(eq=False)
class RemoteWorkerPresence:
    """A worker agent in a local room over its own WebSocket (the agent runs on another process or host).

    Room events for its runner queue in its :class:`~.worker_inbox.WorkerInbox`, as the in-process worker's do: past
    its backlog the senders wait; participant events always go in.
    """

    identity: str
    inbox: WorkerInbox[str] = attrs.Factory(WorkerInbox)

    def deliver(self, event: RoomEvent) -> None:
        if isinstance(event, DataReceived):
            message = data_message(event.topic, event.payload, event.sender_identity or "")
        elif isinstance(event, ParticipantJoined):
            message = json.dumps({"type": "participant_joined", "identity": event.identity})
        else:
            message = json.dumps({"type": "participant_left", "identity": event.identity})
        self.inbox.put(message, event)


@attrs.define(eq=False)
class Room:
    name: str
    subscribers: dict[str, Subscriber] = attrs.Factory(dict)
    worker: WorkerConnection | RemoteWorkerPresence | None = None
    last_frame: bytes | None = None
    closed: bool = False  # its session ended: its clients leave once the worker has
    # its worker told the room how the session ended (``done`` or ``error`` on tf.status): the server says it no more
    worker_said_last: bool = False
    #: the server's last word, kept while a worker that says it told the room is still in it: said as it leaves,
    #: unless it did tell the room
    last_word_due: bytes | None = None
    # data sent before the worker joined (an agent's comes a moment after the controller may), handed to it when it does
    held: deque = attrs.Factory(deque)
    held_size: int = 0

    async def to_worker(self, event: DataReceived) -> str | None:
        """Deliver a client's data to the worker, waiting while its inbox is full (the sender's socket is not read
        meanwhile), or hold it until the worker joins. None once it went; else why not, for its sender:
        ``no_worker_yet`` (the room holds as much as it may for a worker that has not come), ``worker_stalled`` (the
        worker took none of the room's messages within WORKER_TAKE_TIMEOUT), ``session_ended`` (no worker will come)."""
        if self.closed and self.worker is None:
            return "session_ended"
        with trio.move_on_after(WORKER_TAKE_TIMEOUT):
            while (worker := self.worker) is not None and not worker.inbox.has_room():
                await worker.inbox.wait_for_room()  # it took one, or left (then the room holds the message)
            if self.worker is not None:
                self.worker.deliver(event)
                return None
            if self.closed:
                return "session_ended"
            if len(self.held) >= HELD_FOR_WORKER or self.held_size + len(event.payload) > HELD_FOR_WORKER_BYTES:
                return "no_worker_yet"
            self.held.append(event)
            self.held_size += len(event.payload)
            return None
        return "worker_stalled"

    def drop_held(self) -> None:
        """No worker will come now (the session ended): what was held for one goes, and its senders are told."""
        self.tell_untaken(Counter(event.sender_identity or "" for event in self.held))
        self.held.clear()
        self.held_size = 0

    def tell_untaken(self, senders: Counter[str]) -> None:
        """Each sender whose messages no worker will take (the session ended first) is told how many, once."""
        for identity, count in senders.items():
            if (subscriber := self.subscribers.get(identity)) is not None:
                subscriber.refuse("session_ended", f"{count} of this client's messages were not delivered: the "
                                                   f"session ended before its worker took them", count=count)

    def worker_joined(self, worker: WorkerConnection | RemoteWorkerPresence) -> None:
        """The worker is in the room: what clients sent before it came is delivered first, in order."""
        self.worker = worker
        while self.held:
            worker.deliver(self.held.popleft())
        self.held_size = 0

    def send_clients_away(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.leave()

    def identities(self) -> set[str]:
        present = set(self.subscribers)
        if self.worker is not None:
            present.add(self.worker.identity)
        return present

    def broadcast_text(self, message: str, *, skip: str | None = None) -> None:
        for identity, subscriber in self.subscribers.items():
            if identity != skip:
                subscriber.push_text(message)

    def send_text(self, message: str, to: str | None = None) -> None:
        """To every client, or with ``to`` to that one alone (the answer to its own message; the others are sent
        nothing of it, and nothing is sent when it has left)."""
        if to is None:
            self.broadcast_text(message)
        elif (subscriber := self.subscribers.get(to)) is not None:
            subscriber.push_text(message)


def largest_sent(max_data_message_bytes: int) -> int:
    """The longest text a client's message may be as sent (its payload is then held to the setting as compact UTF-8):
    JSON's escapes, which Python's ``json.dumps`` writes by default, make it up to :data:`REENCODED_GROWTH` times as
    long (an emoji: 12 bytes for 4), and a prompt so sent, within the limit, had its socket closed (1009)."""
    return REENCODED_GROWTH * max_data_message_bytes + ENVELOPE_BYTES


def largest_fanned_out(max_data_message_bytes: int) -> int:
    """The most text one legal data message makes the room send a participant: the message (the room reads at most
    the setting plus ENVELOPE_BYTES of it) re-encoded, in the room's framing."""
    return (REENCODED_GROWTH * (max_data_message_bytes + ENVELOPE_BYTES) + GROWTH_PER_VALUE * MAX_JSON_VALUES
            + FAN_OUT_FRAMING)


def text_backlog_bytes(max_data_message_bytes: int) -> int:
    """The text a client may fall behind by: TEXT_BACKLOG_BYTES, or, where --max-data-message-bytes allows larger
    messages, its sender's burst and two of the largest legal messages, so that one legal message never sends an
    honest viewer away (at the 1 MiB allowed, one sent every viewer away ``too_slow``: the bound was a fixed 1 MiB)."""
    return max(TEXT_BACKLOG_BYTES, DATA_BYTE_BURST + 2 * largest_fanned_out(max_data_message_bytes))


def compact_json(payload: Any) -> bytes:
    """An envelope's payload as the bytes the worker gets: compact UTF-8 JSON, about what the client sent. Python's
    default (spaces after separators, ``\\uXXXX`` for every non-ASCII character) made a client's message up to 3 times
    larger, and the message-size limit refused what it measured there: a 10 KB control as 15 KB, a prompt of 1,100
    emoji sent as 4.5 KB as 13 KB."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def data_message(topic: str, payload: bytes, sender: str, *, parsed: Any = None) -> str:
    """The text a subscriber gets for a data message: its payload read by the bounded parser (never raising), or,
    when an envelope's ``parsed`` payload is given (that parser read it already), that one unless it is text."""
    body = parsed if parsed is not None and not isinstance(parsed, str) else payload_body(payload)
    return json.dumps({"type": "data", "topic": topic, "payload": body, "from": sender})
