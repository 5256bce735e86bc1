"""The static description of a streaming pipeline, validated when it is built.

A :class:`PipelineSpec` is a DAG of stages joined by typed artifacts. Every
mistake in it is a ``ValueError`` raised at construction that names the stage,
edge, artifact or group at fault, so a broken graph never reaches a session.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

import attrs

from .errors import shown

__all__ = [
    "StageOrdering",
    "StageSpec",
    "EdgeSpec",
    "ResourceGroupSpec",
    "PipelineSpec",
]


class StageOrdering(enum.Enum):
    """How a stage takes a session's sequence ids.

    ``PER_SESSION_STRICT`` takes them one at a time in order (the stage mutates
    per-session state); ``NONE`` takes any ready sequence id, possibly several
    at once.
    """

    NONE = "none"
    PER_SESSION_STRICT = "per_session_strict"


def _names(value: Iterable[str], _instance: object, field: attrs.Attribute) -> frozenset[str]:
    """A set of artifact names from one name or an iterable of them (each checked later, by name)."""
    if isinstance(value, str):
        # a bare string would silently become a set of characters
        return frozenset([value])
    try:
        return frozenset(value)
    except TypeError:  # not iterable (None, 5), or an unhashable item (a list in the list)
        raise ValueError(
            f"{field.name} must be an artifact name or an iterable of names, got {type(value).__name__} {shown(value)}"
        ) from None


def _items(value: Iterable[object], _instance: object, field: attrs.Attribute) -> tuple:
    """A tuple of a spec's parts (each checked later, by kind)."""
    try:
        return tuple(value)
    except TypeError:  # not iterable
        raise ValueError(f"{field.name} must be an iterable, got {type(value).__name__} {shown(value)}") from None


_NAMES = attrs.Converter(_names, takes_self=True, takes_field=True)
_ITEMS = attrs.Converter(_items, takes_self=True, takes_field=True)


