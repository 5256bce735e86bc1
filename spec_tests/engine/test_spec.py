"""PipelineSpec validation (reference A.4 graph rules) and its derived views; its parts: test_spec_parts.py.

Every broken spec is a ``ValueError`` raised at construction whose message
names the stage, edge, artifact or group at fault; every test asserts on that
name, not just on the exception type.
"""

from __future__ import annotations

import re

import attrs
import pytest

from engine.spec import (
    PipelineSpec,
    ResourceGroupSpec,
    StageSpec,
)

from .spec_helpers import chain_edges, chain_stages, edge, ingress, raises_naming, stage, valid_chain


# -- PipelineSpec construction rules (A.4) -----------------------------------------


def test_output_capacity_below_one_is_rejected() -> None:
    with raises_naming("output_capacity_per_session"):
        valid_chain(output_capacity_per_session=0)


def test_empty_latency_anchor_is_rejected() -> None:
    with raises_naming("latency_anchor_artifact"):
        valid_chain(latency_anchor_artifact="")


def test_pipeline_needs_a_stage() -> None:
    with raises_naming("at least one stage"):
        PipelineSpec((), ())


def test_duplicate_resource_group_is_rejected() -> None:
    with raises_naming("'gpu'", "declared twice"):
        PipelineSpec(
            chain_stages(),
            chain_edges(),
            output_artifacts={"video"},
            resource_groups=(ResourceGroupSpec("gpu"), ResourceGroupSpec("gpu", 2)),
        )


def test_undeclared_resource_group_is_rejected() -> None:
    stages = (
        stage("encode", "frame", "latent", resource_group="gpu"),
        stage("decode", "latent", "video"),
    )
    with raises_naming("'encode'", "'gpu'", "not declared"):
        PipelineSpec(
            stages,
            chain_edges(),
            output_artifacts={"video"},
            resource_groups=(ResourceGroupSpec("cpu"),),
        )


def test_declared_resource_group_is_accepted_and_found() -> None:
    stages = (
        stage("encode", "frame", "latent", resource_group="gpu"),
        stage("decode", "latent", "video", resource_group="gpu"),
    )
    spec = PipelineSpec(
        stages,
        chain_edges(),
        output_artifacts={"video"},
        resource_groups=(ResourceGroupSpec("gpu", 2),),
    )
    assert spec.resource_group("gpu") == ResourceGroupSpec("gpu", 2)
    with pytest.raises(KeyError, match="'cpu'"):
        spec.resource_group("cpu")


def test_duplicate_stage_is_rejected() -> None:
    stages = (*chain_stages(), stage("decode", "latent", "audio"))
    with raises_naming("'decode'", "declared twice"):
        PipelineSpec(stages, chain_edges(), output_artifacts={"video"})


def test_multiple_producers_are_rejected() -> None:
    stages = (
        stage("encode", "frame", "latent"),
        stage("encode2", "frame", "latent"),
        stage("decode", "latent", "video"),
    )
    edges = (
        ingress("frame", "encode"),
        ingress("frame", "encode2"),
        edge("latent", "encode", "decode"),
    )
    with raises_naming("'latent'", "multiple producers", "'encode'", "'encode2'"):
        PipelineSpec(stages, edges, output_artifacts={"video"})


def test_duplicate_edge_is_rejected() -> None:
    edges = (*chain_edges(), edge("latent", "encode", "decode", capacity_per_session=2))
    with raises_naming("latent: encode -> decode", "declared twice"):
        PipelineSpec(chain_stages(), edges, output_artifacts={"video"})


def test_duplicate_ingress_edge_is_rejected() -> None:
    edges = (*chain_edges(), ingress("frame", "encode"))
    with raises_naming("frame: ingress -> encode", "declared twice"):
        PipelineSpec(chain_stages(), edges, output_artifacts={"video"})


def test_edge_to_unknown_target_is_rejected() -> None:
    edges = (*chain_edges(), ingress("frame", "ghost"))
    with raises_naming("frame: ingress -> ghost", "'ghost'", "does not exist"):
        PipelineSpec(chain_stages(), edges, output_artifacts={"video"})


def test_edge_to_stage_not_consuming_artifact_is_rejected() -> None:
    stages = (
        stage("encode", {"frame"}, "latent"),
        stage("decode", "latent", "video"),
    )
    edges = (*chain_edges(), ingress("control", "encode"))
    with raises_naming("control: ingress -> encode", "'encode'", "does not consume", "'control'"):
        PipelineSpec(stages, edges, output_artifacts={"video"})


def test_ingress_edge_for_produced_artifact_is_rejected() -> None:
    edges = (*chain_edges(), ingress("latent", "decode"))
    with raises_naming("latent: ingress -> decode", "'latent'", "'encode'", "ingress"):
        PipelineSpec(chain_stages(), edges, output_artifacts={"video"})


