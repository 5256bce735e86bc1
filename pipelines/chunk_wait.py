"""A stream's next chunk within a deadline: the one wait the room runner and ``chunkline run`` both make for a chunk.

Each caller says what a late chunk means to it (the server fails the session as a stalled pipeline, an offline run
fails as the pipeline's bug) and what the deadline is; the wait itself, and the order check of what came, are here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from .contract import Chunk, ChunkOrder

__all__ = ["ChunkLate", "next_chunk_within"]


class ChunkLate(Exception):
    """Chunk ``index`` did not come within ``seconds``."""

    def __init__(self, index: int, seconds: float) -> None:
        super().__init__(f"chunk {index} did not come within {seconds:g} s")
        self.index = index
        self.seconds = seconds


async def next_chunk_within(stream: AsyncIterator[Chunk], order: ChunkOrder, seconds: float) -> Chunk | None:
    """The stream's next chunk, checked by ``order`` (None: the stream ended), within ``seconds``; past them
    :class:`ChunkLate`. What the stream raises passes unchanged."""
    index = order.next_index
    with trio.move_on_after(seconds):
        try:
            chunk = await stream.__anext__()
        except StopAsyncIteration:
            return None
        return order.check(chunk)
    raise ChunkLate(index, seconds)
