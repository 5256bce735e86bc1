"""The frames every participant's room socket together make the server read: one budget, in equal shares.

Each socket's frames (pings, pongs, a message's pieces) were paced on their own, 1,000 a second: 64 sockets
flooding pings together took a live session from 16 to 6 fps on a 2-core host (a frame costs wsproto some 20 µs),
and only the connection limit (1,024) bounded how many could. So every participant socket -- a controller's, a
viewer's, wherever it comes from -- now takes its frames from one :class:`FrameBudget` for the whole server:
:data:`SERVER_FRAMES_PER_SECOND` past a burst of :data:`SERVER_FRAME_BURST`, in equal shares among the sockets
open. A socket is read at ``min(FRAMES_PER_SECOND, SERVER_FRAMES_PER_SECOND / sockets)`` frames a second past a
burst of ``min(FRAME_BURST, SERVER_FRAME_BURST / sockets)``:

- however many sockets flood, and from however many hosts, together they are read no faster than the budget
  (a socket that floods waits in its own socket: TCP pushes back on it, and past the pong deadline it is sent
  away for not answering);
- an honest socket gets its share whatever the others send: a browser controller sends a few messages a second
  and a viewer a pong every 5 s, under the share of each of the 1,024 sockets the front admits at most, so a
  flood never makes it wait behind the flooders' frames (a budget the sockets drew from in turn would have);
- a frame counts once more for every :data:`FRAME_BYTES` it carries, so that large frames cost what they take;
- the server's own worker agent (a worker token) takes no share: its media is the stream itself.

A peer's address is no part of the share: behind a proxy every peer has the proxy's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Final

from .token_bucket import TokenBucket

__all__ = [
    "FRAME_BATCH", "FRAME_BURST", "FRAME_BYTES", "FRAMES_PER_SECOND", "SERVER_FRAME_BURST", "SERVER_FRAMES_PER_SECOND",
    "FrameBudget", "FrameShare",
]

FRAMES_PER_SECOND: Final = 1000  # one socket's frames a second at most, however few are open
FRAME_BURST: Final = 1000  # ... and its burst
SERVER_FRAMES_PER_SECOND: Final = 8000  # all participant sockets' frames a second together, in equal shares
SERVER_FRAME_BURST: Final = 8000  # ... and their bursts together
FRAME_BYTES: Final = 8192  # a frame counts once more for every this many bytes read
FRAME_BATCH: Final = 64  # frames parsed at most before the pace is asked again (what one step can cost the loop)


class FrameBudget:
    """The server's frame budget: each open participant socket has an equal :class:`FrameShare` of it."""

    def __init__(
        self,
        per_second: float = SERVER_FRAMES_PER_SECOND,
        burst: int = SERVER_FRAME_BURST,
        *,
        socket_per_second: float = FRAMES_PER_SECOND,
        socket_burst: int = FRAME_BURST,
    ) -> None:
        self.per_second = per_second
        self.burst = burst
        self.socket_per_second = socket_per_second
        self.socket_burst = socket_burst
        self.sockets = 0

    def rate(self) -> float:
        """One socket's frames a second now."""
        return min(self.socket_per_second, self.per_second / max(1, self.sockets))

    def share_burst(self) -> int:
        """One socket's burst now (at least one frame)."""
        return max(1, min(self.socket_burst, self.burst // max(1, self.sockets)))

    @contextlib.contextmanager
    def share(self) -> Iterator[FrameShare]:
        """A share for one socket, for as long as it is open."""
        self.sockets += 1
        try:
            yield FrameShare(self)
        finally:
            self.sockets -= 1


class FrameShare:
    """One socket's pace: a token bucket whose rate and burst follow the number of sockets sharing the budget."""

    def __init__(self, budget: FrameBudget) -> None:
        self._budget = budget
        self._bucket = TokenBucket(budget.rate(), budget.share_burst())  # full: its share of the burst
        self._unpaid_bytes = 0

    def _follow(self) -> TokenBucket:
        self._bucket.rate, self._bucket.burst = self._budget.rate(), self._budget.share_burst()
        return self._bucket

    def allowance(self, now: float) -> int:
        """Frames the socket may have parsed now before the pace is asked again (at least one, at most
        :data:`FRAME_BATCH`): a step costs no more than the share has, so no flood runs far into debt."""
        return max(1, min(FRAME_BATCH, int(self._follow().available(now))))

    def read(self, size: int) -> None:
        """``size`` bytes came in: they are paid for with the frames they hold."""
        self._unpaid_bytes += size

    def charge(self, now: float, frames: int) -> float:
        """``frames`` were parsed at ``now``: take them, and a frame for every FRAME_BYTES read, from the share;
        returns the seconds to wait before reading more: 0.0 when the share covered them, else until it holds a
        whole step (:data:`FRAME_BATCH`, or its burst), so that a flood is parsed a step per wake-up, not a frame."""
        extra, self._unpaid_bytes = divmod(self._unpaid_bytes, FRAME_BYTES)
        bucket = self._follow()
        if bucket.charge(now, frames + extra) == 0.0:
            return 0.0
        return (min(FRAME_BATCH, bucket.burst) - bucket.available(now)) / bucket.rate
