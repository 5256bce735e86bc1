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

__all__ = ["bound_writes", "release_closed_connections"]

_RELEASES = "_chunkline_releases_closed_connections"
_BOUNDS_WRITES = "_chunkline_bounds_writes"


class WritesWithADeadline:
    """A connection's stream whose every write fails (the stream closed) once it has waited ``seconds``."""

    def __init__(self, stream: Any, seconds: float) -> None:
        self._stream = stream
        self._seconds = seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)  # everything else is the stream's own (an SSL stream's handshake too)

    async def send_all(self, data: Any) -> None:
        with trio.move_on_after(self._seconds) as late:  # a deadline holds inside hypercorn's shield too
            await self._stream.send_all(data)
        if late.cancelled_caught:
            with trio.CancelScope(shield=True), contextlib.suppress(trio.BrokenResourceError,
                                                                   trio.ClosedResourceError, OSError):
                await self._stream.aclose()  # what was half written cannot be finished: the reader ends too
            raise trio.BrokenResourceError(f"the client read nothing for {self._seconds:g} s: closed")


def bound_writes(seconds: float) -> bool:
    """Give every connection hypercorn's trio worker serves from now on a write deadline of ``seconds`` (once per
    process); False when hypercorn's trio worker is not there or no longer has that shape (nothing is changed)."""
    try:
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    init = TCPServer.__init__
    if getattr(init, _BOUNDS_WRITES, False):
        return True
    if list(inspect.signature(init).parameters)[-1] != "stream":
        return False

    def init_with_a_write_deadline(self: Any, *args: Any, _init: Callable[..., None] = init) -> None:
        _init(self, *args[:-1], WritesWithADeadline(args[-1], seconds))

    setattr(init_with_a_write_deadline, _BOUNDS_WRITES, True)
    TCPServer.__init__ = init_with_a_write_deadline
    return True


def release_closed_connections() -> bool:
    """Wrap hypercorn's trio ``TCPServer`` (once per process) so that its keep-alive timer stops when its reader
    ends; False when hypercorn's trio worker is not there or no longer has that shape (nothing is changed then)."""
    try:
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    read_data = getattr(TCPServer, "_read_data", None)
    if read_data is None:
        return False
    if getattr(read_data, _RELEASES, False):
        return True

    async def reading_then_stopping_the_timer(self: Any, _read_data: Callable[[Any], Awaitable[None]] = read_data,
                                              ) -> None:
        try:
            await _read_data(self)
        finally:
            idle_task = getattr(self, "idle_task", None)
            if idle_task is not None:
                with trio.CancelScope(shield=True):  # the timer must stop however the reading ended
                    await idle_task.stop()

    setattr(reading_then_stopping_the_timer, _RELEASES, True)
    TCPServer._read_data = reading_then_stopping_the_timer
    return True
