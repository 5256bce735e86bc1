"""A server-push stream's chunks, each within its deadline, and the stream's bounded close.

A server-push stream makes its chunks on its own, one each time its reader (the room runner, ``chunkline run``) asks
for the next. One that never comes is a stalled pipeline: it held its session ``running`` with no frame until
``session_timeout`` (30 min by default), and with it the worker's one slot (a server-push service has exactly one
retained session), and it held ``chunkline run`` for ever. So each chunk has a deadline: the first, the stream's
session setup, the create's (``CREATE_PIPELINE_TIMEOUT``), every later one ``CHUNK_STALL_TIMEOUT``
(:mod:`server.runner` holds both; ``chunkline run`` takes them from there, :func:`server.run_command.run_deadlines`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from pipelines.chunk_wait import ChunkLate, next_chunk_within
from pipelines.contract import Chunk, ChunkOrder

__all__ = ["StreamStalled", "close_stream", "next_chunk"]


class StreamStalled(Exception):
    """The stream gave no chunk ``index`` within ``seconds``: the pipeline stalled."""

    def __init__(self, index: int, seconds: float) -> None:
        super().__init__(f"the pipeline stalled: chunk {index} of its stream did not come within {seconds:g} s")
        self.index = index
        self.seconds = seconds


async def next_chunk(stream: AsyncIterator[Chunk], order: ChunkOrder, *, first_within: float,
                     then_within: float) -> Chunk | None:
    """The stream's next chunk, checked by ``order`` (None: the stream ended), within ``first_within`` seconds for
    its first chunk and ``then_within`` for any other; past it :class:`StreamStalled`."""
    try:
        return await next_chunk_within(stream, order, first_within if order.next_index == 0 else then_within)
    except ChunkLate as late:
        raise StreamStalled(late.index, late.seconds) from None


async def close_stream(stream: AsyncIterator[Chunk], seconds: float) -> bool:
    """Close ``stream`` shielded (a drain must not cut its cleanup short) and within ``seconds``; False when it did
    not end in time, so that what the stream holds is in doubt."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return True
    with trio.CancelScope(shield=True) as closing:
        closing.deadline = trio.current_time() + seconds
        await aclose()
    return not closing.cancelled_caught
