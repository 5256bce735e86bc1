"""A lingering close: closing a connection the peer may still be sending on, without resetting it.

Closing a socket with received bytes unread, or with more still arriving after it, makes the kernel answer with a
reset, and the peer's kernel then throws away what it had received and not read yet: the front's refusal of a
request whose body was still coming, a room's ``done`` and close frame to a controller still sending controls and
pongs. So the write side is shut first (what was sent is complete, and the peer reads its end), then what the peer
still sends is read and dropped until it closes -- at most :data:`LINGER_BYTES`, within a deadline, so a peer that
keeps sending cannot hold the connection -- and only then is the connection closed (by the caller).
"""

from __future__ import annotations

import contextlib
from typing import Final

import trio

__all__ = ["LINGER_BYTES", "linger"]

LINGER_BYTES: Final = 4 * 1024 * 1024  # the most a lingering close reads of what a peer still sends
READ_SIZE: Final = 65536


async def linger(stream: trio.abc.HalfCloseableStream, seconds: float, most: int = LINGER_BYTES) -> None:
    """Shut the write side, then read and drop what the peer still sends until it closes -- at most ``most`` bytes
    (never more than :data:`LINGER_BYTES`), within ``seconds``. The caller closes the stream after."""
    most = min(most, LINGER_BYTES)
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError), trio.move_on_after(seconds):
        await stream.send_eof()
        while most > 0 and (data := await stream.receive_some(min(READ_SIZE, most))):
            most -= len(data)
