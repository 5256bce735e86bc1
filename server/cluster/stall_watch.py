"""The authority's watch on its own event loop, so that the losses its own stall causes are told as its doing.

An authority that does not run for a while (SIGSTOP and SIGCONT, a held event loop, a frozen host) acknowledges no
heartbeat meanwhile: its agents fence themselves (:func:`states.liveness.fence_at`) and, once it runs again, it finds
their connections closed or their heartbeats overdue. Those losses read ``heartbeat missed``, which blamed the agents.
The watch notices the gap (a tick every heartbeat interval, and a look at every loss, whichever runs first after the
stall), logs it once, and :meth:`StallWatch.cause` names the stall in the losses it explains
(:func:`states.liveness.stall_cause`).
"""

from __future__ import annotations

import logging

import trio

from states.liveness import FENCE_FRACTION, fences_agents, stall_cause

__all__ = ["StallWatch"]

log = logging.getLogger("chunkline.cluster")


class StallWatch:
    """When the authority last ran, and its last stall long enough to fence its agents (single owner: the authority's
    trio thread)."""

    def __init__(self, deadline: float, interval: float) -> None:
        self.deadline = deadline
        self.interval = interval
        self.last_ran: float | None = None  # set as the watch starts (trio's clock)
        self.stall = 0.0  # seconds of the last stall that fenced the agents
        self.ended_at: float | None = None  # when it ended

    async def run(self) -> None:
        self.last_ran = trio.current_time()
        while True:
            await trio.sleep(self.interval)
            self.note(trio.current_time())

    def note(self, now: float) -> None:
        """The authority runs at ``now``: a gap since it last ran, past its own tick, long enough to fence the
        agents is a stall of its own."""
        if self.last_ran is not None and fences_agents(now - self.last_ran - self.interval, self.deadline):
            self.stall, self.ended_at = now - self.last_ran, now
            log.warning("cluster: the authority stalled for %.1f s (its event loop did not run), past the %.1f s its "
                        "agents wait for an acknowledged heartbeat before they fence themselves", self.stall,
                        self.deadline * FENCE_FRACTION)
        self.last_ran = now

    def cause(self, cause: str, now: float) -> str:
        """A loss's cause at ``now``, naming the authority's stall where that explains it."""
        self.note(now)
        if self.ended_at is None:
            return cause
        return stall_cause(cause, self.stall, now - self.ended_at, self.deadline)
