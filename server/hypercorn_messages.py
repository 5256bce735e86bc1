"""Plain hypercorn's WebSocket connections, held to the message size they refuse: past it the connection ends.

hypercorn gathers a WebSocket message's pieces (a frame and its continuations) in a buffer up to
``websocket_max_message_size``, and past it sends a close with 1009 (message too big). It then went on reading the
connection and keeping every later piece of the refused message in that same buffer, never ending the connection: a
client that opened a text message and sent continuation pieces for ever grew the worker's memory by about a byte for
each byte it sent (2.3 GB in 8 s from one room client with any room token; several added up). Behind the front
(``chunkline stream-serve``) the front reads the rooms' sockets itself and ends such a message at its own limit.

Now the refused message's pieces are dropped as they come (the buffer is emptied at the refusal), and the connection
ends once the 1009 close went out, as hypercorn ends one whose client closed: the room's client is gone, its session
goes on without it, and its seat is free again.
"""

from __future__ import annotations

from typing import Any

__all__ = ["end_oversized_messages"]

_ENDS_OVERSIZED = "_chunkline_ends_oversized_messages"
_ENDING = "_chunkline_ending"  # a stream whose refused message's connection is being ended


def end_oversized_messages() -> bool:
    """From now on (once per process), a WebSocket message past hypercorn's size limit is dropped and its connection
    ends after the 1009 close; False when hypercorn's WebSocket stream is not there or has another shape (nothing
    is changed then)."""
    try:
        from hypercorn.protocol import ws_stream
        from hypercorn.protocol.events import StreamClosed
    except ImportError:
        return False
    stream, buffer, too_large = (getattr(ws_stream, name, None) for name in
                                 ("WSStream", "WebsocketBuffer", "FrameTooLargeError"))
    if stream is None or buffer is None or too_large is None or not hasattr(buffer, "clear"):
        return False
    if getattr(stream, _ENDS_OVERSIZED, False):
        return True
    keep, handle = buffer.extend, stream.handle

    def extend(self: Any, event: Any) -> None:
        if getattr(self, "refused", False):
            raise too_large()  # a piece of the message refused already: not kept
        try:
            keep(self, event)
        except too_large:
            self.clear()  # what was gathered of the message goes now
            self.refused = True
            raise

    async def handle_then_end_a_refused_message(self: Any, event: Any) -> None:
        await handle(self, event)
        if getattr(self.buffer, "refused", False) and not self.closed and not getattr(self, _ENDING, False):
            setattr(self, _ENDING, True)  # its 1009 close went out: the connection ends (once), and the app is told
            await self.send(StreamClosed(stream_id=self.stream_id))

    buffer.extend = extend
    stream.handle = handle_then_end_a_refused_message
    setattr(stream, _ENDS_OVERSIZED, True)
    return True
