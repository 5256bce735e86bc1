"""A token bucket on the caller's clock: how the server paces what others can make it do as often as they like
(a participant's data messages, warnings a connection can cause)."""

from __future__ import annotations

__all__ = ["TokenBucket"]


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
