"""One owner for a worker group: the ParallelWorkerStageActor, and an in-process group.

A state-owning worker group (N ranks, in this process or in worker processes)
must have exactly one actor owner for its whole life, so that result order and
cache mutation happen in one place. The actor calls a named method on the
group from its dedicated thread; a dead group fails the actor at once.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import trio

from states.pipeline_session import CloseReason

from .actor_protocol import ActorState
from .actors import ActorHealth, Completion, LocalStageActor, SessionContext, StageInvocation
from .errors import integer, shown
from .workers import WorkerGroupClosed, WorkerGroupFailed, device_labels, method_names

__all__ = ["InProcessWorkerGroup", "ParallelWorkerStageActor"]

log = logging.getLogger(__name__)


class InProcessWorkerGroup:
    """Worker "ranks" living in this process, with the worker-group interface.

    ``call(method, *args)`` calls ``method`` on every rank and returns a deferred
    result (a callable) giving rank 0's value, or every rank's values when the
    method is listed in ``gather`` (one method name, or an iterable of them).
    Process-backed groups (:class:`engine.workers.ProcessWorkerGroup`) share this
    interface and its rules: ``device_ids`` is one label per rank; once failed
    (``fail``), a call raises :class:`WorkerGroupFailed` and a failure callback added
    later runs at once; ``close()`` is idempotent, refuses calls from its start
    (:class:`WorkerGroupClosed`), and runs every rank's ``close()`` once, each even
    when another's raises (its traceback is kept in ``close_errors``, by rank).
    """

    def __init__(
        self,
        rank_factory: Callable[[int], Any],
        *,
        world_size: int = 1,
        device_ids: Iterable[str] | None = None,
        gather: Iterable[str] = (),
    ) -> None:
        world_size = integer("world_size", world_size, minimum=1)
        self.device_ids = device_labels(device_ids, world_size)
        self._gather = method_names("gather", gather)
        if not callable(rank_factory):
            raise TypeError(f"rank_factory must be a callable taking the rank, got {shown(rank_factory)}")
        self.world_size = world_size
        self.failed = False
        self.failure_reason: str | None = None
        self.closed = False
        self.close_errors: dict[int, str] = {}  # rank -> traceback of its close() failing
        self._closing = False
        self._lock = threading.Lock()
        self._close_lock = threading.RLock()
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._ranks = [rank_factory(rank) for rank in range(world_size)]
        self._unclosed = deque(enumerate(self._ranks))  # the ranks whose close() has not run

    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` runs once, in any thread, when the group fails (at once if it has)."""
        with self._lock:
            if not self.failed:
                self._failure_callbacks.append(callback)
                return
            reason = self.failure_reason
        callback(reason)  # type: ignore[arg-type]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        if self.failed:
            raise WorkerGroupFailed(f"worker group failed: {self.failure_reason}")
        if self._closing:
            raise WorkerGroupClosed("worker group is closed")
        results = [getattr(rank, method)(*args, **kwargs) for rank in self._ranks]
        value = results if method in self._gather else results[0]
        return lambda: value

    def fail(self, reason: str) -> None:
        """The group is broken: every later call fails; each failure callback runs once (one that raises is
        logged). A group already failed, closing or closed stays as it is."""
        with self._lock:
            if self.failed or self._closing:
                return
            self.failed = True
            self.failure_reason = reason
            callbacks = list(self._failure_callbacks)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("in-process worker group: a failure callback raised")

    def close(self) -> None:
        """Run each rank's ``close()`` (if it has one) once; idempotent. A close interrupted half-way (Ctrl-C) is
        finished by the next."""
        with self._close_lock:
            with self._lock:
                self._closing = True
            while self._unclosed:
                rank, worker = self._unclosed.popleft()
                closer = getattr(worker, "close", None)
                if closer is None:
                    continue
                try:
                    closer()
                except Exception:
                    self.close_errors[rank] = traceback.format_exc()
                    log.warning("in-process worker group: rank %d's close() raised", rank, exc_info=True)
            self.closed = True


