"""The parent's end of one chunk stream of a process service (``chunks()`` or ``stream()``).

The proxy's message handler feeds it (:meth:`ProxyStream.on_chunk`, ``on_end``,
``on_failure``, ``on_broken``) on the trio thread; the consumer iterates it. It
gives the child credit for each chunk taken, so the child runs at most
``CREDIT_WINDOW`` chunks ahead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from pipelines.contract import Chunk, PipelineContractError

from . import wire

__all__ = ["ProxyStream"]


class ProxyStream:
    """One stream: the chunks the child sent and the consumer has not taken, and how it ended."""

    def __init__(self, send: Callable[[Any], None], stream_id: int, method: str, arg: Any) -> None:
        self._send = send
        self.stream_id = stream_id
        self.method = method
        self.arg = arg
        self.received = 0  # chunks the child sent (the index of the next one)
        self._buffer: deque[Chunk] = deque()
        self._ended = False  # no chunk will be taken any more: the child ended it, it broke, or the service failed
        self._settled = False  # the child has closed its iterator (StreamEnd), or the service is gone
        self._error: BaseException | None = None
        self._closing = False  # the consumer closed or abandoned it
        self._changed = trio.Event()

    # -- from the service's message handler -----------------------------------------------------

    def on_chunk(self, sealed: wire.Sealed) -> None:
        index, self.received = self.received, self.received + 1
        if self._closing or self._ended:
            return
        try:
            chunk = wire.unseal(sealed)
        except wire.Unreadable as exc:
            self.on_broken(PipelineContractError(
                f"chunk {index} from the worker process does not load in the server process: {exc}"
            ))
            return
        self._buffer.append(chunk)
        self._wake()

    def on_broken(self, error: PipelineContractError) -> None:
        """A pipeline bug ends the stream (the chunks before it still go): the child is told to stop it."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        self._send(wire.CloseStream(self.stream_id))
        self._wake()

    def on_end(self, error: BaseException | None) -> None:
        self._ended = self._settled = True
        if error is not None and self._error is None:
            self._error = error
        self._wake()

    def on_failure(self, error: BaseException) -> None:
        self._buffer.clear()
        self._ended = self._settled = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- the async iterator -------------------------------------------------------------------------

    def __aiter__(self) -> ProxyStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._closing:
            raise StopAsyncIteration
        try:
            while not self._buffer and not self._ended:
                await self._changed.wait()
        except BaseException:
            self._abandon()  # like an async generator: an exception out of it ends the stream
            raise
        if self._buffer:
            chunk = self._buffer.popleft()
            if not self._ended:
                self._send(wire.Credit(self.stream_id, 1))
            return chunk
        self._closing = True
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration

    def _abandon(self) -> None:
        if not self._closing:
            self._closing = True
            self._buffer.clear()
            if not self._ended:
                self._send(wire.CloseStream(self.stream_id))

    async def aclose(self) -> None:
        """Stop the stream and wait until the child has closed its iterator."""
        self._abandon()
        while not self._settled:
            await self._changed.wait()
