"""Ingress rules: what a session's caller may push, and whether it fits now.

Ingress that can never run is refused with a clear error (never stranded):
a non-ingress artifact, a duplicate, a sequence a strict stage already took,
one past the final sequence. Whether ingress fits *now* is a pure question of
edge room, where the last place on an edge is kept for the lowest sequence still
missing there, so no order of pushes can leave a session waiting for good. The
scheduler core (which owns the session) applies both.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import IngressRefused, SessionStateError, error_text, shown
from .graph import StageGraph
from .runtime import SessionRuntime

__all__ = [
    "check_ingress", "has_room", "refuse_past_final", "room_query", "check_final_sequence", "check_final_sequence_id",
    "ingress_names",
    "is_sequence_id", "as_sequence_id", "refused_input", "MAX_SEQUENCE_ID",
]


def refused_input(rt: SessionRuntime) -> SessionStateError:
    """Why a stopped session takes no input; a failed one names its failure (a stage's error) as the cause."""
    why = f": {error_text(rt.error)}" if rt.error is not None else ""
    error = SessionStateError(f"session {rt.session_id!r} is {rt.state.value} and accepts no input{why}")
    error.__cause__ = rt.error
    return error


def check_ingress(graph: StageGraph, rt: SessionRuntime, seq: int, artifacts: Mapping[str, Any]) -> bool:
    """Raise for ingress that can never run; else return whether every edge it feeds has room now.

    One pass over the artifacts and their edges (asked on every push attempt): the rules
    are checked for every artifact whether or not there is room, so a push that can never
    run is refused at once rather than after a wait.
    """
    if not rt.machine.admitting:
        raise refused_input(rt)
    if not (type(seq) is int and 0 <= seq <= MAX_SEQUENCE_ID) and not is_sequence_id(seq):  # the plain int first
        raise IngressRefused(f"sequence id must be an int in 0..2**63-1 (>= 0), got {shown(seq)}")
    if type(artifacts) is not dict and not isinstance(artifacts, Mapping):  # a plain dict first: ABC checks cost
        raise IngressRefused(f"ingress must be a mapping {{artifact: value}}, got {type(artifacts).__name__}")
    if not artifacts:
        raise IngressRefused("ingress needs at least one artifact")
    if rt.final_sequence_id is not None and seq > rt.final_sequence_id:
        raise _past_final(rt, seq)
    ingress_edges, slots, lanes, occupancy = graph.ingress_edges, rt.slots, rt.lanes, rt.occupancy
    fits = True
    for artifact in artifacts:
        edges = ingress_edges.get(artifact)
        if edges is None:
            raise IngressRefused(f"{shown(artifact)} is not an ingress artifact (ingress: {sorted(graph.ingress)})")
        if (seq, artifact) in slots:
            raise _buffered(rt, artifact, seq)
        for stage_id, edge, limit in edges:
            taken = lanes[stage_id].taken
            if seq < taken.below or seq in taken.beyond:  # ``seq in taken``, without a call: asked for every push
                raise _taken(rt, stage_id, artifact, seq)
            held = occupancy.get(edge, 0)  # a plain get: Counter's missing-key hook is Python
            if held >= limit or (held + 1 == limit and seq != lowest_missing(rt, artifact, stage_id)):
                fits = False
    return fits


def refuse_past_final(rt: SessionRuntime, seq: int) -> None:
    """Raise, as :func:`check_ingress` would, for a sequence past the session's final one: no push for it can ever
    be admitted, so a wait for its room would never end. (A wait asks about room, not about each artifact: one
    buffered or taken meanwhile may simply not be pushed again, as a window that sends a sequence's condition ahead
    of its control does.)"""
    if rt.final_sequence_id is not None and seq > rt.final_sequence_id:
        raise _past_final(rt, seq)


def _past_final(rt: SessionRuntime, seq: int) -> IngressRefused:
    return IngressRefused(f"session {rt.session_id!r}: sequence {seq} is past the final sequence {rt.final_sequence_id}")


def _buffered(rt: SessionRuntime, artifact: str, seq: int) -> IngressRefused:
    return IngressRefused(f"session {rt.session_id!r}: {artifact!r} for sequence {seq} is already buffered")


def _taken(rt: SessionRuntime, stage_id: str, artifact: str, seq: int) -> IngressRefused:
    return IngressRefused(
        f"session {rt.session_id!r}: stage {stage_id!r} has already taken sequence {seq}, "
        f"so {artifact!r} for it would never be consumed"
    )


def lowest_missing(rt: SessionRuntime, artifact: str, stage_id: str) -> int:
    """The lowest sequence that ``stage_id`` has not taken and whose ``artifact`` is not buffered yet.

    The last place on an ingress edge is kept for it: a push ahead of it fits only while
    another place stays free. (Sequences 1 and 2 pushed before 0 would otherwise fill a
    two-place edge, and 0, which the stage needs first, could never be pushed.) The same
    rule as a stage taking sequences out of order (``engine.blockers.first_blocker``).
    """
    taken, slots = rt.lanes[stage_id].taken, rt.slots
    seq = taken.below
    while (seq, artifact) in slots or seq in taken:  # at most the edge's places and the calls in flight
        seq += 1
    return seq


# The largest sequence id (a signed 64-bit int): far beyond any stream, and every message,
# log line and wire format can still carry it (Python will not even print a 5000-digit int).
MAX_SEQUENCE_ID = 2**63 - 1


def as_sequence_id(value: object) -> object:
    """``value`` as a plain int when it is an integer of another type in range (numpy's ``int64``, an IntEnum),
    else ``value`` itself, for the checks to refuse by name. A bool is never one (``True`` would silently be 1)."""
    if type(value) is int or isinstance(value, bool):
        return value
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value
    return number if 0 <= number <= MAX_SEQUENCE_ID else value


def is_sequence_id(value: object) -> bool:
    """A sequence id is an int in 0..MAX_SEQUENCE_ID (after :func:`as_sequence_id`); a bool is not one."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEQUENCE_ID


def check_final_sequence_id(value: object) -> None:
    """A final sequence id (given at open or to ``finish_inputs``) is a sequence id: a ValueError if not."""
    if not is_sequence_id(value):
        raise ValueError(f"final_sequence_id must be an int in 0..2**63-1, got {shown(value)}")


def ingress_names(artifacts: Iterable[str]) -> tuple[str, ...]:
    """The artifact names a room query asks about; a bare string is one name, not its characters."""
    if isinstance(artifacts, str):
        return (artifacts,)
    try:
        return tuple(artifacts)  # each one not an ingress artifact is named by the caller's check
    except TypeError:
        raise ValueError(f"artifacts must be an artifact name or names, got {type(artifacts).__name__}") from None


def room_query(graph: StageGraph, artifacts: Iterable[str], seq: int | None) -> tuple[str, ...]:
    """The artifact names a room query asks about, checked: each an ingress artifact, ``seq`` a sequence id."""
    names = ingress_names(artifacts)
    unknown = [shown(a) for a in names if a not in graph.ingress]
    if unknown:
        raise ValueError(f"not ingress artifacts: [{', '.join(unknown)}] (ingress: {sorted(graph.ingress)})")
    if seq is not None and not is_sequence_id(seq):
        raise ValueError(f"sequence_id must be an int in 0..2**63-1, got {shown(seq)}")
    return names


def has_room(graph: StageGraph, rt: SessionRuntime, artifacts: Iterable[str], seq: int | None = None) -> bool:
    """Whether every edge the named artifacts feed has room for one more item (for sequence ``seq``, if given:
    a sequence ahead of the lowest one missing on an edge may not take its last place)."""
    occupancy = rt.occupancy
    for artifact in artifacts:
        for stage_id, edge, limit in graph.ingress_edges.get(artifact, ()):
            held = occupancy.get(edge, 0)  # a plain get: Counter's missing-key hook is Python
            if held >= limit:
                return False
            if seq is not None and held + 1 == limit and seq != lowest_missing(rt, artifact, stage_id):
                return False
    return True


def check_final_sequence(graph: StageGraph, rt: SessionRuntime, final_sequence_id: int) -> bool:
    """Whether declaring ``final_sequence_id`` changes anything; raise if it may not be declared.

    The final sequence must be known before any stage takes it: a stage that
    already ran it was told it is not the last, and the stages would disagree.
    """
    check_final_sequence_id(final_sequence_id)
    if rt.final_sequence_id is not None:
        if rt.final_sequence_id != final_sequence_id:
            raise SessionStateError(f"session {rt.session_id!r} already ends at sequence {rt.final_sequence_id}")
        return False
    if not rt.admitting:
        raise SessionStateError(f"session {rt.session_id!r} is {rt.state.value}")
    seen = max([rt.highest_ingress, rt.next_emit - 1, *rt.reservations.sequences()])
    if final_sequence_id < seen:
        raise IngressRefused(
            f"session {rt.session_id!r}: final sequence {final_sequence_id} is before "
            f"sequence {seen}, which was already accepted"
        )
    for stage_id in graph.topological_order:
        if final_sequence_id in rt.lanes[stage_id].taken:
            raise IngressRefused(
                f"session {rt.session_id!r}: stage {stage_id!r} has already taken sequence "
                f"{final_sequence_id} as not the last; declare the final sequence before its first stage runs it"
            )
    return True
