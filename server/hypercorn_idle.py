"""A connection its client has closed is let go at once by hypercorn's trio worker, not when its keep-alive ends.

hypercorn's trio ``TCPServer`` runs a connection's reader and its keep-alive timer in one task group and closes the
socket only once the group is done. When the client closes its end, the reader sees the end of the stream and
returns, but the timer runs on to ``keep_alive_timeout``: the socket stays open that long. Behind the front
(``chunkline stream-serve``) that is one file descriptor for every closed connection, for the front's idle and head
deadlines (45 s), which the front's connection cap does not count: 75 one-shot requests a second (``curl``, a client
pool closed) ran the process out of descriptors, and the server answered nothing more until the load stopped.
Stopping the timer once the reader is done lets the group end with the connection (a request still being answered
is not the timer's: it ends as before).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["release_closed_connections"]

_RELEASES = "_chunkline_releases_closed_connections"


def release_closed_connections() -> bool:
    """Wrap hypercorn's trio ``TCPServer`` (once per process) so that its keep-alive timer stops when its reader
    ends; False when hypercorn's trio worker is not there or no longer has that shape (nothing is changed then)."""
    try:
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:
        return False
    read_data = getattr(TCPServer, "_read_data", None)
    if read_data is None or not hasattr(TCPServer, "__init__"):
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
