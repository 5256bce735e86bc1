"""The front: the server's public port, owning every client connection so that every wait has a deadline.

``chunkline stream-serve`` listens here rather than in hypercorn. For each connection the front reads
the request head (at most :data:`MAX_HEAD` bytes within ``Deadlines.head``) as hypercorn would, with h11
(:func:`server.http_framing.parse_head`: a head h11 refuses is a 400 naming the fault, here, rather than
hypercorn's empty one), then

- every WebSocket upgrade is served by :class:`server.room_socket.RoomSocket` (message bound while it
  arrives, write deadline, ping/pong deadline): a room's ``/v1/rooms/{room}/ws`` however its path is
  spelt, anything else a 404 (none reaches hypercorn's WebSocket: with LiveKit rooms every upgrade is a
  404, and one after the connection's first request is refused by the framing);
- anything else is spliced to hypercorn on a Unix socket only this user may reach, each write to the
  client bounded by ``Deadlines.write`` (hypercorn shields its own writes from cancellation, so a client that never
  reads could otherwise hold a response, its task and the shutdown forever), and the connection
  closed once no byte has moved either way for ``Deadlines.idle`` (whatever hypercorn's own keep-alive
  timeout does, so a client cannot keep any number of them open; a whole request still owed its answer then
  is answered 504 ``answer_timeout`` rather than closed on);
  every later head on a keep-alive connection and every body are bounded too
  (:mod:`server.http_framing`: a head within ``Deadlines.head`` of its first byte, else 408; a body at
  a minimum rate), so trickling bytes slower than that cannot hold a connection either.

Closing a connection the client may still be sending on -- a request refused before its body was read,
here or by the app (413) -- is a lingering close: the answer, then the write side shut, then what the client
still sends read and thrown away, at most :data:`LINGER_BYTES` (or what its body declares) within
``Deadlines.linger``, then the close. Closing at once with bytes unread makes the kernel send a reset, and
the client's kernel then drops the answer it had not read yet.

At most :data:`MAX_CONNECTIONS` connections are served at once (more are answered 503 and closed), the
request bodies of them all under way at once are bounded by a :class:`~server.http_framing.BodyBudget`
(``--max-body-bytes-in-flight``: a request past it is answered 503 with ``Retry-After`` and reaches nothing),
and :meth:`Front.close` ends every connection that is still open, so shutdown does not wait on any client.

Every accepted connection's kernel send buffer is fixed at :data:`SEND_BUFFER_BYTES` or ``--socket-send-buffer``
(``SO_SNDBUF``, which turns the kernel's autotuning off for it), so what a client can make the server's kernel hold
for it is bounded too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from typing import Final

import trio

from .answer_framing import AnswerFraming
from .frame_budget import FrameBudget
from .http_framing import (
    BODY_RETRY_AFTER,
    BodyBudget,
    FramingRefused,
    RequestFraming,
    RequestHead,
    head_end,
    not_a_request_line,
    parse_head,
)
from .lingering import LINGER_BYTES, linger
from .log_pace import LogPace
from .loop_holds import loop_holds
from .room_socket import Deadlines, RoomSocket
from .settings import DEFAULT_SEND_BUFFER
from .transport.local import LocalRooms

__all__ = ["LINGER_BYTES", "MAX_CONNECTIONS", "MAX_HEAD", "SEND_BUFFER_BYTES", "Front"]

log = logging.getLogger("chunkline.front")

MAX_HEAD: Final = 16384  # bytes of request head (request line and headers)
MAX_CONNECTIONS: Final = 1024  # or fewer, where the open-file limit cannot hold them (server.open_files)
READ_SIZE: Final = 65536
SEND_BUFFER_BYTES: Final = DEFAULT_SEND_BUFFER
"""``SO_SNDBUF`` of every connection the front accepts (room sockets and HTTP alike), unless
``--socket-send-buffer`` says otherwise.

Left to itself Linux grows a socket's send buffer with its congestion window, up to ``net.ipv4.tcp_wmem``'s
maximum (4 MiB by default): a client that read fast for a while (its window and the server's grew), then went
silent (stopped acknowledging: a peer gone, or one that drops what it is sent), left up to that much of the
server's data in the server host's kernel, unacknowledged, for as long as the connection and then its orphan
retransmit it: 4 GiB with :data:`MAX_CONNECTIONS` of them, outside every bound of the server's own. (Trio's
``TCP_NOTSENT_LOWAT`` of 16 KiB already keeps the *unsent* part small: a client that stops reading but still
acknowledges, a zero window, held 26-65 KB of server data in the kernel when measured; what is sent and not
acknowledged is bounded by the send buffer alone.)

