"""What the launchers that start agents into named slots (local, ray) share: the authority's notices about them.

Each slot is one agent the launcher keeps running, restarted by its slot's backoff; the authority tells the
launcher when a worker registers from a slot, is lost, or leaves (it drained, and exits 0: its slot stays down).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .remote import RemoteWorker

__all__ = ["SlotLauncher"]


class SlotLauncher:
    """A launcher's slots (each with ``name``, ``worker_id``, ``restarts``, ``drained``, ``settled``), found by the
    workers registered from them."""

    name: ClassVar[str]
    slots: list[Any]

    def slot_of(self, worker: RemoteWorker) -> Any | None:
        """The slot ``worker`` registered from, if this launcher started it (an external agent has none)."""
        if worker.launcher != self.name:
            return None
        return next((slot for slot in self.slots if slot.name == worker.slot), None)

    def worker_left(self, worker: RemoteWorker) -> None:
        slot = self.slot_of(worker)
        if slot is not None and slot.worker_id == worker.worker_id:
            slot.worker_id = None
            slot.drained = True  # it drained and exits 0: the slot stays down
            slot.settled.set()

    def starts_more(self) -> bool:
        """Whether any slot will still start an agent (not every one gave up)."""
        return any(not slot.restarts.ended for slot in self.slots)