def test_internal_edge_from_non_producer_is_rejected() -> None:
    stages = (
        stage("encode", "frame", "latent"),
        stage("prompt", "text", "embedding"),
        stage("decode", {"latent", "embedding"}, "video"),
    )
    edges = (
        ingress("frame", "encode"),
        ingress("text", "prompt"),
        edge("latent", "prompt", "decode"),  # prompt does not produce latent
        edge("embedding", "prompt", "decode"),
    )
    with raises_naming("latent: prompt -> decode", "'prompt'", "does not produce", "'latent'"):
        PipelineSpec(stages, edges, output_artifacts={"video"})


def test_internal_edge_from_unknown_source_is_rejected() -> None:
    edges = (ingress("frame", "encode"), edge("latent", "ghost", "decode"))
    with raises_naming("latent: ghost -> decode", "'ghost'", "does not exist"):
        PipelineSpec(chain_stages(), edges, output_artifacts={"video"})


def test_unconnected_consumed_artifact_is_rejected() -> None:
    stages = (
        stage("encode", {"frame", "control"}, "latent"),
        stage("decode", "latent", "video"),
    )
    with raises_naming("'encode'", "consumes an unconnected artifact", "'control'"):
        PipelineSpec(stages, chain_edges(), output_artifacts={"video"})


def test_consumed_artifact_fed_only_into_another_stage_is_unconnected() -> None:
    # "latent" reaches "decode" but "mix" also consumes it and has no edge of its own
    stages = (
        stage("encode", "frame", "latent"),
        stage("decode", "latent", "video"),
        stage("mix", "latent", "audio"),
    )
    with raises_naming("'mix'", "unconnected", "'latent'"):
        PipelineSpec(stages, chain_edges(), output_artifacts={"video", "audio"})


def test_unconnected_produced_artifact_is_rejected() -> None:
    stages = (
        stage("encode", "frame", {"latent", "debug"}),
        stage("decode", "latent", "video"),
    )
    with raises_naming("'encode'", "produces an unconnected artifact", "'debug'"):
        PipelineSpec(stages, chain_edges(), output_artifacts={"video"})


def test_produced_artifact_that_is_an_output_needs_no_edge() -> None:
    stages = (
        stage("encode", "frame", {"latent", "debug"}),
        stage("decode", "latent", "video"),
    )
    spec = PipelineSpec(stages, chain_edges(), output_artifacts={"video", "debug"})
    assert spec.output_artifacts == frozenset({"video", "debug"})


def test_output_not_produced_is_rejected() -> None:
    with raises_naming("'ghost'", "not produced"):
        PipelineSpec(chain_stages(), chain_edges(), output_artifacts={"video", "ghost"})


def test_latency_anchor_must_be_ingress() -> None:
    with raises_naming("'latent'", "latency_anchor_artifact", "ingress"):
        valid_chain(latency_anchor_artifact="latent")


def test_latency_anchor_ingress_is_accepted() -> None:
    assert valid_chain(latency_anchor_artifact="frame").latency_anchor_artifact == "frame"


def test_cycle_is_rejected() -> None:
    stages = (
        stage("a", {"seed", "back"}, "forward"),
        stage("b", "forward", {"back", "out"}),
    )
    edges = (
        ingress("seed", "a"),
        edge("forward", "a", "b"),
        edge("back", "b", "a"),
    )
    with raises_naming("contains a cycle", "'a'", "'b'"):
        PipelineSpec(stages, edges, output_artifacts={"out"})


def test_cycle_names_only_the_stages_left_in_it() -> None:
    stages = (
        stage("head", "seed", "x"),
        stage("a", {"x", "back"}, "forward"),
        stage("b", "forward", {"back", "out"}),
    )
    edges = (
        ingress("seed", "head"),
        edge("x", "head", "a"),
        edge("forward", "a", "b"),
        edge("back", "b", "a"),
    )
    with pytest.raises(ValueError, match="cycle") as info:
        PipelineSpec(stages, edges, output_artifacts={"out"})
    assert "['a', 'b']" in str(info.value)
    assert "head" not in str(info.value)


def test_unreachable_output_rule() -> None:
    # Through the constructor every earlier rule (each consumed artifact fed into
    # its own stage by ingress or by its producer, no cycles) already implies that
    # every output is reachable, so this rule can only be exercised on its own.
    spec = valid_chain()
    with raises_naming("Unreachable output artifacts", "'video'"):
        spec._check_reachable(frozenset(), spec.topological_order)
    spec._check_reachable(spec.ingress_artifacts, spec.topological_order)  # no error


# -- positive: derived views -------------------------------------------------------


def diamond() -> PipelineSpec:
    """Declared out of topological order on purpose: ties keep declaration order."""
    stages = (
        stage("decode", {"latent", "audio_latent"}, "video"),
        stage("audio", "latent", "audio_latent"),
        stage("encode", "frame", "latent"),
        stage("prompt", "text", "embedding"),
        stage("denoise", "embedding", "cond"),
    )
    edges = (
        ingress("frame", "encode"),
        ingress("text", "prompt"),
        edge("latent", "encode", "decode"),
        edge("latent", "encode", "audio", capacity_per_session=2),
        edge("audio_latent", "audio", "decode"),
        edge("embedding", "prompt", "denoise"),
    )
    return PipelineSpec(stages, edges, output_artifacts={"video", "cond"})


