"""An agent's side of the liveness clock (:mod:`states.liveness`): its heartbeats, their acknowledgements, the fence.

The agent heartbeats at the interval its Welcome gave; the authority acknowledges each. One that has had no heartbeat
acknowledged for :func:`~states.liveness.fence_at`'s time (half the authority's deadline) stops its sessions before the
authority can count it lost, so that no session runs on two workers at once. A fence is the authority's silence (it
stalled, or the way to it broke), not this agent failing: the registration it ends is dialed again without counting
toward the crash-loop limit (:data:`~server.cluster.dial_ends.End.FENCED`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import trio

from states.liveness import fence_at

from . import wire

__all__ = ["HeartbeatClock", "FENCED", "SENT_KEPT"]

#: how a registration ends when the agent fences itself
FENCED = "no heartbeat acknowledged: fenced before the authority's deadline"
#: heartbeats awaiting their acknowledgement that the clock remembers (older ones are forgotten)
SENT_KEPT = 64


class HeartbeatClock:
    """When the newest acknowledged heartbeat was sent, across the agent's registrations (single owner: its trio
    thread)."""

    def __init__(self) -> None:
        self.acked_sent_at = 0.0
        self._sent_at: dict[int, float] = {}

    def registered(self, sent_at: float) -> None:
        """A registration began: the authority's deadline starts when its register arrived (sent at ``sent_at``)."""
        self.acked_sent_at = sent_at

    def acknowledged(self, seq: int) -> None:
        """The authority acknowledged heartbeat ``seq`` (and so every earlier one)."""
        sent = self._sent_at.pop(seq, None)
        if sent is not None:
            self.acked_sent_at = max(self.acked_sent_at, sent)
        for earlier in [s for s in self._sent_at if s < seq]:
            del self._sent_at[earlier]

    async def beat(self, interval: float, send: Callable[[wire.Message], None], sessions: Callable[[], Iterable[str]]
                   ) -> str:
        """Send a heartbeat (naming the sessions it runs) every ``interval`` seconds, for as long as the registration
        lasts."""
        seq = 0
        while True:
            seq += 1
            self._sent_at[seq] = trio.current_time()
            while len(self._sent_at) > SENT_KEPT:
                del self._sent_at[min(self._sent_at)]
            send(wire.Heartbeat(seq, tuple(sessions())))
            await trio.sleep(interval)

    async def fence(self, deadline: float) -> str:
        """Return :data:`FENCED` once no heartbeat was acknowledged for :func:`~states.liveness.fence_at`'s time."""
        while True:
            fence = fence_at(self.acked_sent_at, deadline)
            if trio.current_time() >= fence:
                return FENCED
            await trio.sleep_until(fence)