Fixed at 256 KiB, the kernel doubles it for its bookkeeping: at most 512 KiB per connection (512 MiB for all
1,024), and at least 256 KiB of data in flight -- the bandwidth-delay product it keeps: a 640 x 360 stream at
24 fps of camera-like JPEG frames (~50 KB each at the rooms' quality, 1.2 MB/s, ~10 Mbit/s) across a 200 ms
round trip, or the default 320 x 192 at 16 fps (~15 KB frames, 240 KB/s) across a full second. A larger stream
over a longer link is held to ~256 KiB per round trip (at 300 ms, ~850 KB/s): raise ``--socket-send-buffer`` to
its bandwidth-delay product there (each connection may then hold twice that in the kernel). The kernel caps
``SO_SNDBUF`` at ``net.core.wmem_max`` (212992 on a stock kernel, where this gives 416 KiB): raise that too.
"""

_GONE: Final = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
#: seconds a request still arriving when the front closes has to be told ``shutting_down`` (the shutdown waits them)
STOPPING_ANSWER_SECONDS: Final = 1.0
#: seconds a kept-alive connection hypercorn closed as the server stops waits for a request the client may have sent
#: before it could see the close (a round trip), to answer it ``shutting_down`` rather than drop it
LATE_REQUEST_SECONDS: Final = 1.0

_REFUSALS: Final = {
    400: b"400 Bad Request",
    404: b"404 Not Found",
    408: b"408 Request Timeout",
    411: b"411 Length Required",
    431: b"431 Request Header Fields Too Large",
    503: b"503 Service Unavailable",
    504: b"504 Gateway Timeout",
    505: b"505 HTTP Version Not Supported",
}


class Front:
    """Serve connections from public listeners: room sockets here, HTTP through hypercorn at ``backend``."""

    def __init__(
        self,
        rooms: LocalRooms | None,
        backend: str,
        *,
        max_message_bytes: int,
        deadlines: Deadlines | None = None,
        body_budget: BodyBudget | None = None,
        send_buffer: int = SEND_BUFFER_BYTES,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._deadlines = deadlines or Deadlines()
        self._rooms = rooms
        self._backend = backend
        self._max_message_bytes = max_message_bytes
        self.body_budget = body_budget
        self._send_buffer = send_buffer  # SO_SNDBUF of each accepted connection (--socket-send-buffer)
        self.frame_budget = FrameBudget()  # every room socket's frames together (lent where wanted)
        self._open: set[trio.CancelScope] = set()
        self.refused = 0
        self.max_connections = max_connections
        #: the answer past the cap (it said "503 Service Unavailable", and no Retry-After)
        self._too_many = FramingRefused(
            503, f"the server has {max_connections} connections open, the most it serves at once; retry in "
            f"{BODY_RETRY_AFTER} s", error="too_many_connections", retry_after=BODY_RETRY_AFTER)
        #: hypercorn stops: a request begun from now on is told the server is shutting down, none is passed on
        self.stopping = False
        self._shutting_down = FramingRefused(503, "the server is shutting down", error="shutting_down")
        self._unreachable_lines = LogPace(log)  # as often as clients connect: paced
        self._connection_bugs = LogPace(log)  # as often as clients can meet the bug: paced

    @property
    def connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        """End every open connection now (the server is stopping)."""
        for scope in list(self._open):
            scope.cancel()

    async def handle(self, stream: trio.SocketStream) -> None:
        """One client connection, from its first byte to its close."""
        if isinstance(stream, trio.SocketStream):  # in-memory streams (the tests') have no kernel buffer
            with contextlib.suppress(OSError):
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer)
        with trio.CancelScope() as scope:
            self._open.add(scope)
            try:
                if len(self._open) > self.max_connections:
                    self.refused += 1
                    await self._refuse(stream, 503, self._too_many, linger=0)  # lingering would hold one more
                    return
                first = await self._read_head(stream)
                if first is None:
                    return
                raw, head = first
                if not head.is_websocket_upgrade:  # any WebSocket upgrade, whatever its target, is served here:
                    await self._splice(stream, raw)  # none reaches hypercorn's, which bounds neither writes nor pongs
                else:
                    await self._room_socket(stream, raw)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            except Exception:  # a bug met serving one connection ends that connection, not every client's server
                self._connection_bugs.error("a connection ended on an unexpected error (closed; the server serves on)")
            finally:
                self._open.discard(scope)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await stream.aclose()

    async def _room_socket(self, stream: trio.SocketStream, raw: bytes) -> None:
        """A WebSocket upgrade (``raw``: its head and what came after it), first on its connection or after the
        answers to the requests before it."""
        if self._rooms is None:
            await self._refuse(stream, 404, FramingRefused(404, "this server's rooms are LiveKit's: no WebSocket is "
                                                           "served here", error="not_found"))
            return
        await RoomSocket(stream, raw, self._rooms, max_message_bytes=self._max_message_bytes,
                         deadlines=self._deadlines, frames=self.frame_budget).serve()

    async def _read_head(self, stream: trio.SocketStream) -> tuple[bytes, RequestHead] | None:
        """The connection's first head as h11 reads it, with every byte received so far (the head and what came
        after it); None once the client left or was refused (too slow, too large, malformed)."""
        buffer = bytearray()
        end = -1
        refusal = FramingRefused(408, "the request head did not arrive within its deadline")
        with loop_holds().after(self._deadlines.head):  # (none of the client's deadlines counts a held loop)
            try:
                while end < 0 and len(buffer) <= MAX_HEAD and not not_a_request_line(buffer):
                    data = await stream.receive_some(READ_SIZE)
                    if not data:
                        return None
                    buffer += data
                    end = head_end(buffer, len(buffer) - len(data))
            except trio.Cancelled:
                if self.stopping and buffer:  # the server stops (close()) as a request begins: it is told so
                    await self._tell_shutting_down(stream, LINGER_BYTES)
                raise
            try:
                if end < 0 and not not_a_request_line(buffer) or end > MAX_HEAD + 4:
                    raise FramingRefused(431, "the request head is larger than the front allows")
                return bytes(buffer), parse_head(bytes(buffer[:end] if end >= 0 else buffer))
            except FramingRefused as exc:
                log.info("a request the front refuses: %d %s", exc.status, exc.detail)
                refusal = exc
        await self._refuse(stream, refusal.status, refusal)  # past the head's deadline: lingering has its own
        return None

    async def _refuse(
        self, stream: trio.SocketStream, status: int, why: FramingRefused | None = None, *, linger: int = LINGER_BYTES
    ) -> None:
        """Answer ``status`` and close lingering (reading at most ``linger`` bytes more; 0: close at once)."""
        reason = _REFUSALS[status]
        error = why.error if why is not None and why.error else reason.decode().split(" ", 1)[1].lower().replace(" ", "_")
        detail = why.detail if why is not None else reason.decode()
        body = json.dumps({"error": error, "detail": detail}).encode()
        retry = b"" if why is None or why.retry_after is None else b"Retry-After: %d\r\n" % why.retry_after

        def answer(close: bool) -> bytes:
            return (b"HTTP/1.1 " + reason + b"\r\nContent-Type: application/json\r\n"
                    + (b"Connection: close\r\n" if close else b"") + retry
                    + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

        # one answer for each request it is for (pipelined ones each have theirs), the last one closing
        response = answer(False) * ((why.times if why is not None else 1) - 1) + answer(True)
        with loop_holds().after(self._deadlines.write) as deadline:
            await stream.send_all(response)
        if linger and not deadline.cancelled_caught:  # a client that does not read its answer is not waited for
            await self._linger(stream, linger)

    async def _linger(self, stream: trio.SocketStream, most: int) -> None:
        """Shut the write side (the answer is complete), then read and drop what the client still sends -- at
        most ``most`` bytes, within ``Deadlines.linger`` -- so that closing does not reset the connection."""
        await linger(stream, self._deadlines.linger, most)

    async def _splice(self, client: trio.SocketStream, head: bytes) -> None:
        answers = AnswerFraming()  # where hypercorn's answers end, told of each request the framing passes on
        framing = RequestFraming(head_seconds=self._deadlines.head, max_head=MAX_HEAD, budget=self.body_budget,
                                 on_passed=answers.passed)
        try:
            refusal, answered = await self._splice_framed(client, head, framing, answers)
        except* trio.Cancelled:
            if self.stopping and not framing.between_requests:
                # the server stops (close()) while this client's request is still arriving: it is told so, within
                # a bound, rather than cut off (a slow upload got a broken pipe and no answer)
                framing.release()
                await self._tell_shutting_down(client, framing.body_left or LINGER_BYTES)
            raise
        finally:
            framing.release()  # a body cut short gives its share of the budget back (before any lingering)
        unread = framing.body_left or LINGER_BYTES  # what may still be on its way: its body's rest, or unknown
        if framing.upgrade is not None and refusal is None:
            # a client library that keeps its connections (aiohttp's session) opens a room's socket on the one its
            # create went over: it was refused websocket_not_first, and the session it had just made held a slot
            await self._room_socket(client, framing.upgrade)
        elif refusal is not None:
            await self._refuse(client, refusal.status, refusal, linger=unread)
        elif answered and self.stopping and framing.between_requests and not framing.finished:
            await self._answer_a_late_request(client)
        elif answered and self.stopping and framing.head_under_way:  # hypercorn closed as a next head came
            await self._refuse(client, 503, self._shutting_down)
        elif answered:  # the backend answered and closed (a 413 with the body unread, Connection: close, ...)
            await self._linger(client, unread)

    async def _tell_shutting_down(self, client: trio.SocketStream, unread: int) -> None:
        """As :meth:`close` cuts a connection whose request is still arriving: 503 ``shutting_down``, within a bound."""
        with trio.CancelScope(shield=True) as telling:
            telling.deadline = trio.current_time() + STOPPING_ANSWER_SECONDS
            await self._refuse(client, 503, self._shutting_down, linger=unread)

    async def _answer_a_late_request(self, client: trio.SocketStream) -> None:
        """hypercorn closed a kept-alive connection as the server stops, after its last answer and without saying so
        (no ``Connection: close``): a request the client sent before it could know is answered ``shutting_down``
        (it was read and dropped, unanswered)."""
        data = b""
        with trio.move_on_after(LATE_REQUEST_SECONDS):
            data = await client.receive_some(READ_SIZE)
        if data:
            await self._refuse(client, 503, self._shutting_down)

    def _unreachable(self, error: BaseException) -> FramingRefused:
        """The answer to a request that could not be handed to hypercorn (``error``): 503, the server stopping or
        too busy to take it now."""
        if self.stopping:
            return self._shutting_down
        self._unreachable_lines.warning("a request could not be handed to the HTTP server (%s): 503", error)
        return FramingRefused(503, f"the server could not take the request now; retry in {BODY_RETRY_AFTER} s",
                              error="busy", retry_after=BODY_RETRY_AFTER)

    async def _splice_framed(
        self, client: trio.SocketStream, head: bytes, framing: RequestFraming, answers: AnswerFraming
    ) -> tuple[FramingRefused | None, bool]:
        """Splice until either side ends; returns the front's own refusal, if any, and whether the splice ended
        because the backend had answered all it would (so the client is due a lingering close)."""
        refusal: FramingRefused | None = None
        answered = False
        holds = loop_holds()  # every time and deadline of the client's below leaves out the loop's holds
        try:
            first = framing.feed(head, holds.now())
        except FramingRefused as exc:
            log.info("a request the front refuses: %d %s", exc.status, exc.detail)
            return exc, False
        try:  # hypercorn's listen queue full, or hypercorn stopped: the client is answered, not closed on
            backend = await trio.open_unix_socket(self._backend)
        except OSError as exc:
            return self._unreachable(exc), False
        moved_at = holds.now()  # the last time a byte went either way
        relayed = False  # whether any byte of hypercorn's went to the client
        owed = False  # a whole request went to hypercorn and no byte of its answer has come back yet
        client_done = False  # the client shut its sending side: once nothing is owed, the connection is over
        begun_after_stop = False  # the client began a request after the stop: it is told so once nothing else is owed
        try:
            try:
                await backend.send_all(first)
                owed = bool(first) and framing.between_requests
            except _GONE as exc:  # a connect the kernel took for one hypercorn never accepts (ENOTCONN)
                return self._unreachable(exc), False
            async with trio.open_nursery() as nursery:

                async def until_idle() -> None:
                    nonlocal refusal
                    # a create that held the loop past this deadline was answered 504 while its handler, running
                    # on, made the session: the hold is not counted
                    while (due := moved_at + self._deadlines.idle) > holds.now():
                        await holds.sleep_until(due)
                    if owed:  # the client is owed an answer, not a closed connection: one for each request it sent
                        unanswered = answers.unbegun or 1
                        log.warning("%d request(s) not answered within %g s: 504", unanswered, self._deadlines.idle)
                        refusal = FramingRefused(504, f"the server did not answer within {self._deadlines.idle:g} s",
                                                 error="answer_timeout", times=unanswered)
                    else:
                        log.info("a connection moved nothing for %g s: closed", self._deadlines.idle)
                    nursery.cancel_scope.cancel()

                async def to_backend() -> None:
                    nonlocal moved_at, refusal, owed, client_done, begun_after_stop
                    try:
                        while not framing.finished:  # past the last request, what the client sends waits for the close
                            with holds.deadline(framing.due) as late:  # the request under way, if any
                                data = await client.receive_some(READ_SIZE)
                            if late.cancelled_caught:
                                log.info("a request did not arrive within its deadline: 408")
                                refusal = FramingRefused(408, "the request did not arrive within its deadline")
                                break
                            if not data and framing.body_left:  # hypercorn answered it with an empty 400
                                refusal = FramingRefused(
                                    400, f"the request body ended {framing.body_left} byte(s) short of its "
                                    "Content-Length", error="incomplete_body")
                                break
                            if not data:
                                # the client is done sending, not reading: its answers still come. hypercorn takes
                                # an EOF for a client gone (it dropped the request, or the answer it was writing),
                                # so none is passed on: the connection ends here once every answer went out whole
                                # (hypercorn held it to its keep-alive timeout)
                                client_done = True
                                if answers.settled:
                                    break
                                return
                            moved_at = holds.now()
                            if self.stopping and framing.between_requests:
                                # a request begun after the stop is not passed on: hypercorn takes no more (it
                                # closes each kept-alive connection after its answer, and dropped what came
                                # meanwhile). The answers owed go out first, then this one
                                refusal, begun_after_stop = self._shutting_down, True
                                if answers.settled:
                                    break
                                return
                            try:
                                data = framing.feed(data, moved_at)
                            except FramingRefused as exc:
                                log.info("a request the front refuses: %d %s", exc.status, exc.detail)
                                refusal = exc
                                break
                            try:
                                if data:
                                    await backend.send_all(data)
                                    owed = owed or framing.between_requests
                            except _GONE:
                                return  # the backend stopped reading (it answered and closes): its answer goes on
                            if framing.upgrade is not None:  # a room's socket, served once every answer went out
                                if answers.settled:
                                    break
                                return
                        else:
                            return  # the last request went whole: its answer goes on
                    except _GONE:
                        pass
                    nursery.cancel_scope.cancel()

                async def to_client() -> None:
                    nonlocal moved_at, answered, relayed, owed
                    with contextlib.suppress(*_GONE):
                        while True:
                            try:
                                data = await backend.receive_some(READ_SIZE)
                            except _GONE:
                                data = b""  # the backend closed with bytes unread: what it answered went out
                            if not data:
                                answered = True  # the backend is done with this connection
                                break
                            relayed, owed = True, False
                            if data.startswith(b"HTTP/1.1 101 "):
                                framing.switched()  # no longer HTTP/1.1 from here on
                            answers.answered(data)
                            with holds.after(self._deadlines.write) as deadline:
                                await client.send_all(data)
                            moved_at = holds.now()
                            if deadline.cancelled_caught:
                                log.info("a client did not read its response for %g s: closed", self._deadlines.write)
                                break
                            if (client_done or begun_after_stop or framing.upgrade is not None) and answers.settled:
                                # the client is done sending (or told of the stop next, or opens a room's socket
                                # next) and has every answer
                                break
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_idle)
                nursery.start_soon(to_backend)
                nursery.start_soon(to_client)
        finally:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await backend.aclose()
        if answered and not relayed and refusal is None:  # hypercorn stopped before it answered the first request
            return self._unreachable(ConnectionError("the HTTP server closed the connection unanswered")), False
        return refusal, answered
