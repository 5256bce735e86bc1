"""In-process worker slots: the configured worker places, their GPUs and their restart history.

A slot outlives the workers that fill it: when its worker fails, the slot's
:class:`RestartTracker` decides whether and when a fresh worker (``worker-0.1``,
``worker-0.2``...) takes its place. The runtime starts the workers; this module only
keeps which worker fills which slot and answers what the slots say about themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from states.restart_policy import RestartPolicy, RestartTracker

from .model_worker import ModelWorker

__all__ = ["WorkerSlot", "WorkerSlots"]


@attrs.define(eq=False)
class WorkerSlot:
    """One configured worker place: its GPUs, its restart history, the worker filling it now."""

    name: str
    gpu_ids: tuple[int, ...]
    tracker: RestartTracker
    worker: ModelWorker | None = None
    replaced: ModelWorker | None = None  # the failed worker the current one replaced: still shown, as history
    generation: int = 0

    def next_worker_id(self) -> str:
        """The id of the slot's next worker: ``worker-0``, then ``worker-0.1``, ``worker-0.2``..."""
        worker_id = self.name if self.generation == 0 else f"{self.name}.{self.generation}"
        self.generation += 1
        return worker_id


class WorkerSlots:
    """Every slot by name, and which slot each worker (current or past) was started in."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._by_name: dict[str, WorkerSlot] = {}
        self._by_worker: dict[str, WorkerSlot] = {}

    def add(self, name: str, gpu_ids: tuple[int, ...]) -> WorkerSlot:
        slot = self._by_name[name] = WorkerSlot(name, tuple(gpu_ids), RestartTracker(self.policy))
        return slot

    def fill(self, slot: WorkerSlot, worker: ModelWorker) -> ModelWorker | None:
        """``worker`` now fills ``slot`` (replacing a failed one). Returns the worker to forget: a slot keeps its
        current worker and the last one it replaced, and no older one, so what the server holds and shows of
        past workers stays bounded however often a slot restarts."""
        forgotten, slot.replaced, slot.worker = slot.replaced, slot.worker, worker
        self._by_worker[worker.worker_id] = slot
        if forgotten is not None:
            self._by_worker.pop(forgotten.worker_id, None)
        return forgotten

    def holding(self, worker: Any) -> WorkerSlot | None:
        """The slot ``worker`` fills now; None for a replaced worker or one no slot started (an agent)."""
        slot = self._by_worker.get(worker.worker_id)
        return slot if slot is not None and slot.worker is worker else None

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(self._by_name.values())

    def stop(self) -> None:
        """The server stops: no slot restarts its worker any more."""
        for slot in self:
            slot.tracker.stop()

    @property
    def restarts(self) -> int:
        return sum(slot.tracker.restarts for slot in self)

    def retry_after(self, now: float) -> float | None:
        """Seconds until the next worker restart is due, or None when none is coming."""
        waits = [wait for slot in self if (wait := slot.tracker.retry_after(now)) is not None]
        return min(waits, default=None)

    def status(self, now: float) -> dict[str, dict[str, Any]]:
        """Per slot: the current worker, its restarts, when not running why, and the failed worker it replaced (not
        counted among health's workers: the slot's place is its current worker's)."""
        return {
            slot.name: {
                "worker_id": None if slot.worker is None else slot.worker.worker_id,
                "restarts": slot.tracker.restarts,
                "state": slot.tracker.state.value,
                # a running worker whose service says it failed, before the worker fails with it: its words
                "reason": slot.tracker.describe(now) or (None if slot.worker is None else slot.worker.said_failing),
                "replaced": None if slot.replaced is None else {"worker_id": slot.replaced.worker_id,
                                                                 "failure": slot.replaced.failure},
            }
            for slot in self
        }
