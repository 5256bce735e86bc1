"""Local rooms: the embedded default transport, with LiveKit's roles, tokens and topics.

Rooms live inside the server process. The room runner joins in-process as the
worker; browsers join by WebSocket at ``/v1/rooms/{room}/ws?token=...`` with the
same JWTs the API mints for LiveKit. Grants are enforced here: a viewer token
cannot publish data (its messages are refused and answered), an expired,
forged or other-room token is refused before joining, and an identity can be
present only once per room.

Wire format (WebSocket):
- text messages are JSON: a client sends ``{"topic": "tf.control", "payload": {...}}``;
  the server sends ``{"type": "data", "topic": ..., "payload": ..., "from": identity}``,
  ``{"type": "participant_joined"|"participant_left", "identity": ...}``,
  ``{"type": "joined", "identity", "role", "participants": [...]}`` once, and
  ``{"type": "refused", "reason": ...}`` when a message is not allowed;
- a client may not publish on the worker's topics (``tf.status``, ``tf.metrics``: refused with
  ``server_topic``), nor send JSON nested deeper than 33 levels (``too_deep``) or text that is not
  encodable (``unencodable_text``); a room holds at most 64 client sockets (``room_full``), and a viewer joins
  only on a free viewer seat of its session (``viewer_limit``: :mod:`server.viewer_seats`; a worker's
  ``send_away``, the port's way to remove a participant, closes a socket with such a refusal);
- a client that falls more than 2048 data messages or 1 MiB of them behind (more where larger messages are allowed:
  ``text_backlog_bytes``) is sent away
  (``{"type": "refused", "reason": "too_slow"}``) instead of growing the server's memory (by count alone, a
  controller's 12 KiB messages fanned out to 32 viewers that never read held 24 MiB for each, for as long
  as their write deadline let them stay), and so are those furthest behind when all clients' queues together pass
  the server's budget (:mod:`.backlog_budget`, 64 MiB); a participant's data is paced by what it makes the room send
  (:mod:`.data_pace`), so that its legal burst fits in that backlog and a viewer reading 256 KiB a second keeps up;
- the worker's answer to one participant's message (a refused control's ``control_rejected``) goes to that
  participant alone, as LiveKit's ``destination_identities`` does; the room's news (status, chunks, the end) to
  every client; a worker agent addresses an answer by adding ``"to": identity`` to its envelope;
- a client's data waits for the worker, never dropped: while 256 of its messages are untaken, the room stops reading
  the sender's socket (:mod:`.worker_inbox`; at most 30 s for one message, then it is refused ``worker_stalled``);
- data a client sends before the worker is in the room (a queued session's, an agent's a moment before it
  joins) is held for it, 32 messages and 64 KiB at most, and delivered in order when it joins; past that it
  is refused (``no_worker_yet``), never dropped without a word;
- binary messages are media: ``b"V"`` + a JPEG frame, or ``b"A"`` + 4-byte
  little-endian sample rate + 2-byte channel count + PCM16 samples.

Fan-out is LiveKit-like: the worker publishes once and every subscriber gets
it. A subscriber that reads too slowly loses frames (the newest are kept), never
data messages, and never slows the worker or the other subscribers.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
import trio

from pipelines.contract import Audio

from .. import json_limits
from ..protocol import STATUS_TOPIC
from ..token_bucket import KeptBuckets
from ..tokens import SERVER_STATUS_IDENTITY, TokenIssuer, TokenRejected, single_token
from .backlog_budget import BacklogBudget
from .base import ParticipantJoined, ParticipantLeft, RoomEvent, TransportError
from .data_pace import DataPace
from .jpeg import encode_jpeg
from .local_reading import read_client
from .local_room import RemoteWorkerPresence, Room, Subscriber, compact_json, data_message, text_backlog_bytes
from .worker_inbox import EVENT_BACKLOG, WorkerInbox

__all__ = ["EVENT_BACKLOG", "LocalRooms", "RemoteWorkerPresence", "WorkerConnection", "encode_jpeg"]

MAX_CLIENTS_PER_ROOM = 64  # browser sockets one room holds (a controller and its viewers)
KEPT_PACES = 4096  # participants' data paces kept after they left, at most (each until it is full, a second or so)


def _ends_session(payload: object) -> bool:
    """Whether a worker's ``tf.status`` message is its session's last word (``done`` or ``error``)."""
    if isinstance(payload, str):
        return payload.startswith(('{"type":"done"', '{"type":"error"'))  # the runners' own compact JSON
    return isinstance(payload, dict) and payload.get("type") in ("done", "error")


def _say_last_word(room: Room, last_word: bytes) -> None:
    """The server's last word to the room, unless its worker said one there."""
    if not room.worker_said_last:
        room.broadcast_text(data_message(STATUS_TOPIC, last_word, SERVER_STATUS_IDENTITY))