class ParallelWorkerStageActor:
    """Gives one worker group exactly one owner for its whole life.

    Each invocation becomes ``worker.call(method_name, *args, **kwargs)`` with
    ``(args, kwargs) = input_builder(invocation)``; a deferred (callable) result
    is resolved on the actor's thread; ``output_builder(result, invocation)``
    maps it to the stage's artifacts.
    """

    def __init__(
        self,
        worker: Any,
        method_name: str,
        *,
        input_builder: Callable[[StageInvocation], tuple[tuple, dict]],
        output_builder: Callable[[Any, StageInvocation], Mapping[str, Any]],
        name: str | None = None,
        mailbox_capacity: int = 1,
        close_worker: bool = True,
        session_closer: Callable[[SessionContext, CloseReason], Any] | None = None,
    ) -> None:
        self.worker = worker
        self.method_name = method_name
        self._input_builder = input_builder
        self._output_builder = output_builder
        self._close_worker = close_worker
        self._inner = LocalStageActor(
            self._handle,
            name=name or f"parallel-{method_name}",
            mailbox_capacity=mailbox_capacity,
            session_closer=session_closer,
        )
        self.name = self._inner.name

    def _handle(self, invocation: StageInvocation) -> Mapping[str, Any]:
        args, kwargs = self._input_builder(invocation)
        result = self.worker.call(self.method_name, *args, **kwargs)
        if callable(result):
            result = result()
        return self._output_builder(result, invocation)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        add_callback = getattr(self.worker, "add_failure_callback", None)
        if add_callback is not None:
            token = trio.lowlevel.current_trio_token()

            def on_worker_failed(reason: str) -> None:  # any thread (e.g. a process monitor)
                if threading.get_ident() == self._inner.thread_ident:
                    # noticed during this actor's own call: that call's error follows and carries the
                    # cause (the orchestrator then fails the actor with it), so nothing is posted ahead
                    return
                try:
                    token.run_sync_soon(self._fail_from_worker, reason)
                except trio.RunFinishedError:
                    pass

            add_callback(on_worker_failed)
        await self._inner.run(task_status=task_status)

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        self._inner.add_failure_listener(listener)

    def submit(self, invocation: StageInvocation, on_done: Completion) -> None:
        self._sync_worker_health()
        self._inner.submit(invocation, on_done)

    @property
    def threadsafe_submit(self) -> bool:
        return self._inner.threadsafe_submit

    def health(self) -> ActorHealth:
        self._sync_worker_health()
        inner = self._inner.health()
        if getattr(self.worker, "closed", False) and not inner.failed:
            return ActorHealth(ActorState.CLOSED, inner.pending_invocations, None)
        return inner

    def is_healthy(self) -> bool:
        self._sync_worker_health()
        return self._inner.is_healthy() and not getattr(self.worker, "closed", False)

    def _sync_worker_health(self) -> None:
        if getattr(self.worker, "failed", False):
            self._fail_from_worker(str(getattr(self.worker, "failure_reason", None) or "worker group failed"))

    def _fail_from_worker(self, reason: str) -> None:
        """The group died: the actor fails with a WorkerGroupFailed naming why, as the cause."""
        self._inner.fail(reason, cause=WorkerGroupFailed(f"worker group of {self.name!r} failed: {reason}"))

    async def close_session(self, context: SessionContext, reason: CloseReason) -> None:
        self._sync_worker_health()
        await self._inner.close_session(context, reason)

    async def barrier(self) -> None:
        await self._inner.barrier()

    async def aclose(self) -> None:
        """Close the actor, then the group it owns, even when the caller's deadline cuts the actor's close short (a
        call that never returns): the group's own close is bounded, and it ends that call. (Its ranks were left
        running, the actor's thread blocked in the call, for as long as the process lived.)"""
        try:
            await self._inner.aclose()
        finally:
            if self._close_worker and not getattr(self.worker, "closed", False):
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.worker.close)

    @property
    def thread_ident(self) -> int | None:
        return self._inner.thread_ident
