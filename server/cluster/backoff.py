"""Replacing a lost agent on the shared restart policy (:mod:`states.restart_policy`).

The local and Ray launchers replace a slot's agent, and an agent cut off from the authority
registers again, with the same exponential backoff and crash-loop limit as the in-process
worker restarts: one policy, one tracker per slot, this one step around it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from states.restart_policy import Event, RestartTracker
from states.stream_session import DrainCause

from ..log_pace import LogPace
from ..model_worker import LoadFailure

if TYPE_CHECKING:
    from .authority import ClusterAuthority

__all__ = ["back_off", "await_goodbye", "stays_down", "GOODBYE_GRACE", "EXIT_REFUSED"]

log = logging.getLogger("chunkline.cluster")

#: an agent's exit code when a replacement would be refused the same way (the authority refused it for good, or its
#: model worker refused the settings): its launcher does not replace it
EXIT_REFUSED = 3

#: seconds a drained agent's goodbye may trail the launcher's notice that it exited (either may come first)
GOODBYE_GRACE = 5.0


async def back_off(tracker: RestartTracker, cause: str, what: str, *, permanent: bool = False,
                   load_failure: LoadFailure | None = None, pipeline: str | None = None,
                   pace: LogPace | None = None) -> bool:
    """``what`` ended with ``cause``: wait out the backoff and return True to start again; False on a crash loop,
    at once when ``permanent`` (a replacement would end the same way), or when its agent never loaded and failed its
    load (``load_failure``) as the slot's last one did: one line then names ``pipeline`` and the error. ``pace``
    paces the restart's line (the same cause again and again); the crash loop's is always logged. A load failure's
    words come first in the line: the exit code alone said nothing of why."""
    if load_failure is not None:
        cause = f"{load_failure.words}; {cause}"
    decision = tracker.failure(trio.current_time(), cause, permanent=permanent, load_failure=load_failure)
    if decision.event is Event.LOAD_REPEATED:
        log.error("%s, pipeline %r: %s", what, pipeline, decision.reason)
        return False
    if decision.due_at is None:
        log.error("%s: %s", what, decision.reason)
        return False
    (pace.warning if pace is not None else log.warning)("%s: %s", what, decision.reason)
    await trio.sleep_until(decision.due_at)
    tracker.restarted(trio.current_time())
    return True


async def await_goodbye(settled: trio.Event, exited_cleanly: bool) -> None:
    """An agent that exited 0 drained, and its goodbye is on its socket: the launcher may see the exit first.
    Wait (bounded) until the authority settled the worker, so that a drained slot is never taken for a lost one
    and replaced, whichever notice comes first."""
    if exited_cleanly:
        with trio.move_on_after(GOODBYE_GRACE):
            await settled.wait()


def stays_down(authority: ClusterAuthority | None, tracker: RestartTracker, what: str,
               cause: DrainCause = DrainCause.WORKER_DRAIN) -> None:
    """``what``, a launcher's slot, stays down (drained, or given up: ``cause`` ``worker_failed``): the authority ends
    the queued sessions now, with why, when no worker is left to run them; they waited for their own session
    timeout."""
    if authority is not None:
        authority.slot_stays_down(cause, f"{what}: {tracker.describe(trio.current_time())}")
