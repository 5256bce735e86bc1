"""A token bucket on the caller's clock: how the server paces what others can make it do as often as they like
(a participant's data messages, warnings a connection can cause), and buckets kept per participant across its
reconnects (:class:`KeptBuckets`: the front's frame caps and the rooms' data paces alike)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

__all__ = ["KeptBuckets", "Refilling", "TokenBucket"]


class TokenBucket:
    """``burst`` tokens refilled at ``rate`` a second; full until its first use. ``now`` is whatever clock the
    caller reads (trio's, an asyncio loop's), the same one every time."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None

    def _refill(self, now: float) -> None:
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def available(self, now: float) -> float:
        """The tokens there at ``now`` (less than zero while a charge's debt is being paid)."""
        self._refill(now)
        return self._tokens

    def wait(self, now: float) -> float:
        """0.0, having taken a token, when one is there at ``now``; else the seconds until one will be (nothing
        taken)."""
        self._refill(now)
        if self._tokens >= 1 - 1e-9:  # a wait of exactly the missing part refills to 1, less a rounding
            self._tokens = max(0.0, self._tokens - 1)
            return 0.0
        return (1 - self._tokens) / self.rate

    def full_at(self, now: float) -> float:
        """When the bucket will be full again if nothing more is taken (``now`` when it is full)."""
        return now + (self.burst - self.available(now)) / self.rate

    def took_at(self, now: float) -> None:
        """A token was taken at ``now`` by one who waited for it: the bucket is empty from then (a wait's overshoot
        is not made up for later)."""
        self._tokens, self._at = 0.0, now

    def charge(self, now: float, count: int) -> float:
        """Take ``count`` tokens at ``now`` for what was already taken in, going into debt past the burst; returns
        the seconds to wait before taking more (0.0 when the bucket covered it). Paying after suits a reader that
        learns how much it took only by reading it (the frames of one read)."""
        self._refill(now)
        self._tokens -= count
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class Refilling(Protocol):
    """What :class:`KeptBuckets` keeps: a pace that says when it is full again."""

    def full_at(self, now: float) -> float:
        """When it will be full again if nothing more is taken (``now`` when it is full)."""


Kept = TypeVar("Kept", bound=Refilling)


class _Entry(Generic[Kept]):
    def __init__(self, pace: Kept) -> None:
        self.pace = pace
        self.holders = 0
        self.left = 0  # how many times the last holder left: a due entry is for this leaving only


class KeptBuckets(Generic[Kept]):
    """One pace per key (a participant), the same one however often its holders leave and come back, so that coming
    back buys no fresh burst: a :class:`TokenBucket` (the front's frame cap) or anything that says when it is full
    again (the rooms' :class:`~server.transport.data_pace.DataPace`, two buckets), made by ``make`` when a key has none.

    A key's pace is kept while a holder has it and, once none has, until it is full again: a full pace is what a new
    one is, so forgetting it then gives nothing away, and what is kept is bounded by the keys that left since their
    paces last were full (a second or so) and by ``most``: past it the paces nearest to full are forgotten first.
    """

    def __init__(self, make: Callable[[], Kept], *, most: int) -> None:
        self.make = make
        self.most = most
        self._kept: dict[Hashable, _Entry[Kept]] = {}
        self._due: list[tuple[float, int, Hashable]] = []  # (full at, leaving, key) of the keys none holds
        self._resting = 0

    def __len__(self) -> int:
        return len(self._kept)

    def hold(self, key: Hashable, now: float) -> Kept:
        """``key``'s pace, for a holder until :meth:`release`: the kept one, or a new (full) one."""
        self._forget_full(now)
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = _Entry(self.make())
        elif kept.holders == 0:
            self._resting -= 1
        kept.holders += 1
        return kept.pace

    def release(self, key: Hashable, now: float) -> None:
        """A holder of ``key``'s pace is done with it; the last one leaves it kept until it is full again."""
        kept = self._kept[key]
        kept.holders -= 1
        if kept.holders == 0:
            kept.left += 1
            self._resting += 1
            heapq.heappush(self._due, (kept.pace.full_at(now), kept.left, key))
        self._forget_full(now)

    def _forget_full(self, now: float) -> None:
        while self._due and (self._due[0][0] <= now or self._resting > self.most):
            _, left, key = heapq.heappop(self._due)
            kept = self._kept.get(key)
            if kept is not None and kept.holders == 0 and kept.left == left:
                del self._kept[key]
                self._resting -= 1