class WorkerConnection:
    """The room runner's side of a local room (implements the RoomConnection port)."""

    def __init__(self, rooms: LocalRooms, room: Room, identity: str) -> None:
        self._rooms = rooms
        self._room = room
        self._identity = identity
        #: what the room hands the runner; past its backlog the room stops reading the sender (it dropped the oldest)
        self.inbox: WorkerInbox[RoomEvent] = WorkerInbox()
        self._closed = False

    @property
    def identity(self) -> str:
        return self._identity

    def participants(self) -> frozenset[str]:
        return frozenset(self._room.subscribers)

    @property
    def queued_data(self) -> int:
        """Data events waiting for the runner (never above EVENT_BACKLOG: their senders wait)."""
        return self.inbox.queued_data

    def deliver(self, event: RoomEvent) -> None:
        """Queue an event for the runner: data only once the inbox has room for it (:meth:`Room.to_worker` waits for
        that), participant events always."""
        self.inbox.put(event, event)

    def events(self) -> AsyncIterator[RoomEvent]:
        # an iterator object, not an async generator: a runner cancelled mid-loop leaves nothing to finalize
        return _EventStream(self)

    async def next_event(self) -> RoomEvent:
        """The next event, in arrival order; StopAsyncIteration once disconnected."""
        event = await self.inbox.take()
        if event is None:
            raise StopAsyncIteration
        return event

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None:
        if self._closed:
            raise TransportError("the worker left the room")
        jpeg = await trio.to_thread.run_sync(encode_jpeg, frame, limiter=self._rooms.encode_limiter)
        message = b"V" + jpeg
        self._room.last_frame = message  # a late joiner sees the current picture at once
        for subscriber in self._room.subscribers.values():
            subscriber.push_media(message)

    async def publish_audio(self, audio: Audio) -> None:
        if self._closed:
            raise TransportError("the worker left the room")
        message = b"A" + struct.pack("<IH", audio.sample_rate, audio.channels) + audio.pcm
        for subscriber in self._room.subscribers.values():
            subscriber.push_media(message)

    async def send_data(self, topic: str, payload: bytes, *, reliable: bool = True, to: str | None = None) -> None:
        if self._closed:
            raise TransportError("the worker left the room")
        self._room.send_text(data_message(topic, payload, self._identity), to)
        if to is None and topic == STATUS_TOPIC and _ends_session(payload.decode(errors="replace")):
            self._room.worker_said_last = True

    async def send_away(self, identity: str, reason: str, detail: str) -> None:
        """Close ``identity``'s socket with the refusal ``reason`` (the door keeps viewers over the seats out itself)."""
        if (subscriber := self._room.subscribers.get(identity)) is not None:
            subscriber.send_away(reason, detail)

    async def disconnect(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rooms._leave_worker(self._room, self)


class _EventStream:
    def __init__(self, connection: WorkerConnection) -> None:
        self._connection = connection

    def __aiter__(self) -> _EventStream:
        return self

    async def __anext__(self) -> RoomEvent:
        return await self._connection.next_event()


class LocalRooms:
    """The room hub (one per server) and the RoomTransport for the runners."""

    name = "local"

    def __init__(self, issuer: TokenIssuer, *, max_data_message_bytes: int = 12288) -> None:
        self._issuer = issuer
        self._rooms: dict[str, Room] = {}
        self.max_data_message_bytes = max_data_message_bytes
        self.encode_limiter = trio.CapacityLimiter(2)
        self.backlog = BacklogBudget()  # every client socket's queued text together (``backlog.queued``: bytes)
        #: each participant's DataPace by (room, identity), kept across its reconnects until it is full again
        self.paces: KeptBuckets[DataPace] = KeptBuckets(DataPace, most=KEPT_PACES)
        self._expected_workers: dict[str, str] = {}  # room -> the agent identity the runtime started there
        #: room -> the one listener told who is in it at each join and leave (the runtime's ``RoomFollow``, from a
        #: session's creation): at most one a live session, and its end removes it (``unwatch_participants``)
        self._watchers: dict[str, Callable[[frozenset[str]], None]] = {}
        #: whether ``room`` is a live session's (the app answers from its registry): a token of a session
        #: that ended no longer opens its room
        self.room_open: Callable[[str], bool] = lambda room: True
        #: why a viewer of ``identity`` may not join ``room`` now, or None (the runtime's seats: ``ViewerSeats.door``;
        #: ``take``: it joins, and its token's seat is spent)
        self.viewer_door: Callable[[str, str, bool], str | None] = lambda room, identity, take: None
        #: told each refusal a client is sent, by reason, with how many messages it answers (the server's metrics)
        self.on_refused: Callable[[str, int], None] = lambda reason, count: None

    def expect_worker(self, room: str, identity: str) -> None:
        """A worker agent was started for ``room``: its worker token may join over the WebSocket."""
        self._expected_workers[room] = identity

    def forget_worker(self, room: str) -> None:
        self._expected_workers.pop(room, None)

    def watch_participants(self, room: str, listener: Callable[[frozenset[str]], None]) -> None:
        """Call ``listener`` with who is in ``room`` (its worker included) now, and again at once whenever someone
        joins or leaves, until :meth:`unwatch_participants`: the server knows each session's room as it changes
        (it read an agent's room on a clock, so a viewer that left and came back at once was still counted). One listener a
        room: a second replaces the first. The listener is called on this task and must not raise."""
        self._watchers[room] = listener
        listener(self.participants(room))

    def unwatch_participants(self, room: str) -> None:
        self._watchers.pop(room, None)

    def _moved(self, room: Room) -> None:
        """Someone joined or left ``room``: its listener, if any, is told who is there now."""
        listener = self._watchers.get(room.name)
        if listener is not None:
            listener(frozenset(room.identities()))

    def close_clients(self) -> None:
        """Server shutdown: browsers go as at a session's end, queue first (the front's grace bounds them); a closed
        room's worker still in it (an agent leaves just after its finish) sends its own away as it leaves."""
        for room in self._rooms.values():
            if not (room.closed and room.worker is not None):
                room.send_clients_away()

    async def open_room(self, room: str, *, lifetime: float) -> None:
        """Nothing to make: a local room opens with its session's record (``room_open``) and refuses every
        token once the session ended."""

    def close_room(self, room: str, last_word: bytes | None = None, *, worker_told: bool = False) -> None:
        """The room's session ended: once its worker has left too, its browsers get what is queued for them (the
        worker's ``done``, its leaving) and are sent away, so that no socket outlives its session (they stayed,
        answering pings, for as long as they liked).

        ``last_word`` is the session's last ``tf.status`` message: unless the worker said one here (an agent that
        fenced itself said it first), the server sends it, as ``chunkline-server``, and sends the clients away at
        once, without waiting for a worker that may still be in the room (a frozen agent, until its socket times
        out). A worker that says it told the room (``worker_told``) and is still here is taken at its word: what it
        said comes through its socket before it leaves. One that is gone and said nothing here had not: an agent
        whose last word never arrived, or one that never joined and said it had (its controller got no last word).
        """
        found = self._rooms.get(room)
        if found is not None:
            found.closed = True
            found.drop_held()
            self._forget_if_empty(found)
            told_here = worker_told and found.worker is not None
            server_says = last_word is not None and not told_here
            if told_here:
                found.last_word_due = last_word  # said as the worker leaves, unless it did say it here
            if server_says:
                _say_last_word(found, last_word)
            if found.worker is None or server_says:
                found.send_clients_away()

    def room_names(self) -> tuple[str, ...]:
        return tuple(self._rooms)

    def participants(self, room: str) -> frozenset[str]:
        found = self._rooms.get(room)
        return frozenset() if found is None else frozenset(found.identities())

    def _room(self, name: str) -> Room:
        room = self._rooms.get(name)
        if room is None:
            room = self._rooms[name] = Room(name)  # created on first join, as LiveKit does
        return room

    def _forget_if_empty(self, room: Room) -> None:
        # data held for a worker that has not come stays with the room while its session lives (a controller
        # reconnecting lost it without a word); the session's end drops it (``close_room``)
        if not room.subscribers and room.worker is None and (room.closed or not room.held):
            self._rooms.pop(room.name, None)

    # -- the worker (room runner) ------------------------------------------------

    async def connect(self, room: str, identity: str, token: str, *, timeout: float) -> WorkerConnection:
        try:
            verified = self._issuer.verify(token, room=room)
        except TokenRejected as exc:
            raise TransportError(f"local room {room!r} refused the worker token: {exc.reason}") from exc
        if verified.role != "worker" or verified.identity != identity:
            raise TransportError(f"local room {room!r}: the token is not a worker token for {identity!r}")
        target = self._room(room)
        if identity in target.identities():
            raise TransportError(f"local room {room!r}: identity {identity!r} is already present")
        connection = WorkerConnection(self, target, identity)
        target.worker_joined(connection)
        self._moved(target)
        target.broadcast_text(json.dumps({"type": "participant_joined", "identity": identity}))
        return connection

    def _leave_worker(self, room: Room, connection: WorkerConnection | RemoteWorkerPresence) -> None:
        # senders waiting for room in its inbox are woken; those whose messages it never took are told
        room.tell_untaken(connection.inbox.close())
        if room.worker is connection:
            room.worker = None
            room.last_frame = None
            self._moved(room)
            if room.closed and room.last_word_due is not None:
                _say_last_word(room, room.last_word_due)
            room.last_word_due = None
            room.broadcast_text(json.dumps({"type": "participant_left", "identity": connection.identity}))
            if room.closed:
                room.send_clients_away()
        self._forget_if_empty(room)

    # -- browsers (WebSocket) ------------------------------------------------------

    def admit_at_door(self, room: str, tokens: Sequence[str]) -> Subscriber | RemoteWorkerPresence:
        """A room WebSocket's door: the one token its request gives, then :meth:`admit_client`. A refusal is counted
        by reason (``on_refused``), then raised for the door to tell."""
        try:
            return self.admit_client(room, single_token(tokens))
        except TokenRejected as exc:
            self.on_refused(exc.reason, 1)
            raise

    def admit_client(self, room: str, token: str) -> Subscriber | RemoteWorkerPresence:
        """Check a client's token for ``room``; raises TokenRejected (with a reason) to refuse it.

        A worker token admits a worker agent (:meth:`serve_worker`); the others a browser.
        """
        verified = self._issuer.verify(token, room=room)
        if verified.role not in ("controller", "viewer", "worker"):
            raise TokenRejected("wrong_role")
        if not self.room_open(room):
            raise TokenRejected("session_closed")
        target = self._rooms.get(room)
        if target is not None and verified.identity in target.identities():
            raise TokenRejected("identity_in_use")
        if verified.role == "worker":
            if self._expected_workers.get(room) != verified.identity:
                raise TokenRejected("wrong_role")  # only the agent the runtime started for this room
            return RemoteWorkerPresence(verified.identity)
        if target is not None and len(target.subscribers) >= MAX_CLIENTS_PER_ROOM:
            raise TokenRejected("room_full")
        if verified.role == "viewer" and (full := self.viewer_door(room, verified.identity, False)) is not None:
            raise TokenRejected("viewer_limit", full)
        return Subscriber(verified.identity, verified.role, verified.can_publish_data, backlog=self.backlog,
                          text_limit=text_backlog_bytes(self.max_data_message_bytes), on_refused=self.on_refused)

    async def serve_worker(
        self,
        room: str,
        worker: RemoteWorkerPresence,
        send: Callable[[str | bytes], Awaitable[None]],
        receive: Callable[[], Awaitable[str | bytes]],
    ) -> None:
        """Host a worker agent's presence until its socket closes: its media and data fan out
        to the room as an in-process worker's do; room events go back to it. Raises :class:`TokenRejected` for a
        room that has its worker already (the socket refuses it as at the door)."""
        target = self._room(room)
        if target.worker is not None or worker.identity in target.identities():
            raise TokenRejected("identity_in_use")
        target.worker_joined(worker)
        self._moved(target)
        target.broadcast_text(json.dumps({"type": "participant_joined", "identity": worker.identity}))
        await send(json.dumps({"type": "joined", "identity": worker.identity, "role": "worker",
                               "participants": sorted(target.subscribers)}))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_to_worker, worker, send)
                while True:
                    message = await receive()
                    if isinstance(message, bytes):
                        if message[:1] == b"V":
                            target.last_frame = message
                        for subscriber in target.subscribers.values():
                            subscriber.push_media(message)
                        continue
                    try:
                        envelope = json_limits.loads(message, wrapper_levels=1)
                        topic, payload, to = envelope["topic"], envelope["payload"], envelope.get("to")
                    except (json_limits.JsonRefused, KeyError, TypeError):
                        continue  # the agent is ours; a malformed envelope is dropped, not echoed
                    raw = payload.encode() if isinstance(payload, str) else compact_json(payload)
                    if to is None or isinstance(to, str):  # with "to", an answer to that participant alone
                        target.send_text(data_message(str(topic), raw, worker.identity, parsed=payload), to)
                        if to is None and topic == STATUS_TOPIC and _ends_session(payload):
                            target.worker_said_last = True
        finally:
            self._leave_worker(target, worker)

    @staticmethod
    async def _pump_to_worker(worker: RemoteWorkerPresence, send: Callable[[str | bytes], Awaitable[None]]) -> None:
        while (message := await worker.inbox.take()) is not None:
            await send(message)

    async def serve_client(
        self,
        room: str,
        subscriber: Subscriber,
        send: Callable[[str | bytes], Awaitable[None]],
        receive: Callable[[], Awaitable[str | bytes]],
    ) -> None:
        """Run one client's presence until its socket closes (then it leaves the room). Raises
        :class:`TokenRejected` for a client the room cannot take now, though the door let it in (the session ended,
        the identity joined, the room or the viewer seats filled meanwhile): the socket refuses it as at the door."""
        target = self._room(room)
        # the session may have ended since the client was admitted (the route's handshake awaits in between)
        reason = ("session_closed" if not self.room_open(room)
                  else "identity_in_use" if subscriber.identity in target.identities()
                  else "room_full" if len(target.subscribers) >= MAX_CLIENTS_PER_ROOM else None)
        full = None if reason is not None or subscriber.role != "viewer" else self.viewer_door(
            room, subscriber.identity, True)
        if reason is not None or full is not None:
            self._forget_if_empty(target)
            raise TokenRejected(reason or "viewer_limit", full)
        target.subscribers[subscriber.identity] = subscriber
        self._moved(target)  # before anyone is told: who hears of the join finds it counted
        subscriber.push_text(json.dumps({"type": "joined", "identity": subscriber.identity, "role": subscriber.role,
                                         "participants": sorted(target.identities() - {subscriber.identity})}))
        target.broadcast_text(json.dumps({"type": "participant_joined", "identity": subscriber.identity}), skip=subscriber.identity)
        if target.last_frame is not None:
            subscriber.push_media(target.last_frame)
        if target.worker is not None:
            target.worker.deliver(ParticipantJoined(subscriber.identity))
        try:
            with subscriber.presence:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_out, subscriber, send, nursery.cancel_scope)
                    await self._pump_in(target, subscriber, receive)
                    nursery.cancel_scope.cancel()
            if subscriber.presence.cancelled_caught:
                # the server is closing: flush what is queued (the worker's last status, "done")
                with trio.move_on_after(1.0):
                    while subscriber.texts:
                        await subscriber.send_oldest_text(send)
        finally:
            subscriber.gone()
            target.subscribers.pop(subscriber.identity, None)
            self._moved(target)  # before anyone is told: who hears of the leave finds it counted
            target.broadcast_text(json.dumps({"type": "participant_left", "identity": subscriber.identity}))
            if target.worker is not None:
                target.worker.deliver(ParticipantLeft(subscriber.identity))
            self._forget_if_empty(target)

    async def _pump_out(
        self, subscriber: Subscriber, send: Callable[[str | bytes], Awaitable[None]], end: trio.CancelScope
    ) -> None:
        """Send the subscriber's queues as they fill; once it is leaving and they are empty, end its presence."""
        while not (subscriber.leaving and not subscriber.texts and not subscriber.media):
            await subscriber.ready.wait()
            subscriber.ready = trio.Event()
            while subscriber.texts or subscriber.media:
                if subscriber.texts:
                    # a data message leaves its queue only once sent: a send cut short by the
                    # server closing leaves it queued for the final flush
                    await subscriber.send_oldest_text(send)
                else:
                    await send(subscriber.media.popleft())  # frames are droppable
        end.cancel()

    async def _pump_in(self, room: Room, subscriber: Subscriber, receive: Callable[[], Awaitable[str | bytes]]) -> None:
        # kept across its reconnects: a participant that leaves and comes back buys no fresh burst
        key = (room.name, subscriber.identity)
        pace = self.paces.hold(key, trio.current_time())
        try:
            await read_client(room, subscriber, receive, pace, self.max_data_message_bytes)
        finally:
            self.paces.release(key, trio.current_time())
