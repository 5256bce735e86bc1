"""The text queued for every local-room socket together: one server-wide budget, the furthest behind sent away first.

Each socket's queue of unsent text is bounded on its own (``TEXT_BACKLOG``/``TEXT_BACKLOG_BYTES`` in
:mod:`.local_room`: 1 MiB), but nothing bounded them together: 1,024 frozen viewers (the front's connection limit)
could make the server hold 1 GiB until each was sent away. :class:`BacklogBudget` counts what every socket has queued
and, when a write takes the total past :data:`SERVER_BACKLOG_BYTES`, sends away ``too_slow`` the sockets that hold the
most, largest first, until it fits again -- whichever socket the write was for. "Behind" is measured as the
per-socket bound measures it, in bytes queued:

- **fair to honest readers**: the total is over the budget only when the largest backlog is at least the budget's
  equal share (64 KiB with 1,024 sockets), so a socket that keeps its backlog under that is never sent away for the
  budget, however many frozen sockets filled it; a frozen socket's backlog only grows, a reader's drains, so the
  frozen go first. The socket written to now is not spared, nor singled out: it goes only if it holds the most;
- **O(log n) a write**: a heap of (bytes, socket), updated lazily. A growing backlog pushes an entry; a shrinking one
  leaves its old, larger entry, which is put back at its real size when it comes to the top; the heap is rebuilt
  once it holds twice as many entries as backlogs (amortised O(1)). No write passes over all the sockets.

A message fanned out to a room is one string that each socket's queue refers to, so the server holds at most what
this counts. What a socket sends away with (its ``too_slow`` refusal, a few dozen bytes) is not counted.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Final, Protocol

__all__ = ["SERVER_BACKLOG_BYTES", "Backlogged", "BacklogBudget"]

#: all sockets' queued text together: a whole room (64 sockets) of frozen viewers at their own 1 MiB bound fits, a
#: sixteenth of what 1,024 frozen sockets held before, and with the front's 1,024 connections each socket's equal
#: share is 64 KiB, what a socket that reads may fall behind by without ever being sent away for the budget
SERVER_BACKLOG_BYTES: Final = 64 * 1024 * 1024


class Backlogged(Protocol):
    """A socket whose queued text the budget counts."""

    def send_away(self) -> None:
        """Drop the queue and send the socket away ``too_slow`` (the budget no longer counts what it held)."""


class BacklogBudget:
    """What every socket has queued, in bytes, at most ``limit`` together (see the module docstring)."""

    def __init__(self, limit: int = SERVER_BACKLOG_BYTES) -> None:
        self.limit = limit
        self.queued = 0  # bytes queued for all sockets together (what the metrics show)
        self.sent_away = 0  # sockets sent away to keep the total within the limit
        self._held: dict[Backlogged, int] = {}
        self._heap: list[tuple[int, int, Backlogged]] = []  # (-bytes, order, socket); some entries out of date
        self._order = itertools.count()
        self._shedding = False

    def __len__(self) -> int:
        """The sockets that have something queued."""
        return len(self._held)

    def add(self, holder: Backlogged, size: int) -> None:
        """``holder`` queued ``size`` bytes more; while the total is over the limit, the socket holding the most is
        sent away (``holder`` itself when it does)."""
        held = self._held[holder] = self._held.get(holder, 0) + size
        self.queued += size
        heapq.heappush(self._heap, (-held, next(self._order), holder))
        if len(self._heap) > 2 * len(self._held) + 64:
            self._rebuild()
        if self.queued > self.limit and not self._shedding:
            self._shed()

    def sent(self, holder: Backlogged, size: int) -> None:
        """``size`` bytes of ``holder``'s queue were sent (its heap entry stays until it comes to the top)."""
        held = self._held.get(holder)
        if held is None:
            return  # sent away already: nothing it held is counted
        size = min(size, held)
        self.queued -= size
        if held == size:
            del self._held[holder]
        else:
            self._held[holder] = held - size

    def release(self, holder: Backlogged) -> None:
        """``holder`` left or was sent away: nothing it holds is counted any more."""
        self.queued -= self._held.pop(holder, 0)

    def _shed(self) -> None:
        self._shedding = True  # a socket sent away may write its refusal: that write sends nobody away
        try:
            while self.queued > self.limit and self._heap:
                size, _, holder = heapq.heappop(self._heap)
                held = self._held.get(holder)
                if held is None:
                    continue  # gone, or an older entry of one sent away
                if held != -size:  # it shrank since this entry: back at its real size
                    heapq.heappush(self._heap, (-held, next(self._order), holder))
                    continue
                self.release(holder)
                self.sent_away += 1
                holder.send_away()
        finally:
            self._shedding = False

    def _rebuild(self) -> None:
        self._heap = [(-held, next(self._order), holder) for holder, held in self._held.items()]
        heapq.heapify(self._heap)
