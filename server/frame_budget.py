"""The frames every participant's room socket together make the server read: one budget, lent where it is wanted.

Each socket's frames (pings, pongs, a message's pieces) were paced on their own, 1,000 a second: 64 sockets
flooding pings together took a live session from 16 to 6 fps on a 2-core host (a frame costs wsproto some 20 µs),
and only the connection limit (1,024) bounded how many could. Then the budget was split in strict equal shares:
with 256 sockets open each was read at 30 frames a second even when all the others sent nothing, and a controller
sending controls at 60 Hz waited in its own socket behind sockets that were merely open. So every participant
socket -- a controller's, a viewer's, wherever it comes from -- now takes its frames from one :class:`FrameBudget`
for the whole server, work-conserving:

- **the pool**: :data:`SERVER_FRAMES_PER_SECOND` past a burst of :data:`SERVER_FRAME_BURST`, shared. Every frame
  any socket is read counts against it, so all sockets together are read no faster than the budget (plus the
  small guaranteed bursts below), however many flood and from however many hosts;
- **a socket's guaranteed share**: its equal share of the budget, ``min(FRAMES_PER_SECOND,
  SERVER_FRAMES_PER_SECOND / sockets open)``, past a burst of at most a step (:data:`FRAME_BATCH`). A socket reads
  from the pool while the pool has frames, and from its share only when the pool has none (the frames are still
  counted against the pool). What idle sockets leave unused stays in the pool and is lent to whichever sockets
  want frames now, so a busy controller among 256 idle viewers is read at up to its cap; when many flood at once
  and the pool is dry, each is still read at its equal share at least: a flood never makes an honest socket wait
  behind the flooders' frames (a pool the sockets drew from in turn, with no share, would have);
- **a participant's cap**: at most :data:`FRAMES_PER_SECOND` past a burst of :data:`FRAME_BURST`, whatever the pool
  holds. This bucket is the participant's, not the socket's (keyed by room and identity, the rule by which the
  rooms keep each participant's data pace): it is kept while the participant has a socket and after it leaves,
  until it is full again (:class:`~server.token_bucket.KeptBuckets`; then it is what a new one would be, so
  forgetting it gives nothing away, and the front need not know when a room ends), so reconnecting buys no fresh
  burst. Each socket's joining costs :data:`JOIN_FRAMES` of it first (joining makes the room tell every
  participant), so a participant that reconnects over and over is paced too: past its burst it joins at most
  ``FRAMES_PER_SECOND / JOIN_FRAMES`` times a second, and its socket waits, not yet in the room, for the rest --
  at most :data:`JOIN_WAIT_MOST`: a socket that would wait longer is refused (:class:`JoiningTooOften`), charged
  nothing. Sockets of one participant opened together, none in the room yet, were each charged and each waited:
  300 at once put its cap 30 s in debt, its later sockets (reading nothing while they waited) were sent away as
  peers that answer no ping, and the debt, and how long the front kept the cap, had no bound;
- a new socket's guaranteed share starts empty: what a socket may read at once comes from the pool (other sockets'
  unused frames) or from its participant's kept cap, never from a fresh burst of its own;
- a frame counts once more for every :data:`FRAME_BYTES` it carries, so that large frames cost what they take;
- the server's own worker agent (a worker token) takes no share: its media is the stream itself.

Each step is O(1): three buckets, no pass over the sockets. A peer's address is no part of any of it: behind a
proxy every peer has the proxy's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Final

import trio

from .token_bucket import KeptBuckets, TokenBucket

__all__ = [
    "FRAME_BATCH", "FRAME_BURST", "FRAME_BYTES", "FRAMES_PER_SECOND", "JOIN_FRAMES", "JOIN_WAIT_MOST",
    "KEPT_PARTICIPANTS", "SERVER_FRAME_BURST", "SERVER_FRAMES_PER_SECOND", "FrameBudget", "FrameShare",
    "JoiningTooOften",
]

FRAMES_PER_SECOND: Final = 1000  # one participant's frames a second at most, however idle the others are
FRAME_BURST: Final = 1000  # ... and its burst (kept across its reconnects)
SERVER_FRAMES_PER_SECOND: Final = 8000  # all participant sockets' frames a second together
SERVER_FRAME_BURST: Final = 8000  # ... and the pool's burst
FRAME_BYTES: Final = 8192  # a frame counts once more for every this many bytes read
FRAME_BATCH: Final = 64  # frames parsed at most before the pace is asked again (what one step can cost the loop)
JOIN_FRAMES: Final = 100  # what joining a room costs a participant's cap: past its burst, 10 joins a second
KEPT_PARTICIPANTS: Final = 4096  # participants' caps kept after they left, at most (each for a second or so)
JOIN_WAIT_MOST: Final = 2.0  # seconds a socket may wait to join (well within the pong deadline: it reads nothing)


class JoiningTooOften(Exception):
    """A participant's socket would wait more than :data:`JOIN_WAIT_MOST` to join: it is refused, charged nothing."""

    def __init__(self, wait: float) -> None:
        super().__init__(f"this participant joins too often: this socket would wait {wait:.1f} s to join, more than "
                         f"{JOIN_WAIT_MOST:g} s (past a burst, {FRAMES_PER_SECOND // JOIN_FRAMES} joins a second)")
        self.wait = wait


