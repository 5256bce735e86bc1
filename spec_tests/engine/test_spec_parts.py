"""StageSpec, ResourceGroupSpec and EdgeSpec validation (reference A.2 post-init rules).

Every broken part is a ``ValueError`` raised at construction whose message names
the stage, edge, artifact or group at fault; every test asserts on that name.
"""

from __future__ import annotations

import pytest

from engine.spec import EdgeSpec, ResourceGroupSpec, StageOrdering

from .spec_helpers import edge, ingress, raises_naming, stage


# -- StageSpec post-init rules -------------------------------------------------


def test_empty_stage_id_is_rejected() -> None:
    with raises_naming("stage_id"):
        stage("", "a", "b")


def test_non_string_stage_id_is_rejected() -> None:
    with raises_naming("stage_id"):
        stage(None, "a", "b")  # type: ignore[arg-type]


def test_stage_without_consumes_is_rejected() -> None:
    with raises_naming("'lonely'", "consume"):
        stage("lonely", (), "b")


def test_stage_without_produces_is_rejected() -> None:
    with raises_naming("'sink'", "produce"):
        stage("sink", "a", ())


def test_empty_artifact_name_is_rejected() -> None:
    with raises_naming("'encode'", "artifact name"):
        stage("encode", {"frame", ""}, "latent")


def test_consumes_and_produces_overlap_is_rejected() -> None:
    with raises_naming("'loop'", "'state'"):
        stage("loop", {"frame", "state"}, {"state", "out"})


def test_max_in_flight_per_session_below_one_is_rejected() -> None:
    with raises_naming("'encode'", "max_in_flight_per_session"):
        stage("encode", "a", "b", ordering=StageOrdering.NONE, max_in_flight_per_session=0)


def test_max_in_flight_global_below_one_is_rejected() -> None:
    with raises_naming("'encode'", "max_in_flight_global"):
        stage("encode", "a", "b", ordering=StageOrdering.NONE, max_in_flight_global=0)


def test_per_session_limit_above_global_limit_is_rejected() -> None:
    with raises_naming("'encode'", "max_in_flight_per_session", "max_in_flight_global"):
        stage(
            "encode",
            "a",
            "b",
            ordering=StageOrdering.NONE,
            max_in_flight_per_session=3,
            max_in_flight_global=2,
        )


def test_strict_stage_with_per_session_limit_other_than_one_is_rejected() -> None:
    with raises_naming("'denoise'", "per_session_strict"):
        stage(
            "denoise",
            "a",
            "b",
            ordering=StageOrdering.PER_SESSION_STRICT,
            max_in_flight_per_session=2,
            max_in_flight_global=4,
        )


def test_unordered_stage_may_run_several_sequences_per_session() -> None:
    spec = stage(
        "vae",
        "a",
        "b",
        ordering=StageOrdering.NONE,
        max_in_flight_per_session=2,
        max_in_flight_global=4,
    )
    assert (spec.max_in_flight_per_session, spec.max_in_flight_global) == (2, 4)


def test_ordering_must_be_a_stage_ordering() -> None:
    with raises_naming("'encode'", "ordering"):
        stage("encode", "a", "b", ordering="none")


def test_empty_resource_group_name_on_stage_is_rejected() -> None:
    with raises_naming("'encode'", "resource_group"):
        stage("encode", "a", "b", resource_group="")


def test_stage_defaults() -> None:
    spec = stage("encode", "a", "b")
    assert spec.ordering is StageOrdering.PER_SESSION_STRICT
    assert spec.max_in_flight_per_session == 1
    assert spec.max_in_flight_global == 1
    assert spec.resource_group is None


def test_stage_ordering_values() -> None:
    assert StageOrdering.NONE.value == "none"
    assert StageOrdering.PER_SESSION_STRICT.value == "per_session_strict"


def test_bare_string_consumes_becomes_one_element_set() -> None:
    spec = stage("encode", "frame", "latent")
    assert spec.consumes == frozenset({"frame"})
    assert spec.produces == frozenset({"latent"})
    assert isinstance(spec.consumes, frozenset)


def test_iterables_become_frozensets() -> None:
    spec = stage("encode", ["frame", "control", "frame"], ("latent",))
    assert spec.consumes == frozenset({"frame", "control"})
    assert isinstance(spec.produces, frozenset)


# -- ResourceGroupSpec / EdgeSpec post-init rules ---------------------------------


def test_resource_group_with_empty_name_is_rejected() -> None:
    with raises_naming("resource group name"):
        ResourceGroupSpec("")


def test_resource_group_with_concurrency_below_one_is_rejected() -> None:
    with raises_naming("'gpu'", "max_concurrency"):
        ResourceGroupSpec("gpu", max_concurrency=0)


def test_edge_with_empty_artifact_is_rejected() -> None:
    with raises_naming("edge artifact"):
        EdgeSpec("", target_stage="encode")


def test_edge_with_empty_target_is_rejected() -> None:
    with raises_naming("'frame'", "target_stage"):
        EdgeSpec("frame", target_stage="")


def test_edge_with_empty_source_is_rejected() -> None:
    with raises_naming("'latent'", "source_stage"):
        EdgeSpec("latent", target_stage="decode", source_stage="")


@pytest.mark.parametrize("capacity", [0, -1])
def test_edge_capacity_below_one_is_rejected(capacity: int) -> None:
    with raises_naming("latent: encode -> decode", "capacity_per_session"):
        edge("latent", "encode", "decode", capacity_per_session=capacity)


def test_ingress_edge_capacity_below_one_names_ingress() -> None:
    with raises_naming("frame: ingress -> encode"):
        ingress("frame", "encode", capacity_per_session=0)


def test_edge_describe() -> None:
    assert ingress("frame", "encode").describe() == "frame: ingress -> encode"
    assert edge("latent", "encode", "decode").describe() == "latent: encode -> decode"