def _require_count(what: str, value: object) -> None:
    """A limit or capacity: an int >= 1 (not a bool, a float or a string, which would compare or round oddly)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")


def _require_all(what: str, items: tuple, kind: type) -> None:
    for index, item in enumerate(items):
        if not isinstance(item, kind):
            raise ValueError(f"{what}[{index}] must be a {kind.__name__} value, got {type(item).__name__} {item!r}")


def _require_name(what: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")


@attrs.frozen
class StageSpec:
    """One logical stage: what it consumes, what it produces, and its limits."""

    stage_id: str
    consumes: frozenset[str] = attrs.field(converter=_NAMES)
    produces: frozenset[str] = attrs.field(converter=_NAMES)
    ordering: StageOrdering = StageOrdering.PER_SESSION_STRICT
    max_in_flight_per_session: int = 1
    max_in_flight_global: int = 1
    resource_group: str | None = None

    def __attrs_post_init__(self) -> None:
        _require_name("stage_id", self.stage_id)
        where = f"stage {self.stage_id!r}"
        if not self.consumes:
            raise ValueError(f"{where} must consume at least one artifact")
        if not self.produces:
            raise ValueError(f"{where} must produce at least one artifact")
        for artifact in self.consumes | self.produces:
            _require_name(f"{where}: artifact name", artifact)
        both = self.consumes & self.produces
        if both:
            raise ValueError(f"{where} both consumes and produces {sorted(both)}")
        if not isinstance(self.ordering, StageOrdering):
            raise ValueError(f"{where}: ordering must be a StageOrdering, got {self.ordering!r}")
        if self.resource_group is not None:
            _require_name(f"{where}: resource_group", self.resource_group)
        _require_count(f"{where}: max_in_flight_per_session", self.max_in_flight_per_session)
        _require_count(f"{where}: max_in_flight_global", self.max_in_flight_global)
        if self.max_in_flight_per_session > self.max_in_flight_global:
            raise ValueError(
                f"{where}: max_in_flight_per_session ({self.max_in_flight_per_session}) "
                f"exceeds max_in_flight_global ({self.max_in_flight_global})"
            )
        if (
            self.ordering is StageOrdering.PER_SESSION_STRICT
            and self.max_in_flight_per_session != 1
        ):
            raise ValueError(
                f"{where}: a per_session_strict stage runs one sequence at a time, "
                f"so max_in_flight_per_session must be 1"
            )


@attrs.frozen
class EdgeSpec:
    """A bounded path for one artifact into one stage (``source_stage=None``: ingress)."""

    artifact: str
    target_stage: str
    source_stage: str | None = None
    capacity_per_session: int = 1

    def __attrs_post_init__(self) -> None:
        _require_name("edge artifact", self.artifact)
        _require_name(f"edge {self.artifact!r}: target_stage", self.target_stage)
        if self.source_stage is not None:
            _require_name(f"edge {self.artifact!r}: source_stage", self.source_stage)
        _require_count(f"edge {self.describe()}: capacity_per_session", self.capacity_per_session)

    def describe(self) -> str:
        return f"{self.artifact}: {self.source_stage or 'ingress'} -> {self.target_stage}"


@attrs.frozen
class ResourceGroupSpec:
    """An explicit, declared limit shared by the stages that name it."""

    name: str
    max_concurrency: int = 1

    def __attrs_post_init__(self) -> None:
        _require_name("resource group name", self.name)
        _require_count(f"resource group {self.name!r}: max_concurrency", self.max_concurrency)


@attrs.frozen
class PipelineSpec:
    """The whole graph. Derived views (producers, topological order) are computed once."""

    stages: tuple[StageSpec, ...] = attrs.field(converter=_ITEMS)
    edges: tuple[EdgeSpec, ...] = attrs.field(converter=_ITEMS)
    output_artifacts: frozenset[str] = attrs.field(converter=_NAMES, default=frozenset())
    output_capacity_per_session: int = 1
    resource_groups: tuple[ResourceGroupSpec, ...] = attrs.field(converter=_ITEMS, default=())
    latency_anchor_artifact: str | None = None

    # derived, filled by validation
    topological_order: tuple[str, ...] = attrs.field(init=False, eq=False, repr=False)
    producers: Mapping[str, str] = attrs.field(init=False, eq=False, repr=False)
    ingress_artifacts: frozenset[str] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        _require_all("stages", self.stages, StageSpec)
        _require_all("edges", self.edges, EdgeSpec)
        _require_all("resource_groups", self.resource_groups, ResourceGroupSpec)
        _require_count("output_capacity_per_session", self.output_capacity_per_session)
        if self.latency_anchor_artifact is not None:
            _require_name("latency_anchor_artifact", self.latency_anchor_artifact)
        stages = self._check_stages()
        producers = self._check_producers()
        self._check_outputs(producers)  # before the edges: a misspelled output is named, not its producer's artifact
        self._check_edges(stages, producers)
        ingress = frozenset(e.artifact for e in self.edges if e.source_stage is None)
        if self.latency_anchor_artifact is not None and self.latency_anchor_artifact not in ingress:
            raise ValueError(
                f"latency_anchor_artifact {self.latency_anchor_artifact!r} "
                f"is not an ingress artifact (ingress: {sorted(ingress)})"
            )
        order = self._topological_order()
        self._check_reachable(ingress, order)
        object.__setattr__(self, "topological_order", order)
        object.__setattr__(self, "producers", producers)
        object.__setattr__(self, "ingress_artifacts", ingress)

    # -- validation steps ---------------------------------------------------

    def _check_stages(self) -> dict[str, StageSpec]:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")
        groups: set[str] = set()
        for group in self.resource_groups:
            if group.name in groups:
                raise ValueError(f"resource group {group.name!r} is declared twice")
            groups.add(group.name)
        stages: dict[str, StageSpec] = {}
        for stage in self.stages:
            if stage.stage_id in stages:
                raise ValueError(f"stage {stage.stage_id!r} is declared twice")
            if stage.resource_group is not None and stage.resource_group not in groups:
                raise ValueError(
                    f"stage {stage.stage_id!r} names resource group {stage.resource_group!r}, "
                    f"which is not declared (declared: {sorted(groups)})"
                )
            stages[stage.stage_id] = stage
        return stages

    def _check_producers(self) -> dict[str, str]:
        producers: dict[str, str] = {}
        for stage in self.stages:
            for artifact in stage.produces:
                if artifact in producers:
                    raise ValueError(
                        f"artifact {artifact!r} has multiple producers: "
                        f"stages {producers[artifact]!r} and {stage.stage_id!r}"
                    )
                producers[artifact] = stage.stage_id
        return producers

    def _check_edges(self, stages: Mapping[str, StageSpec], producers: Mapping[str, str]) -> None:
        seen: set[tuple[str, str | None, str]] = set()
        fed: set[tuple[str, str]] = set()
        leaving: set[str] = set()
        for edge in self.edges:
            key = (edge.artifact, edge.source_stage, edge.target_stage)
            if key in seen:
                raise ValueError(f"edge {edge.describe()} is declared twice")
            seen.add(key)
            target = stages.get(edge.target_stage)
            if target is None:
                raise ValueError(f"edge {edge.describe()}: target stage {edge.target_stage!r} does not exist")
            if edge.artifact not in target.consumes:
                raise ValueError(
                    f"edge {edge.describe()}: stage {edge.target_stage!r} does not consume {edge.artifact!r}"
                )
            producer = producers.get(edge.artifact)
            if edge.source_stage is None:
                if producer is not None:
                    raise ValueError(
                        f"edge {edge.describe()}: {edge.artifact!r} is produced by stage "
                        f"{producer!r}, so it cannot also be external ingress"
                    )
            else:
                if edge.source_stage not in stages:
                    raise ValueError(f"edge {edge.describe()}: source stage {edge.source_stage!r} does not exist")
                if producer != edge.source_stage:
                    raise ValueError(
                        f"edge {edge.describe()}: stage {edge.source_stage!r} does not produce "
                        f"{edge.artifact!r}"
                    )
                leaving.add(edge.artifact)
            fed.add((edge.target_stage, edge.artifact))
        for stage in self.stages:
            for artifact in sorted(stage.consumes):
                if (stage.stage_id, artifact) not in fed:
                    raise ValueError(
                        f"stage {stage.stage_id!r} consumes an unconnected artifact {artifact!r} "
                        f"(no edge feeds it)"
                    )
            for artifact in sorted(stage.produces):
                if artifact not in leaving and artifact not in self.output_artifacts:
                    raise ValueError(
                        f"stage {stage.stage_id!r} produces an unconnected artifact {artifact!r} "
                        f"(no edge leaves it and it is not an output)"
                    )

    def _check_outputs(self, producers: Mapping[str, str]) -> None:
        for artifact in sorted(self.output_artifacts):
            if artifact not in producers:
                raise ValueError(f"output artifact {artifact!r} is not produced by any stage")

    def _topological_order(self) -> tuple[str, ...]:
        """Kahn's algorithm; ties keep declaration order so the result is stable."""
        upstream: dict[str, set[str]] = {s.stage_id: set() for s in self.stages}
        for edge in self.edges:
            if edge.source_stage is not None:
                upstream[edge.target_stage].add(edge.source_stage)
        order: list[str] = []
        remaining = [s.stage_id for s in self.stages]
        while remaining:
            ready = [s for s in remaining if upstream[s] <= set(order)]
            if not ready:
                raise ValueError(f"the stage graph contains a cycle among stages {remaining}")
            order.append(ready[0])
            remaining.remove(ready[0])
        return tuple(order)

    def _check_reachable(self, ingress: frozenset[str], order: tuple[str, ...]) -> None:
        by_id = {s.stage_id: s for s in self.stages}
        available = set(ingress)
        for stage_id in order:
            stage = by_id[stage_id]
            if stage.consumes <= available:
                available |= stage.produces
        unreachable = sorted(self.output_artifacts - available)
        if unreachable:
            raise ValueError(f"Unreachable output artifacts {unreachable}: no ingress leads to them")

    # -- queries used by the orchestrator -----------------------------------

    def stage(self, stage_id: str) -> StageSpec:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(f"unknown stage {stage_id!r}")

    def edges_from(self, artifact: str) -> tuple[EdgeSpec, ...]:
        """Every edge carrying ``artifact`` (for ingress or its producer)."""
        return tuple(e for e in self.edges if e.artifact == artifact)

    def resource_group(self, name: str) -> ResourceGroupSpec:
        for group in self.resource_groups:
            if group.name == name:
                return group
        raise KeyError(f"unknown resource group {name!r}")
