"""Reading a child's pipe without ever blocking on a message that is only half written.

``multiprocessing``'s ``Connection.recv_bytes`` reads one whole message: once it has read the
length it waits for every byte. A child stopped (SIGSTOP) or stuck half-way through writing a
large message would hold the reader there, and the supervisor's monitor thread, the reader,
is the one that enforces the child's deadlines and kills it. :class:`MessageReader` takes
what the pipe holds when it is readable, one ``read`` at a time, and hands back the messages
completed so far; the rest waits in its buffer for the next readiness.

The framing is the one ``Connection.send_bytes`` writes: a signed 32-bit big-endian length,
or -1 followed by an unsigned 64-bit length for messages of 2 GiB and more, then the bytes.
"""

from __future__ import annotations

import os
import struct

__all__ = ["MessageReader", "PipeClosed"]

READ_SIZE = 1 << 18  # bytes taken from the pipe per readiness: a large message arrives over several reads
_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")


class PipeClosed(Exception):
    """The other end closed the pipe (or it broke); a message it had not finished writing is lost. ``garbled``: its
    bytes were no messages (the pipe is unusable, though the other end may still be writing)."""

    def __init__(self, why: str, *, garbled: bool = False) -> None:
        super().__init__(why)
        self.garbled = garbled


class MessageReader:
    """The messages of one pipe, read only when it is readable (see the module docs)."""

    __slots__ = ("_fd", "_buffer", "_chunk")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()
        self._chunk = bytearray(READ_SIZE)  # each read lands here: no allocation of READ_SIZE per small message

    @property
    def pending_bytes(self) -> int:
        """Bytes read of messages not yet complete."""
        return len(self._buffer)

    def read_ready(self) -> list[bytes]:
        """Read once (the pipe must be readable: this never waits for more) and return the messages now complete.

        Raises :class:`PipeClosed` at the end of the pipe, or where its bytes are not messages.
        """
        try:
            count = os.readv(self._fd, [self._chunk])
        except OSError as exc:
            raise PipeClosed(str(exc)) from exc
        if not count:
            raise PipeClosed("end of pipe")
        buffer = self._buffer
        with memoryview(self._chunk) as chunk:
            buffer += chunk[:count]
        messages = []
        while True:
            size, header = self._next_size()
            if size is None or len(buffer) < header + size:
                return messages
            with memoryview(buffer) as view:  # one copy of the message, not two
                messages.append(bytes(view[header:header + size]))
            del buffer[:header + size]

    def _next_size(self) -> tuple[int | None, int]:
        """The size of the message at the head of the buffer and its header's length (None while the header is
        incomplete)."""
        buffer = self._buffer
        if len(buffer) < _SHORT.size:
            return None, 0
        (size,) = _SHORT.unpack_from(buffer)
        if size >= 0:
            return size, _SHORT.size
        if size != -1:
            raise PipeClosed(f"the pipe carries no message framing (a length of {size})", garbled=True)
        if len(buffer) < _SHORT.size + _LONG.size:
            return None, 0
        return _LONG.unpack_from(buffer, _SHORT.size)[0], _SHORT.size + _LONG.size
