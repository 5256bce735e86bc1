"""When a launcher starts a lost worker again: exponential backoff and a crash-loop limit.

Theory of operation
-------------------
A launcher slot (one local agent process, one Ray actor) that ends is started
again after a delay that doubles with each failure in a row (``base``,
``2 * base``, ... capped at ``cap``). A slot whose worker stayed up for
``healthy_after`` seconds counts as healthy again: its next failure starts the
backoff over. More than ``crash_loop_limit`` failures within ``window`` seconds
is a crash loop: the slot gives up and stays down (health says degraded), so a
broken pipeline or node does not spin forever.

Pure: every decision takes ``now``; the launcher sleeps, starts and kills.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import attrs

__all__ = ["RelaunchPolicy", "RelaunchDecision", "SlotRestarts"]


def _positive(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{attribute.name}={value!r}: must be a number > 0")


@attrs.frozen
class RelaunchPolicy:
    base: float = attrs.field(default=0.5, validator=_positive)
    cap: float = attrs.field(default=30.0, validator=_positive)
    healthy_after: float = attrs.field(default=60.0, validator=_positive)
    window: float = attrs.field(default=120.0, validator=_positive)
    crash_loop_limit: int = attrs.field(default=5, validator=_positive)


@attrs.frozen
class RelaunchDecision:
    action: Literal["restart", "give_up"]
    delay: float  # seconds to wait before starting again (0 when giving up)
    failures_in_window: int
    reason: str


@attrs.define
class SlotRestarts:
    """The failure history of one launcher slot."""

    policy: RelaunchPolicy = attrs.Factory(RelaunchPolicy)
    started_at: float | None = None
    streak: int = 0  # failures in a row without a healthy run between them
    failures: deque = attrs.Factory(deque)  # failure times within the window
    gave_up: bool = False

    def started(self, now: float) -> None:
        self.started_at = now

    def ended(self, now: float, why: str) -> RelaunchDecision:
        """The slot's worker ended (exited, was lost): restart after a delay, or give up."""
        policy = self.policy
        if self.started_at is not None and now - self.started_at >= policy.healthy_after:
            self.streak = 0
        self.streak += 1
        self.failures.append(now)
        while self.failures and now - self.failures[0] > policy.window:
            self.failures.popleft()
        count = len(self.failures)
        if count > policy.crash_loop_limit:
            self.gave_up = True
            return RelaunchDecision(
                "give_up", 0.0, count, f"crash loop: {count} failures within {policy.window:g} s (last: {why})"
            )
        delay = min(policy.cap, policy.base * 2 ** (self.streak - 1))
        return RelaunchDecision("restart", delay, count, why)
