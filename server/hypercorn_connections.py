"""hypercorn's trio worker, held to what a connection may hold: one its client closed is let go at once, and under
plain hypercorn every write has a deadline.

**A closed connection.**

hypercorn's trio ``TCPServer`` runs a connection's reader and its keep-alive timer in one task group and closes the
socket only once the group is done. When the client closes its end, the reader sees the end of the stream and
returns, but the timer runs on to ``keep_alive_timeout``: the socket stays open that long. Behind the front
(``chunkline stream-serve``) that is one file descriptor for every closed connection, for the front's idle and head
deadlines (45 s), which the front's connection cap does not count: 75 one-shot requests a second (``curl``, a client
pool closed) ran the process out of descriptors, and the server answered nothing more until the load stopped.
Stopping the timer once the reader is done lets the group end with the connection (a request still being answered
is not the timer's: it ends as before).

**A connection whose write failed.** Between two pipelined requests hypercorn's reader waits for the first one's
answer to be written; a write that fails (the client gone) closed the request's stream without letting the reader
on, and the reader, its task group and the socket waited for good: :class:`HeldStream` ends the reader then.

**A write's deadline** (plain ``hypercorn --worker-class trio server:app``; behind the front, the front's own writes
have theirs). hypercorn's trio worker writes each answer and each WebSocket frame shielded from cancellation and with
no deadline: a room client that stopped reading (a frozen viewer) held its write for as long as it stayed connected,
and hypercorn, which waits for its connections as it stops, never exited after SIGTERM (a second signal to its
supervisor did nothing either). Each write now fails once it has waited :data:`~server.room_socket.WRITE_DEADLINE`,
and the connection is closed, as the front sends away a client that does not read.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["HeldStream", "bound_writes", "release_closed_connections"]

_RELEASES = "_chunkline_releases_closed_connections"

#: the write deadline of every connection from now on (:func:`bound_writes`); None: none
_write_deadline: float | None = None


class HeldStream:
    """A connection's stream as hypercorn's trio worker sees it: a write that fails, or (under :func:`bound_writes`)
    waits past its deadline, ends the connection's reader too.

    hypercorn's reader waits, between two pipelined requests, for the answer to the first to be written; a write that
    fails (the peer gone) closes the request's stream without ever letting the reader on, so it waited for good, and
    the connection's socket with it (a client that sent 2,000 pipelined requests and read nothing left one descriptor
    for good behind the front, each time: a few hundred ran the server out of descriptors)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.reader: trio.CancelScope | None = None  # the connection's reader, while it reads
        self.read_all = False  # the reader is over: no keep-alive timer is started again
        self._receiving = False  # the reader waits for data (not for an answer to be written)

    async def receive_some(self, max_bytes: int | None = None) -> Any:
        self._receiving = True
        try:
            return await self._stream.receive_some(max_bytes)
        finally:
            self._receiving = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)  # everything else is the stream's own (an SSL stream's handshake too)

    async def send_all(self, data: Any) -> None:
        try:
            if _write_deadline is None:
                await self._stream.send_all(data)
                return
            with trio.move_on_after(_write_deadline) as late:  # a deadline holds inside hypercorn's shield too
                await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._end_reader()
            raise
        if late.cancelled_caught:
            with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError,
                                                                   trio.ClosedResourceError, OSError):
                await self._stream.aclose()  # what was half written cannot be finished
            self._end_reader()
            raise trio.BrokenResourceError(f"the client read nothing for {_write_deadline:g} s: closed")

    def _end_reader(self) -> None:
        """A reader waiting for data ends as the stream does; one waiting between two pipelined requests for the
        first one's answer (which hypercorn then closed, unwritten) is ended here: nothing else would."""
        if self.reader is not None and not self._receiving:
            self.reader.cancel()


def bound_writes(seconds: float) -> bool:
    """Give every connection hypercorn's trio worker serves from now on a write deadline of ``seconds`` (once per
    process); False when hypercorn's trio worker is not there or no longer has that shape (nothing is changed)."""
    global _write_deadline
    if not release_closed_connections():
        return False
    _write_deadline = seconds
    return True


def release_closed_connections() -> bool:
    """Wrap hypercorn's trio ``TCPServer`` (once per process) so that its keep-alive timer stops when its reader
    ends, and its reader ends when a write fails; False when hypercorn's trio worker is not there or no longer has
    that shape (nothing is changed then)."""
    try:
        from hypercorn.events import Updated
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    read_data = getattr(TCPServer, "_read_data", None)
    protocol_send = getattr(TCPServer, "protocol_send", None)
    init = TCPServer.__init__
    if getattr(read_data, _RELEASES, False):  # (its signature is the wrapper's then)
        return True
    if read_data is None or protocol_send is None or list(inspect.signature(init).parameters)[-1] != "stream":
        return False

    def init_with_a_held_stream(self: Any, *args: Any, _init: Callable[..., None] = init) -> None:
        _init(self, *args[:-1], HeldStream(args[-1]))

    async def reading_then_stopping_the_timer(self: Any, _read_data: Callable[[Any], Awaitable[None]] = read_data,
                                              ) -> None:
        stream = self.stream
        try:
            with trio.CancelScope() as reader:
                if isinstance(stream, HeldStream):
                    stream.reader = reader
                await _read_data(self)
        finally:
            if isinstance(stream, HeldStream):
                stream.reader = None
                stream.read_all = True
            idle_task = getattr(self, "idle_task", None)
            if idle_task is not None:
                with trio.CancelScope(shield=True):  # the timer must stop however the reading ended
                    await idle_task.stop()

    async def sending_unless_read_all(self: Any, event: Any,
                                      _send: Callable[[Any, Any], Awaitable[None]] = protocol_send) -> None:
        # an answer ended after the reader did (ended by a failed write): its keep-alive timer, started again, held
        # the connection open for the whole keep-alive time with nothing left to read
        if isinstance(event, Updated) and event.idle and isinstance(self.stream, HeldStream) and self.stream.read_all:
            return
        await _send(self, event)

    setattr(reading_then_stopping_the_timer, _RELEASES, True)
    TCPServer.__init__ = init_with_a_held_stream
    TCPServer._read_data = reading_then_stopping_the_timer
    TCPServer.protocol_send = sending_unless_read_all
    return True
