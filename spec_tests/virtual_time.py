"""Let virtual time pass in a test on trio's autojump MockClock.

Tests that model timeouts, idle ticks and drains move the clock instead of waiting: under the
autojump clock a sleep returns as soon as every task is blocked, having fired each timer in
order on the way. ``elapse`` refuses to run on a real clock, so it can never become a real-time
wait that synchronizes by luck.
"""

from __future__ import annotations

import trio
import trio.testing


async def elapse(seconds: float) -> None:
    """Advance the MockClock by ``seconds``, every timer due on the way firing in order."""
    await elapse_until(trio.current_time() + seconds)


async def elapse_until(deadline: float) -> None:
    """Advance the MockClock to ``deadline`` (trio time)."""
    clock = trio.lowlevel.current_clock()
    if not isinstance(clock, trio.testing.MockClock):
        raise RuntimeError(f"elapse needs trio's MockClock (autojump_clock), not {type(clock).__name__}")
    await trio.sleep_until(deadline)  # bench-cost: none; virtual time only (the MockClock check above)
