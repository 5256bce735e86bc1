"""Why ready work is held back: a typed value named from the spec.

The scheduler records one :class:`Blocker` per (stage, sequence) that had its
inputs but could not be admitted. Its text form (``edge_capacity:latent->decode``)
is what idle intervals report; code asks its ``kind`` and fields, never the text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from .spec import StageOrdering

if TYPE_CHECKING:
    from .graph import StageGraph
    from .reservations import UsageBook
    from .runtime import SessionRuntime
    from .spec import StageSpec

__all__ = ["Blocker", "BlockerKind", "first_blocker"]


class BlockerKind(enum.Enum):
    STAGE_CAPACITY = "stage_capacity"  # the session's in-flight limit of the stage
    GLOBAL_CAPACITY = "global_capacity"  # the stage's in-flight limit across sessions
    RESOURCE_GROUP = "resource_group"  # the stage's resource group is at its concurrency
    EDGE_CAPACITY = "edge_capacity"  # an outgoing edge has no room for the result
    OUTPUT_CAPACITY = "output_capacity"  # the session's output queue has no room
    ACTOR_BUSY = "actor_busy"  # the actor's mailbox refused the invocation


@attrs.frozen
class Blocker:
    kind: BlockerKind
    resource_group: str | None = None
    artifact: str | None = None
    target_stage: str | None = None

    @classmethod
    def edge(cls, artifact: str, target_stage: str) -> Blocker:
        return cls(BlockerKind.EDGE_CAPACITY, artifact=artifact, target_stage=target_stage)

    @classmethod
    def output(cls, artifact: str) -> Blocker:
        return cls(BlockerKind.OUTPUT_CAPACITY, artifact=artifact)

    @classmethod
    def group(cls, name: str) -> Blocker:
        return cls(BlockerKind.RESOURCE_GROUP, resource_group=name)

    @property
    def waits_on_own_downstream(self) -> bool:
        """Room can only come from this session's own downstream stages running.

        A draining session with nothing in flight can never clear such a
        blocker; the output queue (a reader may poll) and the shared limits
        (other sessions finish) can still clear.
        """
        return self.kind is BlockerKind.EDGE_CAPACITY

    def __str__(self) -> str:
        if self.kind is BlockerKind.RESOURCE_GROUP:
            return f"resource_group:{self.resource_group}"
        if self.kind is BlockerKind.EDGE_CAPACITY:
            return f"edge_capacity:{self.artifact}->{self.target_stage}"
        if self.kind is BlockerKind.OUTPUT_CAPACITY:
            return f"output_capacity:{self.artifact}"
        return self.kind.value


STAGE_CAPACITY = Blocker(BlockerKind.STAGE_CAPACITY)
GLOBAL_CAPACITY = Blocker(BlockerKind.GLOBAL_CAPACITY)
ACTOR_BUSY = Blocker(BlockerKind.ACTOR_BUSY)
_ANY_ORDER = StageOrdering.NONE


def first_blocker(
    graph: StageGraph, usage: UsageBook, group_limit: Mapping[str, int], rt: SessionRuntime, stage: StageSpec
) -> Blocker | None:
    """The first limit that keeps ``stage`` from admitting the session's next item now (None: none does).

    In-flight work reserves room downstream: an edge or the output queue counts
    the results still being made for it. A stage that may take sequences out of
    order (``NONE``) takes one ahead of its lowest untaken sequence only while a
    place stays free on every edge and the output queue: the lower one, when it
    comes, always has room. (Taking the last place, a later sequence's result
    could wait there for good for an earlier one that a strict stage, or the
    in-order output queue, needs first.)
    """
    stage_id = stage.stage_id
    in_flight = rt.reservations.by_stage.get(stage_id, 0)  # also the room it reserves on its edges
    if in_flight >= stage.max_in_flight_per_session:
        return STAGE_CAPACITY
    if usage.by_stage[stage_id] >= stage.max_in_flight_global:
        return GLOBAL_CAPACITY
    group = stage.resource_group
    if group is not None and usage.by_group[group] >= group_limit[group]:
        return Blocker.group(group)
    taken = in_flight
    if stage.ordering is _ANY_ORDER:
        lane = rt.lanes[stage_id]
        if lane.ready and min(lane.ready) > lane.taken.below:  # ahead: one place stays for the lower sequence
            taken += 1
    occupancy = rt.occupancy
    for artifact, edge, limit, blocker in graph.room_limits[stage_id]:
        if edge is not None:
            if occupancy.get(edge, 0) + taken >= limit:  # a plain get: Counter's missing-key hook is Python
                return blocker
        else:
            pending = rt.pending_outputs  # outputs made, waiting for an earlier sequence's
            queued = len(rt.outputs) + (sum(1 for v in pending.values() if artifact in v) if pending else 0)
            if queued + taken >= limit:
                return blocker
    return None
