"""Completion rules: what an accepted result becomes.

A valid result becomes new artifact slots for its consumers and pending
outputs, which are emitted strictly in sequence order once every output
artifact of a sequence exists. Whether a result counts at all (unknown
session, stale epoch, duplicate) is the scheduler core's decision; these
functions only shape an accepted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import InvalidStageOutput, error_text, shown
from .graph import StageGraph
from .runtime import SessionRuntime
from .spec import StageSpec

__all__ = ["read_result", "record_result"]


def read_result(stage: StageSpec, seq: int, artifacts: Any) -> dict[str, Any] | InvalidStageOutput:
    """The result as a plain dict of exactly the stage's produced artifacts, or the error saying why it is not one.

    A mapping other than a plain dict is read once, here (every key and value): one that cannot be read (a key
    that is not hashable, a value whose lookup raises) fails its session like any other invalid result, rather
    than raising where the scheduler records it.
    """
    try:  # (free in CPython 3.11 unless something raises)
        plain = artifacts if type(artifacts) is dict else dict(artifacts) if isinstance(artifacts, Mapping) else None
        if plain is None:
            return _invalid(stage, seq, type(artifacts).__name__)
        if plain.keys() == stage.produces:
            return plain
        # a careless handler's keys need not be strings, nor comparable with each other, nor printable
        got = "[" + ", ".join(sorted(map(shown, plain))) + "]"
    except Exception as exc:
        error = _invalid(stage, seq, f"a {type(artifacts).__name__} that could not be read ({error_text(exc)})")
        error.__cause__ = exc
        return error
    return _invalid(stage, seq, got)


def _invalid(stage: StageSpec, seq: int, got: str) -> InvalidStageOutput:
    return InvalidStageOutput(
        f"stage {stage.stage_id!r} returned {got} for sequence {seq}; it must return exactly {sorted(stage.produces)}"
    )


def record_result(graph: StageGraph, rt: SessionRuntime, stage: StageSpec, seq: int, artifacts: Mapping[str, Any], now: float) -> bool:
    """Store a checked result; returns whether an output was emitted."""
    made_output = False
    for artifact, value in artifacts.items():
        targets = graph.targets.get(artifact, ())
        if targets:
            rt.add_slot(seq, artifact, value, targets, now, graph.consumes)
        if artifact in graph.outputs:
            rt.pending_outputs.setdefault(seq, {})[artifact] = value
            made_output = True
    emitted = made_output and _emit_ready_outputs(graph, rt, now)  # else no output can have become complete
    following = seq + 1
    if rt.final_sequence_id is None or following <= rt.final_sequence_id:
        slots = rt.slots
        missing: tuple[str, ...] = ()
        for artifact in graph.consumes_sorted[stage.stage_id]:  # a loop, not a generator: made per completion
            if (following, artifact) not in slots:
                missing += (artifact,)
        if missing:
            rt.missing_after[stage.stage_id][following] = missing
    return emitted


def _emit_ready_outputs(graph: StageGraph, rt: SessionRuntime, now: float) -> bool:
    emitted = False
    while True:
        pending = rt.pending_outputs.get(rt.next_emit)
        if pending is None or len(pending) != len(graph.outputs):
            return emitted
        del rt.pending_outputs[rt.next_emit]
        rt.outputs.append((rt.next_emit, dict(sorted(pending.items()))))
        rt.record_emitted(rt.next_emit, now)
        rt.next_emit += 1
        emitted = True
