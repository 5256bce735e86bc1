"""Ingress: what a session's caller may push, and when it has to wait.

Ingress that can never run is refused with a clear error (never stranded):
a non-ingress artifact, a duplicate, a sequence a strict stage already took,
one past the final sequence. Ingress that cannot run *yet* waits for room
(``push``) or is refused without side effects (``try_push``), atomically
across every artifact named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from .errors import IngressRefused, SessionStateError
from .runtime import METRICS_WINDOW, SessionRuntime, trim

if TYPE_CHECKING:
    from .spec import PipelineSpec

__all__ = ["IngressMixin"]


class IngressMixin:
    """The ingress half of the orchestrator (it owns ``spec``, ``_targets``, ``_capacity``, ``_consumes``)."""

    spec: PipelineSpec
    _targets: dict[str, tuple[str, ...]]
    _capacity: dict[tuple[str, str], int]
    _consumes: dict[str, frozenset[str]]

    def _pump(self, stages: Any = None) -> None:  # provided by the orchestrator
        raise NotImplementedError

    def _check_ingress(self, rt: SessionRuntime, seq: int, artifacts: Mapping[str, Any]) -> None:
        """Raise for ingress that can never run; capacity is checked separately."""
        if not rt.admitting:
            raise SessionStateError(f"session {rt.session_id!r} is {rt.state.value} and accepts no input")
        if not isinstance(seq, int) or seq < 0:
            raise IngressRefused(f"sequence id must be an int >= 0, got {seq!r}")
        if not artifacts:
            raise IngressRefused("ingress needs at least one artifact")
        if rt.final_sequence_id is not None and seq > rt.final_sequence_id:
            raise IngressRefused(
                f"session {rt.session_id!r}: sequence {seq} is past the final sequence {rt.final_sequence_id}"
            )
        for artifact in artifacts:
            if artifact not in self.spec.ingress_artifacts:
                raise IngressRefused(
                    f"{artifact!r} is not an ingress artifact (ingress: {sorted(self.spec.ingress_artifacts)})"
                )
            if (seq, artifact) in rt.slots:
                raise IngressRefused(f"session {rt.session_id!r}: {artifact!r} for sequence {seq} is already buffered")
            for stage_id in self._targets[artifact]:
                if seq in rt.taken[stage_id]:
                    raise IngressRefused(
                        f"session {rt.session_id!r}: stage {stage_id!r} has already taken sequence {seq}, "
                        f"so {artifact!r} for it would never be consumed"
                    )

    def _has_room(self, rt: SessionRuntime, artifacts: Any) -> bool:
        for artifact in artifacts:
            for stage_id in self._targets.get(artifact, ()):
                if rt.occupancy[(artifact, stage_id)] >= self._capacity[(artifact, stage_id)]:
                    return False
        return True

    def _try_push(self, rt: SessionRuntime, seq: int, artifacts: Mapping[str, Any]) -> bool:
        self._check_ingress(rt, seq, artifacts)
        if not self._has_room(rt, artifacts):
            return False
        now = trio.current_time()
        anchor = self.spec.latency_anchor_artifact
        if seq not in rt.ingress_at and (anchor is None or anchor in artifacts):
            rt.ingress_at[seq] = now
            if len(rt.ingress_at) > METRICS_WINDOW:
                trim(rt.ingress_at)
        for artifact, value in artifacts.items():
            rt.add_slot(seq, artifact, value, self._targets[artifact], now, self._consumes)
        rt.highest_ingress = max(rt.highest_ingress, seq)
        self._pump({target for artifact in artifacts for target in self._targets[artifact]})
        return True

    async def _push(self, rt: SessionRuntime, seq: int, artifacts: Mapping[str, Any]) -> None:
        while not self._try_push(rt, seq, artifacts):
            await rt.room.park()

    def _finish_inputs(self, rt: SessionRuntime, final_sequence_id: int) -> None:
        if not isinstance(final_sequence_id, int) or final_sequence_id < 0:
            raise ValueError(f"final_sequence_id must be an int >= 0, got {final_sequence_id!r}")
        if rt.final_sequence_id is not None:
            if rt.final_sequence_id != final_sequence_id:
                raise SessionStateError(
                    f"session {rt.session_id!r} already ends at sequence {rt.final_sequence_id}"
                )
            return
        if not rt.admitting:
            raise SessionStateError(f"session {rt.session_id!r} is {rt.state.value}")
        seen = max([rt.highest_ingress, rt.next_emit - 1, *(seq for _, seq in rt.in_flight)])
        if final_sequence_id < seen:
            raise IngressRefused(
                f"session {rt.session_id!r}: final sequence {final_sequence_id} is before "
                f"sequence {seen}, which was already accepted"
            )
        rt.final_sequence_id = final_sequence_id
        rt.wake()
        self._pump()
