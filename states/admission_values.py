"""What the admission book says back: answers, transitions, read-only views and typed errors.

Kept apart from the placement rules in :mod:`states.admission` so that the HTTP
layer and the runtime can name these values (and filter transitions with
:func:`admitted_ids`) without reading the book; ``states.admission`` re-exports
every name here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Union

import attrs

from .worker import Event as WorkerEvent, State as WorkerState

__all__ = [
    "Admission",
    "AdmissionStatus",
    "AdmissionTransition",
    "WorkerTransition",
    "Transition",
    "TransitionKind",
    "WorkerView",
    "AdmissionSnapshot",
    "InvalidSetting",
    "DuplicateAdmissionSession",
    "DuplicateWorker",
    "UnknownAdmissionSession",
    "UnknownWorker",
    "admitted_ids",
]

AdmissionStatus = Literal["assigned", "queued", "rejected"]
TransitionKind = Literal["assigned", "queued", "rejected", "released", "dequeued", "promoted", "requeued"]


# --- errors -----------------------------------------------------------------


class InvalidSetting(ValueError):
    """A value the book cannot accept; ``field`` names it."""

    def __init__(self, field: str, value: object, why: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {why}")


class DuplicateAdmissionSession(ValueError):
    """The session is already queued or assigned; admitting it twice would hold two slots."""

    def __init__(self, session_id: str, where: str) -> None:
        self.session_id = session_id
        super().__init__(f"session {session_id!r} is already {where}")


class DuplicateWorker(ValueError):
    """A worker id is taken (even by a failed or stopped worker: ids are never reused)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id!r} already exists")


class UnknownAdmissionSession(KeyError):
    """The session is neither queued nor assigned (never admitted, rejected or released)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(session_id)

    def __str__(self) -> str:
        return f"session {self.session_id!r} is neither queued nor assigned"


class UnknownWorker(KeyError):
    """No worker has this id."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        super().__init__(worker_id)

    def __str__(self) -> str:
        return f"no worker {self.worker_id!r}"


# --- results ----------------------------------------------------------------


@attrs.frozen
class Admission:
    """The answer to one ``admit``: what the HTTP layer tells the client."""

    status: AdmissionStatus
    session_id: str
    worker_id: str | None = None
    queue_position: int | None = None
    reason: str | None = None


@attrs.frozen
class AdmissionTransition:
    """One session moved.

    ``queue_position`` is the place the session got (``queued``) or held when
    it left the queue (``dequeued``, ``promoted``); ``queued_at`` is when it
    joined the queue, so a consumer can measure queue wait on promotion.
    """

    session_id: str
    kind: TransitionKind
    worker_id: str | None
    queue_position: int | None
    at: float
    queued_at: float | None = None


@attrs.frozen
class WorkerTransition:
    """One event applied to a worker's machine (``kind`` is always ``"worker"``)."""

    worker_id: str
    event: WorkerEvent
    state: WorkerState
    at: float
    kind: Literal["worker"] = "worker"


Transition = Union[AdmissionTransition, WorkerTransition]


@attrs.frozen
class WorkerView:
    """A read-only picture of one worker (for metrics and health)."""

    worker_id: str
    state: WorkerState
    capacity: int
    session_ids: tuple[str, ...]

    @property
    def retained(self) -> int:
        return len(self.session_ids)


@attrs.frozen
class AdmissionSnapshot:
    """Counts for health and metrics; worker counts are by machine state."""

    workers_total: int
    workers_starting: int
    workers_idle: int
    workers_busy: int
    workers_draining: int
    workers_failed: int
    workers_stopped: int
    queued: int
    retained: int
    free_slots: int  # room on eligible workers (0 whenever anyone is queued)


def admitted_ids(transitions: Iterable[Transition]) -> list[tuple[str, str]]:
    """``(session_id, worker_id)`` for every session that got a slot in ``transitions``."""
    return [
        (t.session_id, t.worker_id)  # type: ignore[misc]
        for t in transitions
        if isinstance(t, AdmissionTransition) and t.kind in ("assigned", "promoted")
    ]
