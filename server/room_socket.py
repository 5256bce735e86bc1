"""The local rooms' WebSocket, served at the protocol layer with a bound on everything a peer can do.

:mod:`server.front` hands each ``GET /v1/rooms/{room}/ws`` upgrade here (the head already read), and
:class:`RoomSocket` speaks WebSocket itself (wsproto) instead of leaving it to the ASGI server, so that:

- **a message is bounded while it arrives**: once the fragments of one message pass
  ``max_message_bytes`` the socket is closed (1009) and nothing more is read, so a peer cannot
  make the server buffer more than that (hypercorn keeps buffering after its own 1009);
- **every write has a deadline** (:data:`WRITE_DEADLINE`): a peer that stops reading is sent away
  once a write waits that long; no write is shielded from cancellation;
- **a peer must answer pings**: a ping every :data:`PING_INTERVAL`, and a peer that answers nothing
  for :data:`PONG_DEADLINE` (a frozen process whose kernel still accepts bytes) is sent away;
- **frames are paced, whatever they carry**: a participant's socket is read from the server's frame budget
  (:mod:`server.frame_budget`: all sockets together at most the budget, what idle sockets leave unused lent to
  those that want it, each socket its equal share at least; at most :data:`FRAMES_PER_SECOND` frames past a
  burst of :data:`FRAME_BURST` for one participant, kept across its reconnects) -- pings, pongs and a
  message's pieces as much as whole messages, which the rooms pace again as messages -- parsed a few at a
  time, as the share allows, and one message comes in at most :data:`MAX_MESSAGE_PIECES` pieces: a ping flood
  took a whole core and another session fell to 2 fps, 64 sockets each at its own pace took a session from
  16 to 6 fps, and endless empty fragments, which count no bytes, grew the server's memory without end.

Everything else — tokens, roles, topics, fan-out — is :meth:`LocalRooms.serve_client`'s, the same
code the ASGI route runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections import deque
from collections.abc import Awaitable, Sequence
from http import HTTPStatus
from typing import Final, NoReturn
from urllib.parse import parse_qs, unquote, urlsplit

import attrs
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from .frame_budget import FRAME_BURST, FRAMES_PER_SECOND, FrameBudget, FrameShare, JoiningTooOften
from .http_framing import head_end, parse_head
from .lingering import LINGER_BYTES, linger
from .loop_holds import loop_holds
from .reasons import echo
from .tokens import TokenRejected
from .transport.local import LocalRooms, RemoteWorkerPresence
from .transport.local_room import Subscriber

__all__ = [
    "FRAME_BURST", "FRAMES_PER_SECOND", "IDLE_DEADLINE", "MAX_MESSAGE_PIECES", "PING_INTERVAL", "PONG_DEADLINE",
    "WRITE_DEADLINE", "Deadlines", "PeerGone", "RoomSocket", "room_of",
]

log = logging.getLogger("chunkline.rooms")

WRITE_DEADLINE: Final = 10.0  # seconds one write to a peer may take
PING_INTERVAL: Final = 5.0  # seconds between pings
PONG_DEADLINE: Final = 15.0  # seconds a peer may answer nothing before it is sent away
IDLE_DEADLINE: Final = 30.0  # seconds an HTTP connection may be silent both ways (longer than any answer takes)
CLOSE_DEADLINE: Final = 1.0  # seconds the closing handshake may take before the connection is dropped
READ_SIZE: Final = 65536
WORKER_MESSAGE_BYTES: Final = 16 * 1024 * 1024  # a worker agent's media message (one encoded frame) may be this big
MAX_MESSAGE_PIECES: Final = 256  # pieces (fragments, or parts of one read) a participant's message may come in
ROOM_PREFIX: Final = "/v1/rooms/"
#: where a close frame from the peer leaves wsproto (it gives a CloseConnection for a frame it cannot parse too)
PEER_CLOSED: Final = frozenset({ConnectionState.REMOTE_CLOSING, ConnectionState.CLOSED})


@attrs.frozen
class Deadlines:
    """How long a peer may take (seconds): one write, between pings, to answer, to send its request head,
    how long an HTTP connection may move no byte either way (an idle keep-alive) before it is closed, and
    how long what a client still sends is read after it was answered (or sent its close frame) and is being
    closed (a lingering close, :mod:`server.lingering`)."""

    write: float = WRITE_DEADLINE
    ping_interval: float = PING_INTERVAL
    pong: float = PONG_DEADLINE
    head: float = 10.0
    idle: float = IDLE_DEADLINE
    linger: float = 2.0


class PeerGone(Exception):
    """The peer left, broke the protocol, sent too much, stopped reading or stopped answering."""


def room_of(target: str) -> str | None:
    """The room named by a ``/v1/rooms/{room}/ws`` request target, or None."""
    # origin-form as the app's router reads it: "//v1/rooms/r/ws" is a path (urlsplit would take "v1" for a
    # host), and repeated slashes are one, so no spelling of a room's path reaches hypercorn's WebSocket
    raw = urlsplit(target).path if "://" in target.split("?", 1)[0] else target.split("?", 1)[0].split("#", 1)[0]
    path = re.sub("/{2,}", "/", unquote(raw))
    if not path.startswith(ROOM_PREFIX) or not path.endswith("/ws"):
        return None
    room = path[len(ROOM_PREFIX) : -len("/ws")]
    return room if room and "/" not in room else None


class RoomSocket:
    """One peer's WebSocket on a raw stream, after the front read its request head (``head``)."""

    def __init__(
        self, stream: trio.abc.HalfCloseableStream, head: bytes, rooms: LocalRooms, *, max_message_bytes: int,
        deadlines: Deadlines, frames: FrameBudget,
    ) -> None:
        self._deadlines = deadlines
        self._frames = frames
        self._stream = stream
        self._head = head
        self._rooms = rooms
        self._ws = WSConnection(ConnectionType.SERVER)
        self._limit = max_message_bytes
        self._send_lock = trio.StrictFIFOLock()
        self._messages: deque[str | bytes] = deque()
        #: why the peer is gone, once known while messages it sent before are still to be taken: they are taken first
        self._gone: PeerGone | None = None
        self._fragments: list[str | bytes] = []
        self._fragment_bytes = 0
        self._pieces = 0  # of the message arriving now, empty ones included
        self._max_pieces = MAX_MESSAGE_PIECES
        self._frame_pace: FrameShare | None = None  # a participant's share of the server's frame budget
        self._holds = loop_holds()  # the peer's deadlines and silence leave out the loop's holds
        self._heard = self._holds.now()
        #: since when the server has waited for the peer's bytes (None while it reads none: the room waits for its
        #: worker, the pace holds it); only such a wait can be the peer's silence
        self._reading_since: float | None = None
        self._pending_pong = b""
        self.close_reason: str | None = None
        self.close_code = 1008  # policy violation, unless a bound says otherwise
        self._said_all = False  # the last word (a refusal, a close frame) went out whole: close lingering

    async def serve(self) -> None:
        """Handshake, then the peer's presence in its room until it leaves or is sent away."""
        try:
            request = self._request()
            if isinstance(request, RemoteProtocolError):
                hint = request.event_hint
                status, headers = (hint.status_code, hint.headers) if isinstance(hint, RejectConnection) else (400, [])
                why = f"not a WebSocket handshake: {request}"
                if status == HTTPStatus.UPGRADE_REQUIRED:  # wsproto calls a version other than 13 a missing header
                    why = (f"this server speaks WebSocket version 13 (Sec-WebSocket-Version: 13); the request asked "
                           f"for {self._versions_asked()}")
                await self._reject(status, "bad_websocket_handshake", why, headers)
                return
            room = room_of(request.target)
            tokens = parse_qs(urlsplit(request.target).query, keep_blank_values=True).get("token", [])
            if room is None:
                await self._reject(404, "not_found", "no room at this path (a room's WebSocket is /v1/rooms/{room}/ws)")
                return
            await self._write(self._ws.send(AcceptConnection()))
            try:
                subscriber = self._rooms.admit_at_door(room, tokens)
            except TokenRejected as exc:
                await self._send(exc.refusal())
                await self._close(4401, exc.reason)
                return
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._keep_alive, nursery.cancel_scope)
                    if isinstance(subscriber, RemoteWorkerPresence):  # a worker agent publishing from its process
                        self._limit = max(self._limit, WORKER_MESSAGE_BYTES)
                        self._max_pieces = max(MAX_MESSAGE_PIECES, WORKER_MESSAGE_BYTES // 1024)
                        # the server's own agent, holding a worker token: its media (the stream) is not paced
                        await self._refused_as_at_the_door(self._rooms.serve_worker(room, subscriber, self._send,
                                                                                    self._receive))
                    else:
                        await self._join(room, subscriber)
                    nursery.cancel_scope.cancel()
            except* (PeerGone, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await self._close(1000 if self.close_reason is None else self.close_code, self.close_reason or "")
        except (PeerGone, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if self.close_reason is not None:
                log.info("room socket sent away: %s", self.close_reason)
            try:
                if self._said_all and self.close_code != 1009:  # past a message too big nothing more is read
                    # the peer may still be sending (controls, pongs): closing now would reset the connection,
                    # and its kernel would drop the close frame and the `done` before it, not read yet
                    await self._await_close_reply()
                    await linger(self._stream, self._deadlines.linger)
            finally:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await self._stream.aclose()

    async def _await_close_reply(self) -> None:
        """Once this side's close frame is sent, read until the peer's close frame answers it (RFC 6455 7.1.1: the
        connection ends once both were sent), within CLOSE_DEADLINE and LINGER_BYTES; what else it sends is dropped.
        The write side was shut at once: a client whose transport closes at the end of its stream (aiohttp) could
        not send its answer then, and reported 1006, an abnormal closure, for a session that ended well."""
        left = LINGER_BYTES
        with trio.move_on_after(CLOSE_DEADLINE), contextlib.suppress(
            RemoteProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError
        ):
            while self._ws.state is ConnectionState.LOCAL_CLOSING and left > 0:
                data = await self._stream.receive_some(min(READ_SIZE, left))
                if not data:
                    return
                left -= len(data)
                self._ws.receive_data(data)
                for _ in self._ws.events():
                    pass  # the peer's close frame moves the connection to CLOSED; anything before it is dropped

    async def _join(self, room: str, subscriber: Subscriber) -> None:
        """A participant's presence, paced by the frame budget: one reconnecting over and over joins at its pace,
        and a socket that would wait too long for it is refused ``joining_too_often``."""
        try:
            with self._frames.share((room, subscriber.identity)) as self._frame_pace:
                wait = self._frame_pace.join_wait(trio.current_time())
                if wait > 0:
                    await trio.sleep(wait)
                await self._refused_as_at_the_door(self._rooms.serve_client(room, subscriber, self._send,
                                                                            self._receive))
        except JoiningTooOften as exc:
            self.close_reason, self.close_code = "joining_too_often", 4429
            await self._send(json.dumps({"type": "refused", "reason": self.close_reason, "detail": str(exc)}))

    async def _refused_as_at_the_door(self, presence: Awaitable[None]) -> None:
        """A presence the room could not take after all (the session ended, the identity joined meanwhile) is refused
        with the door's close code, 4401, not closed as a visit that ended (1000)."""
        try:
            await presence
        except TokenRejected as exc:
            self.close_reason, self.close_code = exc.reason, 4401
            await self._send(exc.refusal())

    # -- the protocol ---------------------------------------------------------------

    def _request(self) -> Request | RemoteProtocolError:
        """The handshake's request, or why it is not one (the front read a whole head, so there is no other case)."""
        try:
            self._ws.receive_data(self._head)
            for event in self._ws.events():
                if isinstance(event, Request):
                    return event  # frames that came with the head are parsed as the socket's pace allows
        except RemoteProtocolError as exc:
            return exc
        except UnicodeDecodeError:  # wsproto decodes a list header (Connection, Sec-WebSocket-Protocol) as ASCII
            return RemoteProtocolError(f"{self._non_ascii_header()} holds a byte that is not ASCII",
                                       event_hint=RejectConnection(status_code=400))
        return RemoteProtocolError("the request head is incomplete", event_hint=RejectConnection())

    def _non_ascii_header(self) -> str:
        """The name of the head's first field holding a byte past ASCII (it was a closed connection, nothing said)."""
        for line in self._head.split(b"\r\n")[1:]:
            if not line.isascii():
                return f"the header {echo(line.partition(b':')[0].decode('ascii', 'replace'))}"
        return "a header"

    def _versions_asked(self) -> str:
        """The ``Sec-WebSocket-Version`` values of the head, as a client can read them back."""
        end = head_end(self._head, 0)
        asked = parse_head(self._head[:end] if end >= 0 else self._head).values(b"sec-websocket-version")
        if not asked:
            return "no version (the Sec-WebSocket-Version field is missing)"
        return "version " + ", ".join(echo(value.decode("latin-1")) for value in asked)

    async def _reject(self, status: int, error: str, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Answer the handshake with ``status`` and the JSON error every refusal of the server has."""
        body = json.dumps({"error": error, "detail": detail}).encode()
        head = [b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode()), b"Content-Type: application/json",
                b"Connection: close", b"Content-Length: %d" % len(body)]
        head += [name + b": " + value for name, value in headers if name.lower() != b"content-length"]
        await self._write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self._said_all = True

    def _absorb(self, most: int | None = None) -> int:
        """Turn the events wsproto has, ``most`` at most (all when None), into messages, pongs and closes (raises
        PeerGone); returns how many. Those past ``most`` wait in wsproto, not yet parsed."""
        events = 0
        for event in self._ws.events():
            events += 1
            if isinstance(event, TextMessage | BytesMessage):
                data = event.data
                self._fragment_bytes += len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
                self._pieces += 1
                if self._fragment_bytes > self._limit:
                    self._too_big(f"message larger than {self._limit} bytes")
                if self._pieces > self._max_pieces:
                    self._too_big(f"message in more than {self._max_pieces} pieces")
                if data:
                    self._fragments.append(data)
                if event.message_finished:
                    joiner = "" if isinstance(data, str) else b""
                    self._messages.append(joiner.join(self._fragments))  # type: ignore[arg-type]
                    self._fragments.clear()
                    self._fragment_bytes = self._pieces = 0
            elif isinstance(event, Ping):
                self._pending_pong += self._ws.send(event.response())
            elif isinstance(event, CloseConnection):
                if self._ws.state not in PEER_CLOSED:  # no close frame came: wsproto's word for a frame it cannot read
                    # the peer broke the protocol (a text frame not UTF-8, an unmasked frame, a bad close code...):
                    # answered with wsproto's code (1002, 1007) and why, where a 1000 "normal closure" said nothing
                    self.close_reason, self.close_code = f"protocol error: {event.reason}", event.code
                raise PeerGone(self.close_reason or "closed by the peer")
            elif isinstance(event, Pong):
                pass  # any frame counts as being alive (below)
            if most is not None and events >= most:
                break  # wsproto keeps the rest of what was read, and parses it when asked again
        if events:
            self._heard = self._holds.now()
        return events

    def _too_big(self, reason: str) -> NoReturn:
        """Cut the message arriving now: 1009, and nothing more of it is read or held."""
        self.close_reason = reason
        self.close_code = 1009  # message too big
        self._fragments.clear()
        raise PeerGone(reason)

    async def _receive(self) -> str | bytes:
        """The peer's next message. Every message it finished before it left (its close frame, a protocol error, a
        message too big, the end of the stream) is taken before that is raised as :class:`PeerGone`: a ``stop``
        sent with the close frame in one write is the peer's last word, not lost with it."""
        pace = self._frame_pace
        while not self._messages:
            if self._gone is not None:
                raise self._gone
            most = None
            if pace is not None:
                most = pace.allowance(trio.current_time())
                if most == 0:  # the budget holds nothing for this socket now: wait for a step of it
                    await pace.wait_for_step()
                    continue
            try:
                frames = self._absorb(most)
                if not frames:  # all that was read is parsed: read more
                    self._reading_since = self._holds.now()
                    try:
                        data = await self._stream.receive_some(READ_SIZE)
                    finally:
                        self._reading_since = None
                    if not data:
                        raise PeerGone("the connection closed")
                    self._heard = self._holds.now()  # any byte counts as being alive
                    if pace is not None:
                        pace.read(len(data))
                    self._ws.receive_data(data)
                    continue
            except RemoteProtocolError as exc:
                self.close_reason = f"protocol error: {exc}"
                self._gone = PeerGone(self.close_reason)
                continue
            except PeerGone as gone:
                self._gone = gone
                continue
            if self._pending_pong:
                pongs, self._pending_pong = self._pending_pong, b""
                await self._write(pongs)
            if pace is not None:  # a flood of frames waits in its own socket: TCP pushes back on it
                if pace.charge(trio.current_time(), frames):
                    await trio.lowlevel.checkpoint()
                else:
                    await pace.wait_for_step()
        return self._messages.popleft()

    async def _send(self, message: str | bytes) -> None:
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        try:
            data = self._ws.send(event)
        except LocalProtocolError:
            raise PeerGone("the connection is closing") from None
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        async with self._send_lock:
            with self._holds.after(self._deadlines.write) as deadline:  # a held loop is not the peer's
                await self._stream.send_all(data)
        if deadline.cancelled_caught:
            self.close_reason = f"a write waited more than {self._deadlines.write:g} s (the peer does not read)"
            raise PeerGone(self.close_reason)

    def _silent_for(self, now: float) -> float:
        """How long the peer has sent nothing while the server waited for it. A socket the room does not read (its
        messages wait for the worker to take the ones before them) holds the peer's pongs unread: that is not its
        silence (a controller whose burst waited on a slow worker was sent away for it)."""
        if self._reading_since is None:
            return 0.0
        return now - max(self._heard, self._reading_since)

    async def _keep_alive(self, presence: trio.CancelScope) -> None:
        """Ping every ``ping_interval``; send the peer away when it has said nothing for ``pong`` seconds."""
        while True:
            await trio.sleep(self._deadlines.ping_interval)
            if self._silent_for(self._holds.now()) > self._deadlines.pong:
                self.close_reason = f"no answer to pings for {self._deadlines.pong:g} s"
                presence.cancel()
                return
            try:
                await self._write(self._ws.send(Ping(payload=b"chunkline")))
            except PeerGone:
                presence.cancel()
                return

    async def _close(self, code: int, reason: str) -> None:
        with trio.move_on_after(CLOSE_DEADLINE):
            with contextlib.suppress(LocalProtocolError, PeerGone, trio.BrokenResourceError, trio.ClosedResourceError):
                data = self._ws.send(CloseConnection(code=code, reason=reason[:120]))
                async with self._send_lock:
                    await self._stream.send_all(data)
                self._said_all = True
