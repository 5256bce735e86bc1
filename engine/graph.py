"""The scheduler's lookup tables, derived once from a validated spec.

Every admission and completion asks these (who consumes an artifact, an edge's
capacity, which stages an event can make admissible) in O(1), so the hot path
never walks the spec.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .blockers import Blocker
from .spec import PipelineSpec, StageSpec

__all__ = ["StageGraph"]


@attrs.frozen
class StageGraph:
    spec: PipelineSpec
    stages: dict[str, StageSpec]
    stage_ids: tuple[str, ...]
    topological_order: tuple[str, ...]
    consumes: dict[str, frozenset[str]]
    consumes_sorted: dict[str, tuple[str, ...]]
    targets: dict[str, tuple[str, ...]]  # artifact -> stages consuming it
    capacity: dict[tuple[str, str], int]  # (artifact, target) -> per-session edge capacity
    scan_order: tuple[StageSpec, ...]  # downstream first: finishing work frees room upstream
    outputs: frozenset[str]
    output_capacity: int
    ingress: frozenset[str]
    # Stage sets the scheduler's pump marks for a look are bit masks (one bit per stage, the
    # lowest the most downstream): an event ORs its mask in, the pump clears a bit as it looks.
    bit: dict[str, int]  # stage -> its bit
    all_stages: int  # every stage's bit
    at_bit: dict[int, StageSpec]  # bit -> its stage; the lower the bit, the further downstream
    upstream: dict[str, int]  # stage -> producers of its inputs (admitting it frees their room)
    after_completion: dict[str, int]  # stage -> stages its completion may unblock
    consumers_of: dict[str, int]  # artifact -> stages that consume it
    output_producers: int
    # stage -> (artifact, edge or None for the output queue, capacity, the blocker it names), in
    # the order admission checks them; built once so the check allocates nothing per admission
    room_limits: dict[str, tuple[tuple[str, tuple[str, str] | None, int, Blocker], ...]]
    ingress_consumers: frozenset[str]  # stages that take an ingress artifact (admitting one frees pushers' room)
    # ingress artifact -> (target stage, edge, capacity) of each edge it feeds: what every push checks
    ingress_edges: dict[str, tuple[tuple[str, tuple[str, str], int], ...]]

    @classmethod
    def from_spec(cls, spec: PipelineSpec) -> StageGraph:
        stages = {s.stage_id: s for s in spec.stages}
        targets: dict[str, tuple[str, ...]] = {}
        capacity: dict[tuple[str, str], int] = {}
        for edge in spec.edges:
            targets[edge.artifact] = targets.get(edge.artifact, ()) + (edge.target_stage,)
            capacity[(edge.artifact, edge.target_stage)] = edge.capacity_per_session
        order = tuple(stages[s] for s in reversed(spec.topological_order))
        bit = {stage.stage_id: 1 << index for index, stage in enumerate(order)}

        def mask(stage_ids: object) -> int:
            return sum(bit[s] for s in set(stage_ids))  # type: ignore[call-overload]

        groups = {s.resource_group for s in spec.stages if s.resource_group is not None}
        peers = {g: frozenset(s.stage_id for s in spec.stages if s.resource_group == g) for g in groups}
        after_completion = {
            s.stage_id: mask(
                {s.stage_id}
                | {t for a in s.produces for t in targets.get(a, ())}
                | (peers[s.resource_group] if s.resource_group is not None else frozenset())
            )
            for s in spec.stages
        }
        return cls(
            spec=spec,
            stages=stages,
            stage_ids=tuple(stages),
            topological_order=spec.topological_order,
            consumes={s.stage_id: s.consumes for s in spec.stages},
            consumes_sorted={s.stage_id: tuple(sorted(s.consumes)) for s in spec.stages},
            targets=targets,
            capacity=capacity,
            scan_order=order,
            outputs=spec.output_artifacts,
            output_capacity=spec.output_capacity_per_session,
            ingress=spec.ingress_artifacts,
            bit=bit,
            all_stages=mask(stages),
            at_bit={bit[stage.stage_id]: stage for stage in order},
            upstream={s.stage_id: mask(spec.producers[a] for a in s.consumes if a in spec.producers) for s in spec.stages},
            after_completion=after_completion,
            consumers_of={artifact: mask(stage_ids) for artifact, stage_ids in targets.items()},
            output_producers=mask(spec.producers[a] for a in spec.output_artifacts),
            room_limits={s.stage_id: _room_limits(s, targets, capacity, spec) for s in spec.stages},
            ingress_consumers=frozenset(s.stage_id for s in spec.stages if s.consumes & spec.ingress_artifacts),
            ingress_edges={
                a: tuple((t, (a, t), capacity[(a, t)]) for t in targets.get(a, ())) for a in spec.ingress_artifacts
            },
        )

    def sharing(self, owners: Mapping[str, object]) -> dict[str, int]:
        """stage -> the other stages whose owner (in ``owners``, e.g. their actors) is the same object (bit mask)."""
        return {
            stage_id: sum(self.bit[other] for other, owner in owners.items()
                          if owner is owners[stage_id] and other != stage_id)
            for stage_id in self.stage_ids
        }

    def consumers(self, artifacts: object) -> set[str]:
        """Every stage that consumes one of ``artifacts``."""
        return {target for artifact in artifacts for target in self.targets.get(artifact, ())}  # type: ignore[attr-defined]


def _room_limits(
    stage: StageSpec, targets: dict[str, tuple[str, ...]], capacity: dict[tuple[str, str], int], spec: PipelineSpec
) -> tuple[tuple[str, tuple[str, str] | None, int, Blocker], ...]:
    limits: list[tuple[str, tuple[str, str] | None, int, Blocker]] = []
    for artifact in stage.produces:
        for target in targets.get(artifact, ()):
            limits.append((artifact, (artifact, target), capacity[(artifact, target)], Blocker.edge(artifact, target)))
        if artifact in spec.output_artifacts:
            limits.append((artifact, None, spec.output_capacity_per_session, Blocker.output(artifact)))
    return tuple(limits)