class FrameBudget:
    """The server's frame budget: a shared pool, an equal guaranteed share for each open participant socket (a
    :class:`FrameShare`), and each participant's cap, kept across its reconnects. ``clock`` is the one every
    ``now`` given to its shares is read from (trio's)."""

    def __init__(
        self,
        per_second: float = SERVER_FRAMES_PER_SECOND,
        burst: int = SERVER_FRAME_BURST,
        *,
        socket_per_second: float = FRAMES_PER_SECOND,
        socket_burst: int = FRAME_BURST,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.per_second = per_second
        self.burst = burst
        self.socket_per_second = socket_per_second
        self.socket_burst = socket_burst
        self.clock = clock
        self.sockets = 0
        self.waiting = 0  # sockets asleep until the pool holds a step for them (each waits its turn)
        self.pool = TokenBucket(per_second, burst)
        self.caps = KeptBuckets(lambda: TokenBucket(socket_per_second, socket_burst), most=KEPT_PARTICIPANTS)

    def rate(self) -> float:
        """One socket's guaranteed frames a second now (its equal share)."""
        return min(self.socket_per_second, self.per_second / max(1, self.sockets))

    def share_burst(self) -> int:
        """One socket's guaranteed burst now: a step at most, and at least one frame."""
        return max(1, min(FRAME_BATCH, self.socket_burst, self.burst // max(1, self.sockets)))

    @contextlib.contextmanager
    def share(self, participant: Hashable) -> Iterator[FrameShare]:
        """A share for one socket of ``participant`` (its room and identity), for as long as it is open. Its joining
        is charged to the participant's cap first: :meth:`FrameShare.join_wait` says how long to wait for it, and a
        join that would wait more than :data:`JOIN_WAIT_MOST` raises :class:`JoiningTooOften` (nothing charged)."""
        now = self.clock()
        cap = self.caps.hold(participant, now)
        try:
            wait = max(0.0, JOIN_FRAMES - cap.available(now)) / cap.rate
            if wait > JOIN_WAIT_MOST:
                raise JoiningTooOften(wait)
            cap.charge(now, JOIN_FRAMES)
            self.sockets += 1
            try:
                yield FrameShare(self, cap, now)
            finally:
                self.sockets -= 1
        finally:
            self.caps.release(participant, self.clock())


class FrameShare:
    """One socket's pace: its participant's cap, the server's pool, and its guaranteed share (a bucket whose rate
    and burst follow the number of sockets open, empty when the socket opens)."""

    def __init__(self, budget: FrameBudget, cap: TokenBucket, now: float) -> None:
        self._budget = budget
        self._cap = cap
        self._own = TokenBucket(budget.rate(), budget.share_burst())
        self._own.took_at(now)  # empty: a new socket brings no burst of its own
        self._unpaid_bytes = 0
        self._offered = FRAME_BATCH  # the last allowance
        self._step = 1  # what the next wait is for: a whole batch after the budget, not the peer, ran out

    def _follow(self) -> TokenBucket:
        self._own.rate, self._own.burst = self._budget.rate(), self._budget.share_burst()
        return self._own

    def join_wait(self, now: float) -> float:
        """Seconds to wait before the socket joins its room: until its joining is paid for (0.0 within the
        participant's burst)."""
        return max(0.0, -self._cap.available(now)) / self._cap.rate

    def allowance(self, now: float) -> int:
        """Frames the socket may have parsed now before the pace is asked again, at most :data:`FRAME_BATCH`: what
        the participant's cap allows of what the pool and the socket's share hold (0: :meth:`wait_for_step` first)."""
        lent = max(0.0, self._budget.pool.available(now)) + max(0.0, self._follow().available(now))
        self._offered = max(0, min(FRAME_BATCH, int(min(self._cap.available(now), lent))))
        return self._offered

    async def wait_for_step(self) -> None:
        """Sleep until the socket may parse its next step: a whole :data:`FRAME_BATCH` when it parsed all it was
        offered last time (a flood, parsed a step per wake-up, not a frame, however little the budget had), else
        as many frames as it had (one for a socket that sends a frame at a time). Its cap must hold them, and its
        share or the pool too. Sockets waiting for the pool take
        turns: each waits for a batch more than those already waiting, so they do not all wake for the same one."""
        now = self._budget.clock()
        cap, pool, own = self._cap, self._budget.pool, self._follow()
        capped = max(0.0, min(self._step, cap.burst) - cap.available(now)) / cap.rate
        owned = max(0.0, min(self._step, own.burst) - own.available(now)) / own.rate
        turn = self._step + FRAME_BATCH * self._budget.waiting
        pooled = max(0.0, turn - pool.available(now)) / pool.rate
        seconds = max(capped, min(owned, pooled))
        queued = int(capped < pooled < owned)  # it wakes for the pool: it takes its turn
        self._budget.waiting += queued
        try:
            await trio.sleep(max(seconds, 1 / pool.rate))  # never a busy loop, whatever rounding left
        finally:
            self._budget.waiting -= queued

    def read(self, size: int) -> None:
        """``size`` bytes came in: they are paid for with the frames they hold."""
        self._unpaid_bytes += size

    def charge(self, now: float, frames: int) -> bool:
        """``frames`` were parsed at ``now``: take them, and a frame for every FRAME_BYTES read, from the pool as far
        as it holds them and the rest from the socket's share (all count against the pool), and from the
        participant's cap; False when they were not covered: :meth:`wait_for_step` before reading more."""
        extra, self._unpaid_bytes = divmod(self._unpaid_bytes, FRAME_BYTES)
        count = frames + extra
        # parsing all it was offered, the socket wants more: a flood, parsed a whole step per wake-up
        self._step = FRAME_BATCH if frames >= self._offered else max(1, frames)
        pool, own = self._budget.pool, self._follow()
        lent = min(count, max(0, int(pool.available(now))))
        pool.charge(now, count)
        own.charge(now, count - lent)
        self._cap.charge(now, count)
        return self._cap.available(now) >= 0 and (pool.available(now) >= 0 or own.available(now) >= 0)
