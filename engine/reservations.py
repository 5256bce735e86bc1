"""Reservations: every take of scheduler capacity paired with its one release.

Admitting an invocation takes, at once, a place in the stage's per-session and
global in-flight limits, in its resource group, and room on every edge its
result will need. All of that is one :class:`Reservation` value. The room a
session's in-flight work reserves on an artifact's edges is its producer stage's
in-flight count (every call of a stage makes each of its artifacts once), so
that one count serves both. Only
:class:`UsageBook` changes the counts, in ``take`` and ``release``, so a count
cannot drift; releasing a reservation that is not held is refused, and the
slot-leak check asks what is still held rather than trusting a counter.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

from .actors import TaskKey
from .spec import StageSpec

__all__ = ["Reservation", "SessionReservations", "UsageBook"]


class Reservation(NamedTuple):
    """What one admitted invocation holds until its result is accepted or dropped.

    Made for every admission, so a named tuple (immutable, one allocation); only
    :class:`UsageBook` makes one.
    """

    key: TaskKey
    stage_id: str
    resource_group: str | None
    slot: tuple[str, int]  # (stage, sequence): its place in the session's reservations
    timing: Any  # the (stage, sequence) timing record its completion stamps

    def __repr__(self) -> str:
        return f"Reservation({self.key!r})"


_new_reservation = functools.partial(tuple.__new__, Reservation)  # (a named tuple's __new__ is Python code)


class SessionReservations:
    """The reservations one session holds; read by the scheduler, changed only by the book."""

    __slots__ = ("held", "by_stage")

    def __init__(self) -> None:
        self.held: dict[tuple[str, int], Reservation] = {}  # (stage, seq) -> reservation
        self.by_stage: dict[str, int] = {}  # also the room reserved on the stage's outgoing edges

    def __bool__(self) -> bool:
        return bool(self.held)

    def __len__(self) -> int:
        return len(self.held)

    def get(self, stage_id: str, seq: int) -> Reservation | None:
        return self.held.get((stage_id, seq))

    def sequences(self) -> Iterable[int]:
        return (seq for _, seq in self.held)

    def drift(self) -> int:
        """Counts that disagree with the reservations held (0 unless the book is broken)."""
        by_stage: Counter[str] = Counter(r.stage_id for r in self.held.values())
        return sum(1 for k in by_stage.keys() | self.by_stage.keys() if by_stage[k] != self.by_stage.get(k, 0))


class UsageBook:
    """The global in-flight counts (per stage, per resource group), beside every session's own."""

    def __init__(self, stage_ids: Iterable[str], group_names: Iterable[str]) -> None:
        self.by_stage: dict[str, int] = {s: 0 for s in stage_ids}
        self.by_group: dict[str, int] = {g: 0 for g in group_names}

    def take(self, session: SessionReservations, stage: StageSpec, key: TaskKey, timing: Any) -> Reservation:
        stage_id = stage.stage_id
        slot = (stage_id, key.sequence_id)
        held = session.held
        if slot in held:
            raise RuntimeError(f"stage {stage_id!r} already holds sequence {key.sequence_id} of {key.session_id!r}")
        group = stage.resource_group
        reservation = held[slot] = _new_reservation((key, stage_id, group, slot, timing))
        by_stage = session.by_stage
        by_stage[stage_id] = by_stage.get(stage_id, 0) + 1
        self.by_stage[stage_id] += 1
        if group is not None:
            self.by_group[group] += 1
        return reservation

    def release(self, session: SessionReservations, reservation: Reservation) -> None:
        held = session.held
        if held.get(reservation.slot) is not reservation:
            raise RuntimeError(f"{reservation.key} is not held; a reservation is released once")
        del held[reservation.slot]
        stage_id = reservation.stage_id
        session.by_stage[stage_id] -= 1
        self.by_stage[stage_id] -= 1
        if reservation.resource_group is not None:
            self.by_group[reservation.resource_group] -= 1

    def drift(self, sessions: Iterable[SessionReservations]) -> int:
        """Global counts that disagree with every session's reservations (0 unless broken)."""
        by_stage: Counter[str] = Counter()
        by_group: Counter[str] = Counter()
        for session in sessions:
            for r in session.held.values():
                by_stage[r.stage_id] += 1
                if r.resource_group is not None:
                    by_group[r.resource_group] += 1
        return sum(1 for s, n in self.by_stage.items() if by_stage[s] != n) + sum(
            1 for g, n in self.by_group.items() if by_group[g] != n
        )
