"""The in-process model workers: one per slot, replaced with backoff when it fails, stopped when drained.

The stream runtime owns the admission book and the sessions; this module owns
only when an in-process worker is started, restarted and stopped. It tells the
runtime through its public calls (``worker_ready``, ``worker_failed``) and
runs its tasks in the runtime's nursery (``spawn``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from states.restart_policy import Event
from states.stream_session import DrainCause
from states.worker import LOADING

from . import runtime_views
from .model_worker import LoadFailure, ModelWorker
from .orphaned_queue import end_if_nothing_will_run
from .run_signals import exit_now
from .worker_slots import WorkerSlot

if TYPE_CHECKING:
    from .runner import RoomRunner
    from .runtime import StreamRuntime

__all__ = ["InProcessWorkers"]

log = logging.getLogger("chunkline.runtime")

#: the settings the server offers a pipeline that names them in ``get_service``: (the name offered, the setting, its flag)
OFFERED_SETTINGS = (("control_idle_timeout", "control_idle_timeout", "--control-idle-timeout"),
                    ("fps", "default_fps", "--default-fps"))


class InProcessWorkers:
    """Starts one ``ModelWorker`` per slot of ``runtime.slots`` and keeps the slots filled."""

    def __init__(self, runtime: StreamRuntime, service_loader: Callable[..., Any] | None, delete_wait: float) -> None:
        self.runtime = runtime
        self.service_loader = service_loader
        self.delete_wait = delete_wait
        self._told_untaken = False  # the line about settings the pipeline does not take is said once a server
        self._told_load_failure: LoadFailure | None = None  # the last failed load whose traceback was logged

    def start(self) -> None:
        """One worker per configured GPU group (or ``num_workers`` with no devices)."""
        settings = self.runtime.settings
        groups = settings.worker_gpu_map or tuple(() for _ in range(settings.num_workers))
        for index, gpu_ids in enumerate(groups):
            self.start_worker(self.runtime.slots.add(f"worker-{index}", tuple(gpu_ids)))

    def start_worker(self, slot: WorkerSlot) -> ModelWorker:
        """A fresh worker for ``slot``: a new id (``worker-0``, then ``worker-0.1``...), its own capacity plan."""
        runtime = self.runtime
        settings = runtime.settings
        worker_id = slot.next_worker_id()
        initial = settings.max_sessions_per_worker
        options: dict[str, Any] = {}
        if self.service_loader is not None:
            options["service_loader"] = self.service_loader
        worker = ModelWorker(
            worker_id,
            pipeline=settings.pipeline,
            gpu_ids=slot.gpu_ids,
            max_sessions=initial,
            on_ready=self._ready,
            on_failed=runtime.worker_failed,
            worker_mode=settings.worker_mode,
            placement=settings.placement,
            offered={"control_idle_timeout": settings.control_idle_timeout, "fps": settings.default_fps,
                     "served": True, "assets_dir": settings.assets_dir},
            validate=not settings.skip_validation,
            new_load_failure=self._new_load_failure,
            **options,
        )
        forgotten = runtime.slots.fill(slot, worker)
        if forgotten is not None:
            runtime.forget_worker(forgotten)
        runtime.workers[worker_id] = worker
        runtime.book.add_worker(worker_id, initial if isinstance(initial, int) else 1, trio.current_time())
        runtime.spawn(worker.run)
        return worker

    def _new_load_failure(self, failure: LoadFailure) -> bool:
        """Whether no worker's load failed this way just before (its traceback is logged once, not per retry or
        slot)."""
        new, self._told_load_failure = failure != self._told_load_failure, failure
        return new

    def _ready(self, worker: ModelWorker, capacity: int, plan: Any) -> None:
        slot = self.runtime.slots.holding(worker)
        if slot is not None:
            slot.tracker.loaded()  # its slot's later failures are crashes, retried with backoff
        self._tell_untaken_settings(worker)
        self.runtime.worker_ready(worker, capacity, plan)

    def _tell_untaken_settings(self, worker: ModelWorker) -> None:
        """A setting given on purpose (not its default) that the pipeline's ``get_service`` does not name is said once
        as the first worker loads: it was dropped without a word (a misspelt ``fsp=`` took no ``--default-fps``)."""
        taken = worker.offered_taken
        if taken is None or self._told_untaken:
            return
        self._told_untaken = True
        settings = self.runtime.settings
        fields = attrs.fields_dict(type(settings))
        for offered, field, flag in OFFERED_SETTINGS:
            value = getattr(settings, field)
            if offered not in taken and value != fields[field].default:
                log.warning("the pipeline's get_service() takes no %r, so %s %g does not reach it (metadata's "
                            "worker_settings lists what it takes)", offered, flag, value)

    def loading(self) -> bool:
        """Whether one of this server's own workers still loads its pipeline (the book has it in a loading state):
        no session is on it, and its load, in a thread or a child process, cannot be cancelled, only abandoned."""
        if self.runtime.settings.workers != "in-process":  # agents load in processes of their own
            return False
        return any(view.state in LOADING for view in self.runtime.book.workers())

    def abandon_a_load(self, number: int, abandon: Callable[[], None], logger: logging.Logger) -> None:
        """After a stop's drain (by signal ``number``): a worker still loading its pipeline ends the process now,
        exit 128 + the signal, ``abandon`` first (what the process holds on disk, its service processes). No session
        was on the load, and it cannot be cancelled: waited for, it held the exit until it returned."""
        if self.loading():
            exit_now(128 + number, "a worker still loads its pipeline (nothing of it to drain)", abandon, logger)

    def failed(self, worker: ModelWorker, reason: str, now: float, *, permanent: bool = False) -> bool:
        """A worker failed: its slot backs off and restarts it; False when the slot gave up (a crash loop, at once
        when the worker refused its configuration: ``permanent``, or when no worker of the slot ever loaded and this
        load failed as the last one did)."""
        slot = self.runtime.slots.holding(worker)
        if slot is None:
            return True
        decision = slot.tracker.failure(now, reason, permanent=permanent, load_failure=worker.load_failure)
        if decision.event is Event.LOAD_REPEATED:  # one line that says it all: which pipeline, why, and what now
            log.error("worker slot %s, pipeline %r: %s", slot.name, self.runtime.settings.pipeline, decision.reason)
        else:
            (log.error if decision.delay is None else log.warning)("worker slot %s: %s", slot.name, decision.reason)
        if decision.delay is None:
            return False
        self.runtime.spawn(self.restart_when_due, slot)
        return True

    async def restart_when_due(self, slot: WorkerSlot) -> None:
        """Replace a failed worker once its backoff has passed (unless the server is stopping)."""
        due_at = slot.tracker.due_at
        if due_at is None:
            return
        await trio.sleep_until(due_at)
        now = trio.current_time()
        if self.runtime.closing or not slot.tracker.due(now):
            return
        slot.tracker.restarted(now)
        self.runtime.metrics.record_worker_restart()
        worker = self.start_worker(slot)
        log.info("worker slot %s: started %s (restart %d)", slot.name, worker.worker_id, slot.tracker.restarts)
        runtime_views.publish_gauges(self.runtime)

    async def drain(self, worker: ModelWorker, deadline: float) -> None:
        """Let the worker's sessions finish for ``deadline`` seconds, drain the rest, then stop it for good."""
        def on_worker() -> list[RoomRunner]:
            return [r for r in self.runtime.runners.values() if r.worker is worker]

        end_if_nothing_will_run(self.runtime, DrainCause.WORKER_DRAIN,
                                f"worker {worker.worker_id} was drained and no other worker runs or starts")
        with trio.move_on_after(deadline):
            while on_worker():
                await on_worker()[0].finished.wait()
        for runner in on_worker():
            runner.drain(DrainCause.WORKER_DRAIN)  # at a chunk boundary, never mid-chunk
        with trio.move_on_after(self.delete_wait):
            while on_worker():
                await on_worker()[0].finished.wait()
        worker.stop()
        slot = self.runtime.slots.holding(worker)
        if slot is not None:
            slot.tracker.stop()  # drained on purpose: the slot stays down, and health says so
        runtime_views.publish_gauges(self.runtime)