def test_topological_order_ties_follow_declaration_order() -> None:
    spec = diamond()
    # Kahn: each step takes the first ready stage in declaration order
    assert spec.topological_order == ("encode", "audio", "decode", "prompt", "denoise")


def test_topological_order_of_independent_stages_is_declaration_order() -> None:
    stages = (stage("z", "a", "x"), stage("y", "b", "w"), stage("m", "c", "v"))
    edges = (ingress("a", "z"), ingress("b", "y"), ingress("c", "m"))
    spec = PipelineSpec(stages, edges, output_artifacts={"x", "w", "v"})
    assert spec.topological_order == ("z", "y", "m")


def test_topological_order_puts_producers_first_and_its_reverse_consumers_first() -> None:
    spec = diamond()
    forward = {s: i for i, s in enumerate(spec.topological_order)}
    backward = {s: i for i, s in enumerate(reversed(spec.topological_order))}
    internal = [e for e in spec.edges if e.source_stage is not None]
    assert internal
    for e in internal:
        assert forward[e.source_stage] < forward[e.target_stage]
        # cleanup/shutdown order: every consumer before its producer
        assert backward[e.target_stage] < backward[e.source_stage]
    assert tuple(reversed(spec.topological_order)) == ("denoise", "prompt", "decode", "audio", "encode")


def test_producers_map_each_artifact_to_its_stage() -> None:
    spec = diamond()
    assert dict(spec.producers) == {
        "latent": "encode",
        "audio_latent": "audio",
        "video": "decode",
        "embedding": "prompt",
        "cond": "denoise",
    }


def test_ingress_artifacts() -> None:
    assert diamond().ingress_artifacts == frozenset({"frame", "text"})
    assert valid_chain().ingress_artifacts == frozenset({"frame"})


def test_stage_lookup_and_edges_from() -> None:
    spec = diamond()
    assert spec.stage("audio").produces == frozenset({"audio_latent"})
    with pytest.raises(KeyError, match="'ghost'"):
        spec.stage("ghost")
    assert {e.target_stage for e in spec.edges_from("latent")} == {"decode", "audio"}
    assert spec.edges_from("frame") == (ingress("frame", "encode"),)


def test_pipeline_converts_collections() -> None:
    spec = PipelineSpec(list(chain_stages()), list(chain_edges()), output_artifacts="video")
    assert isinstance(spec.stages, tuple)
    assert isinstance(spec.edges, tuple)
    assert spec.output_artifacts == frozenset({"video"})
    assert spec.resource_groups == ()
    assert spec.output_capacity_per_session == 1
    assert spec.latency_anchor_artifact is None


# -- positive: frozen and hashable ---------------------------------------------------


def test_specs_are_frozen() -> None:
    s = stage("encode", "frame", "latent")
    e = ingress("frame", "encode")
    g = ResourceGroupSpec("gpu")
    p = valid_chain()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        s.stage_id = "other"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        e.capacity_per_session = 3  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        g.max_concurrency = 3  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.stages = ()  # type: ignore[misc]


def test_specs_are_hashable_and_compare_by_value() -> None:
    assert stage("encode", "frame", "latent") == stage("encode", {"frame"}, ["latent"])
    assert hash(stage("encode", "frame", "latent")) == hash(stage("encode", {"frame"}, ["latent"]))
    assert hash(ingress("frame", "encode")) == hash(ingress("frame", "encode"))
    assert hash(ResourceGroupSpec("gpu")) == hash(ResourceGroupSpec("gpu"))
    assert valid_chain() == valid_chain()
    assert hash(valid_chain()) == hash(valid_chain())
    assert len({valid_chain(), valid_chain(), valid_chain(output_capacity_per_session=2)}) == 2


# -- parts that are not collections at all ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("consumes", None, "NoneType None"), ("consumes", [["frame"]], "list [['frame']]"), ("produces", 5, "int 5")],
)
def test_artifact_names_that_are_not_names_are_a_value_error_naming_the_field(field, value, named):
    """Once a TypeError from inside the converter (``'NoneType' object is not iterable``), naming nothing."""
    kwargs = {"consumes": {"frame"}, "produces": {"latent"}, field: value}
    with pytest.raises(ValueError, match=rf"^{field} must be an artifact name or an iterable of names, got {re.escape(named)}$"):
        StageSpec("encode", **kwargs)


@pytest.mark.parametrize("field", ["stages", "edges", "resource_groups", "output_artifacts"])
def test_pipeline_parts_that_are_not_iterable_are_a_value_error_naming_the_field(field):
    encode, decode = chain_stages()
    kwargs = {"stages": [encode, decode], "edges": [ingress("frame", "encode"), edge("latent", "encode", "decode")],
              "output_artifacts": {"video"}, field: None}
    with pytest.raises(ValueError, match=rf"^{field} must be .*iterable.*, got NoneType None"):
        PipelineSpec(**kwargs)
