"""Fresh looks into rooms for token checks, shared fairly among the rooms under a bound for the whole server.

A token asked for a LiveKit session lists its room first (``RoomFollow.look_now``), at most so many lists a second
over the whole server. One bucket, first come first served, let a flood of token requests for one session (or for
many) take every list, and every other session's check was left to the poll's last look (about a second old), so
an identity that had just joined a quiet room got a second token (LiveKit then drops the holder). Here:

- the checks of one room asked while none of its lists has started share the next list (a flood on one room
  costs one list at a time, and each of its checks still gets a list that started after it was asked);
- of the rooms waiting, the one whose last list was granted longest ago (or, never listed, that was followed
  first) gets the next: a room every flood room was served since is ahead of all of them (max-min: a quiet room
  asks for less than its share, so it is served at once; a busy one waits its round);
- a check waits at most ``wait`` seconds for its turn, and beyond that the record decides, as before.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import trio

from .token_bucket import TokenBucket

__all__ = ["LookShares"]

Answer = TypeVar("Answer")


class _Turn(Generic[Answer]):
    """A room's next look: the checks waiting for it, and its answer once taken."""

    __slots__ = ("answer", "done", "granted", "taken", "waiters")

    def __init__(self) -> None:
        self.waiters = 0
        self.granted = trio.Event()
        self.taken = False  # a waiter is running the look
        self.done = trio.Event()
        self.answer: Answer | None = None


class LookShares(Generic[Answer]):
    """At most ``rate`` looks a second (``burst`` at once) over every room, given room by room (see the module
    docs); :meth:`run` hands out the turns, and must run while looks are asked for."""

    def __init__(self, rate: float, burst: int, wait: float) -> None:
        if not (rate > 0 and burst >= 1 and wait > 0):
            raise ValueError(f"rate, burst and wait must be > 0 (burst at least 1), got {rate!r}, {burst!r}, {wait!r}")
        self._bucket = TokenBucket(rate, burst)
        self.wait = wait
        self._served: dict[Hashable, float] = {}  # when each followed room's last look was granted (or it was followed)
        self._waiting: dict[Hashable, _Turn[Answer]] = {}  # the rooms whose next look is waited for
        self._queue: list[tuple[float, int, Hashable, _Turn[Answer]]] = []  # (served, order, room, turn)
        self._order = itertools.count()
        self._more = trio.Event()

    def follow(self, room: Hashable, now: float) -> None:
        """``room`` is followed from ``now``: it counts as served then (a room made later is behind it)."""
        self._served.setdefault(room, now)

    def forget(self, room: Hashable) -> None:
        """``room`` is not followed any more (its session ended)."""
        self._served.pop(room, None)

    async def look(self, room: Hashable, run: Callable[[], Awaitable[Answer]]) -> Answer | None:
        """A look at ``room`` that starts after this call: ``run``'s answer, shared with the checks of the same room
        waiting with this one; None when no turn came within ``wait`` seconds (or the look's runner was cancelled)."""
        turn = self._waiting.get(room)
        if turn is None:
            turn = self._waiting[room] = _Turn()
            served = self._served.get(room, trio.current_time())
            heapq.heappush(self._queue, (served, next(self._order), room, turn))
            self._more.set()
        turn.waiters += 1
        try:
            with trio.move_on_after(self.wait):
                await turn.granted.wait()
        finally:
            turn.waiters -= 1
            if not turn.granted.is_set() and not turn.waiters and self._waiting.get(room) is turn:
                del self._waiting[room]  # nobody waits for it any more: its place in the queue is skipped
        if not turn.granted.is_set():
            return None
        if turn.taken:
            await turn.done.wait()  # bounded: the runner's look is
            return turn.answer
        turn.taken = True
        try:
            turn.answer = await run()
        finally:
            turn.done.set()
        return turn.answer

    async def run(self) -> None:
        """Hand out the turns, the rooms served longest ago first, at the bucket's pace, until cancelled."""
        while True:
            while self._queue and self._waiting.get(self._queue[0][2]) is not self._queue[0][3]:
                heapq.heappop(self._queue)  # nobody waits for that turn any more
            if not self._queue:
                self._more = trio.Event()
                await self._more.wait()
                continue
            delay = self._bucket.wait(trio.current_time())
            if delay:
                await trio.sleep(delay)
                continue
            _, _, room, turn = heapq.heappop(self._queue)  # waited for: the head was checked with no wait since
            del self._waiting[room]
            if room in self._served:
                self._served[room] = trio.current_time()
            turn.granted.set()
