"""Builders of the spec tests: stages, edges, a valid two-stage chain, and a raises-naming check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from engine.spec import EdgeSpec, PipelineSpec, StageSpec

def stage(stage_id: str, consumes, produces, **kwargs) -> StageSpec:
    return StageSpec(stage_id, consumes=consumes, produces=produces, **kwargs)


def ingress(artifact: str, target: str, **kwargs) -> EdgeSpec:
    return EdgeSpec(artifact, target_stage=target, **kwargs)


def edge(artifact: str, source: str, target: str, **kwargs) -> EdgeSpec:
    return EdgeSpec(artifact, target_stage=target, source_stage=source, **kwargs)


def chain_stages() -> tuple[StageSpec, StageSpec]:
    """encode: frame -> latent; decode: latent -> video."""
    return (
        stage("encode", "frame", "latent"),
        stage("decode", "latent", "video"),
    )


def chain_edges() -> tuple[EdgeSpec, EdgeSpec]:
    return (ingress("frame", "encode"), edge("latent", "encode", "decode"))


def valid_chain(**kwargs) -> PipelineSpec:
    return PipelineSpec(chain_stages(), chain_edges(), output_artifacts={"video"}, **kwargs)


@contextlib.contextmanager
def raises_naming(*names: str) -> Iterator[None]:
    """``pytest.raises(ValueError)`` that also checks every name is in the message."""
    with pytest.raises(ValueError) as info:
        yield
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"
