"""An agent's drain, and what its log says of it: who asked (the authority's drain route, or a stop signal) and
the deadline when it begins; how many sessions finished and how many were stopped, and the exit status, when the
agent leaves. An agent drained through the API logged nothing after "registered as ..." and exited 0: its
operator could not tell a drain from a crash-free exit of any other kind.

What a drain does to the agent's life (the states, the exit status) is :mod:`states.agent`'s table; this only runs
the sessions' part and keeps the count.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from .agent_sessions import AgentSessions

__all__ = ["AgentDrain"]

log = logging.getLogger("chunkline.agent")


class AgentDrain:
    """The sessions' side of one agent's drain: they finish within the deadline, or are stopped."""

    def __init__(self, sessions: AgentSessions) -> None:
        self.sessions = sessions
        self.done = trio.Event()  # the sessions are settled: the agent says goodbye
        self.asked_by: str | None = None  # None: no drain began
        self.finished = 0  # sessions that ended within the deadline
        self._stopped: set[str] = set()  # sessions stopped: at the deadline (at a chunk boundary), or at once (cut short)
        self.cut_short_by: str | None = None

    @property
    def stopped(self) -> int:
        return len(self._stopped)

    async def run(self, asked_by: str, deadline: float) -> None:
        """No new sessions (the caller's table says so); the live ones finish within ``deadline`` seconds, then the
        rest are stopped at a chunk boundary."""
        self.asked_by = asked_by
        live = set(self.sessions.runners)
        log.info("draining, asked by %s: no new sessions; %d live session(s) have %g s to finish", asked_by, len(live),
                 deadline)
        with trio.move_on_after(deadline):
            await self.sessions.until_empty()
        left = set(self.sessions.runners)
        # a second signal meanwhile stopped some: they did not finish (they were counted twice, finished and stopped)
        self.finished += len(live - left - self._stopped)
        self._stopped |= left
        await self.sessions.stop_all("worker_drain", hard=False)  # at a chunk boundary, never mid-chunk
        self.done.set()

    async def stop_now(self, cause: str, signal_name: str) -> None:
        """A second signal during the drain: each session ends now, failed with ``cause``, then the agent leaves."""
        self.cut_short_by = signal_name
        self._stopped |= set(self.sessions.runners)
        await self.sessions.stop_all(cause, hard=True)
        self.done.set()

    def log_end(self, exit_status: int) -> None:
        """The agent leaves: the drain's outcome and the exit status, in one line (nothing when no drain began)."""
        if self.asked_by is None:
            return
        how = "drained" if self.cut_short_by is None else f"drain cut short by a second {self.cut_short_by}"
        log.info("%s (asked by %s): %d session(s) finished, %d stopped; exiting with status %d", how, self.asked_by,
                 self.finished, self.stopped, exit_status)
