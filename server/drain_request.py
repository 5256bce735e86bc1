"""``POST /v1/service/workers/{id}/drain``: what a drain asked through the API does, for an in-process worker and
an agent alike. A drain under way keeps its deadline: a second one was answered 202 with its own deadline as if in
force, while the worker (an agent ignores another drain) kept the first's."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from states.admission import UnknownWorker
from states.worker import DRAINABLE, LOADING, TERMINAL

from . import runtime_views
from .runtime_errors import SessionConflict

if TYPE_CHECKING:
    from .runtime import StreamRuntime

log = logging.getLogger("chunkline.runtime")


def drain_worker(runtime: StreamRuntime, worker_id: str, deadline: float) -> dict[str, Any]:
    """Live sessions finish or are drained at the deadline. A worker still loading, draining already, stopped or
    failed is a conflict, and nothing changes."""
    worker = runtime.workers.get(worker_id)
    if worker is None:
        raise UnknownWorker(worker_id)
    state = runtime.book.worker_state(worker_id)
    if state in LOADING:
        raise SessionConflict(f"worker {worker_id} is still starting; drain it once it is ready")
    if state in TERMINAL:  # a 202 echoing a deadline nothing applied, and a drain sent to an agent that had left
        raise SessionConflict(f"worker {worker_id} has {state.value}: there is nothing left to drain")
    if state not in DRAINABLE:  # neither loading, drainable nor ended: draining now
        raise SessionConflict(f"worker {worker_id} is already draining: the drain under way keeps its deadline "
                              "(a second drain changes nothing)")
    log.info("worker %s drains, as asked through the API: its live sessions end within %g s; it is not restarted",
             worker_id, deadline)
    if runtime.cluster is not None:
        runtime.cluster.drain(worker_id, deadline)
    else:
        runtime.drain_in_book(worker_id)
        runtime.spawn(runtime.in_process.drain, worker, deadline)
    runtime_views.publish_gauges(runtime)
    return {"worker_id": worker_id, "state": runtime.book.worker_state(worker_id).value, "deadline_seconds": deadline}
