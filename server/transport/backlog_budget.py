"""The text queued for every local-room socket together: one server-wide budget, the longest behind sent away first.

Each socket's queue of unsent text is bounded on its own (``TEXT_BACKLOG``/``TEXT_BACKLOG_BYTES`` in
:mod:`.local_room`: 1 MiB), but nothing bounded them together: 1,024 frozen viewers (the front's connection limit)
could make the server hold 1 GiB until each was sent away. :class:`BacklogBudget` counts what every socket has queued
and, when a write takes the total past :data:`SERVER_BACKLOG_BYTES`, sends away ``too_slow`` the sockets that have
been behind the longest, until it fits again -- whichever socket the write was for.

"Behind" is measured in time, not bytes. Sending the largest backlog away first sent honest readers away: a
controller may legally send a burst of 256 KiB (:mod:`.data_pace`), which a viewer reading 512 KiB a second holds
for half a second, while 576 frozen viewers holding ~115 KiB each kept the budget full; at each write past it the
largest backlog was the reader's. Bytes cannot tell a reader holding a burst from a socket that reads nothing; how
long its oldest unsent text has waited can: a reader catches up within a second, a frozen socket never does.

- **the longest behind first**: each socket has a mark, the time ``since`` which it has not caught up: all text
  queued before it is sent, text queued since may not be. A socket with nothing queued has no mark, and its next
  text sets one at now, with a count (at now) of what it holds. Once it has sent all the count covers, the mark moves
  to the count's time (everything queued before then is sent), and a new count, at now, covers what it holds now.
  The mark moves to the count's time, not to now: what it holds now may have been queued just after that count, so
  now would say it caught up when it did not. A socket that fell behind and then read the few messages it held when
  it did (a window's worth) looked caught up a moment ago with ~600 KiB still held, later than an honest reader
  holding a legal burst, which was sent away in its place. A frozen socket's mark never moves; a reader's moves
  each time it drains what it held, so it is at most two drains (a burst at the reader's pace: ~0.5 s each) old. So
  a socket that reads is sent away for the budget only after every socket that stopped reading before its mark,
  however much or little each holds; one that reads a little now and then stays marked by when it fell behind
  until it has sent all it held then;
- **bounded**: sending away stops only when the total fits, as before, so the server holds at most the budget
  (each send-away frees all a socket held; the order decides only who goes);
- **O(log n) a write, O(1) memory a socket**: a heap of (mark, socket), updated lazily. A mark only moves forward,
  so an entry is never later than its socket's mark: a socket given its first text pushes an entry, a moved mark
  leaves its old, earlier entry, which is put back at the real mark when it comes to the top; the heap is rebuilt
  once it holds twice as many entries as backlogs (amortised O(1)). No write passes over all the sockets, and the
  mark is three numbers a socket (no time kept per message).

A message fanned out to a room is one string that each socket's queue refers to, so the server holds at most what
this counts. What a socket sends away with (its ``too_slow`` refusal, a few dozen bytes) is not counted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Final, Protocol

import attrs
import trio

__all__ = ["SERVER_BACKLOG_BYTES", "Backlogged", "BacklogBudget"]

#: all sockets' queued text together: a whole room (64 sockets) of frozen viewers at their own 1 MiB bound fits, a
#: sixteenth of what 1,024 frozen sockets held before
SERVER_BACKLOG_BYTES: Final = 64 * 1024 * 1024


class Backlogged(Protocol):
    """A socket whose queued text the budget counts."""

    def send_away(self) -> None:
        """Drop the queue and send the socket away ``too_slow`` (the budget no longer counts what it held)."""


@attrs.define
class _Backlog:
    """What one socket holds, and its mark: all text queued before ``since`` is sent; of what it held at ``counted``,
    ``to_mark`` bytes are still unsent."""

    since: float
    counted: float
    held: int = 0
    to_mark: int = 0


class BacklogBudget:
    """What every socket has queued, in bytes, at most ``limit`` together (see the module docstring); ``clock`` tells
    the marks' time (trio's)."""

    def __init__(self, limit: int = SERVER_BACKLOG_BYTES, clock: Callable[[], float] = trio.current_time) -> None:
        self.limit = limit
        self.queued = 0  # bytes queued for all sockets together (what the metrics show)
        self.sent_away = 0  # sockets sent away to keep the total within the limit
        self._clock = clock
        self._held: dict[Backlogged, _Backlog] = {}
        self._heap: list[tuple[float, int, Backlogged]] = []  # (mark, order, socket); some marks out of date
        self._order = itertools.count()
        self._shedding = False

    def __len__(self) -> int:
        """The sockets that have something queued."""
        return len(self._held)

    def add(self, holder: Backlogged, size: int) -> None:
        """``holder`` queued ``size`` bytes more; while the total is over the limit, the socket behind the longest is
        sent away (``holder`` itself when it is)."""
        backlog = self._held.get(holder)
        if backlog is None:  # it had caught up: it is behind from now, by this text
            now = self._clock()
            backlog = self._held[holder] = _Backlog(since=now, counted=now, to_mark=size)
            heapq.heappush(self._heap, (backlog.since, next(self._order), holder))
            if len(self._heap) > 2 * len(self._held) + 64:
                self._rebuild()
        backlog.held += size
        self.queued += size
        if self.queued > self.limit and not self._shedding:
            self._shed()

    def sent(self, holder: Backlogged, size: int) -> None:
        """``size`` bytes of ``holder``'s queue (its oldest) were sent; once all it held at its count are, the mark
        moves to the count's time and what it holds now is counted (its heap entry stays until it comes to the
        top)."""
        backlog = self._held.get(holder)
        if backlog is None:
            return  # sent away already: nothing it held is counted
        size = min(size, backlog.held)
        self.queued -= size
        backlog.held -= size
        backlog.to_mark -= size
        if backlog.held == 0:
            del self._held[holder]
        elif backlog.to_mark <= 0:  # caught up with the count's time, not with now (see the module docstring)
            backlog.since, backlog.counted, backlog.to_mark = backlog.counted, self._clock(), backlog.held

    def release(self, holder: Backlogged) -> None:
        """``holder`` left or was sent away: nothing it holds is counted any more."""
        backlog = self._held.pop(holder, None)
        if backlog is not None:
            self.queued -= backlog.held

    def _shed(self) -> None:
        self._shedding = True  # a socket sent away may write its refusal: that write sends nobody away
        try:
            while self.queued > self.limit and self._heap:
                since, _, holder = heapq.heappop(self._heap)
                backlog = self._held.get(holder)
                if backlog is None:
                    continue  # gone, or an older entry of one sent away
                if backlog.since != since:  # its mark moved since this entry: back at its real mark
                    heapq.heappush(self._heap, (backlog.since, next(self._order), holder))
                    continue
                self.release(holder)
                self.sent_away += 1
                holder.send_away()
        finally:
            self._shedding = False

    def _rebuild(self) -> None:
        self._heap = [(backlog.since, next(self._order), holder) for holder, backlog in self._held.items()]
        heapq.heapify(self._heap)
