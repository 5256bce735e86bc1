"""Queued sessions that no worker will ever run end at once, with the reason.

A create is a 503 with no ``Retry-After`` once no worker runs, starts or is due to restart and no agent can join:
nothing will come. The sessions already queued then wait for the same nothing; they stayed queued, their clients
waiting in their rooms, until each one's own session timeout. They end as soon as the server knows it: when the last
worker that could run them is drained (in-process, or a launcher's agent whose slot stays down). An in-process slot
that gives up is told in ``StreamRuntime.worker_failed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from states.stream_session import DrainCause

if TYPE_CHECKING:
    from .runtime import StreamRuntime

__all__ = ["end_if_nothing_will_run"]


def nothing_will_run(runtime: StreamRuntime) -> bool:
    """Whether no worker takes sessions or will (none runs or starts, no slot is due to restart, no agent may join)."""
    if runtime.closing or runtime.book.can_place() or runtime.slots.retry_after(trio.current_time()) is not None:
        return False
    return runtime.cluster is None or not runtime.cluster.agent_may_join()


def end_if_nothing_will_run(runtime: StreamRuntime, cause: DrainCause, reason: str) -> None:
    """End every queued session with ``cause`` (the table fails it, with ``reason``) when nothing will run them."""
    if not nothing_will_run(runtime):
        return
    queued = [record for record in map(runtime.registry.find, runtime.book.queued_ids()) if record is not None]
    if queued:
        runtime.spawn(runtime.queued_ends.end, queued, cause, f"no worker can take the session: {reason}")
