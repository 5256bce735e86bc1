"""How fast the authority reads one agent's messages.

An agent holds the cluster token, but nothing it sends may take the authority's event loop from everything else it
serves. An honest agent sends a heartbeat a second and a few messages for each thing that happens to one of its
sessions (a start, a join, who is in the room, an end): tens a second at most. Each message costs the authority its
frame's tag, its JSON and its handling (50-100 us; a frame near the 1 MiB limit packed with small values, about
50 ms). An agent that sent 10,000 session events a second for a session that does not exist, never disconnected, held
one core and slowed the HTTP API a hundredfold and every honest room's frames by half.

So each connection is read at a pace: a message costs one token, and one more for every
:data:`FRAME_BYTES_PER_TOKEN` of its frame, refilled at :data:`AGENT_MESSAGES_PER_S` past a burst of
:data:`AGENT_MESSAGE_BURST`. Past it the authority reads that connection no faster (what the agent sends waits in its
socket, then in the agent), and it says so in the log, once per connection. Between two messages it lets its other
tasks run: one read of 64 KiB hands it hundreds of small frames, which it otherwise handled without a pause.
"""

from __future__ import annotations

import logging

import trio

from ..token_bucket import TokenBucket

__all__ = ["AGENT_MESSAGE_BURST", "AGENT_MESSAGES_PER_S", "FRAME_BYTES_PER_TOKEN", "AgentReadPace"]

log = logging.getLogger(__name__)

AGENT_MESSAGES_PER_S = 500  # tens of times what an honest agent sends
AGENT_MESSAGE_BURST = 2000  # a registration, a room's worth of joins: never paced
FRAME_BYTES_PER_TOKEN = 4096  # a frame of 1 MiB costs 257 tokens


class AgentReadPace:
    """The read pace of one agent's connection (trio's clock)."""

    def __init__(self, worker_id: str, *, rate: float = AGENT_MESSAGES_PER_S, burst: int = AGENT_MESSAGE_BURST) -> None:
        self._worker_id = worker_id
        self._bucket = TokenBucket(rate, burst)
        self.waits = 0  # how often reading waited for the pace

    async def after(self, frame_bytes: int) -> None:
        """Account for a message just read (its frame's size); wait before the next read when past the pace."""
        wait = self._bucket.charge(trio.current_time(), 1 + frame_bytes // FRAME_BYTES_PER_TOKEN)
        if wait <= 0:
            await trio.lowlevel.checkpoint()
            return
        if not self.waits:
            log.warning("worker %s sends faster than %g messages a second (or %d KiB of frames): its connection is "
                        "read at that pace", self._worker_id, self._bucket.rate,
                        self._bucket.rate * FRAME_BYTES_PER_TOKEN // 1024)
        self.waits += 1
        await trio.sleep(wait)
