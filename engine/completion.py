"""Completion: what happens when an actor resolves an invocation.

Results are checked before they count: a result for an unknown session, a
closed or replaced session (stale epoch), or a second resolution of the same
invocation is dropped and counted. A valid result becomes new artifact slots
for its consumers and pending outputs, which are emitted strictly in sequence
order once every output artifact of a sequence exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import outcome
import trio

from .actors import StageInvocation, TaskKey
from .errors import InvalidStageOutput
from .runtime import METRICS_WINDOW, SessionRuntime, trim

if TYPE_CHECKING:
    from .orchestrator import _Counters
    from .spec import StageSpec

__all__ = ["CompletionMixin"]


class CompletionMixin:
    """The completion half of the orchestrator (it owns the sessions, stages, counters and limits)."""

    _sessions: dict[str, SessionRuntime]
    _stages: dict[str, StageSpec]
    _targets: dict[str, tuple[str, ...]]
    _consumes: dict[str, frozenset[str]]
    _outputs: frozenset[str]
    _in_flight_global: dict[str, int]
    _group_usage: dict[str, int]
    _next_request: int
    _counters: _Counters
    actors: dict[str, Any]

    _after_completion: dict[str, frozenset[str]]
    _consumes_sorted: dict[str, tuple[str, ...]]
    _output_producers: frozenset[str]

    def _pump(self, stages: Any = None) -> None:  # provided by the orchestrator
        raise NotImplementedError

    def _fail(self, rt: SessionRuntime, error: BaseException) -> None:  # provided by the orchestrator
        raise NotImplementedError

    def _fail_actor_sessions(self, stage_id: str, reason: str | None, error: BaseException | None = None,
                             first: SessionRuntime | None = None) -> None:  # provided by the orchestrator
        raise NotImplementedError

    def _on_done(self, invocation: StageInvocation, result: outcome.Outcome) -> None:
        """Called by an actor, in the trio thread, once per submitted invocation."""
        key = invocation.key
        rt = self._sessions.get(key.session_id)
        if rt is None or key.request_id >= self._next_request:
            self._counters.orphaned_results += 1
            return
        if rt.epoch != key.session_epoch:
            self._counters.stale_epoch_results += 1
            return
        if rt.in_flight.get((key.stage_id, key.sequence_id)) is not key:
            self._counters.duplicate_results += 1
            return
        stage = self._stages[key.stage_id]
        del rt.in_flight[(key.stage_id, key.sequence_id)]
        rt.in_flight_by_stage[key.stage_id] -= 1
        for artifact in stage.produces:
            rt.producing[artifact] -= 1
        self._in_flight_global[key.stage_id] -= 1
        if stage.resource_group is not None:
            self._group_usage[stage.resource_group] -= 1
        now = trio.current_time()
        rt.timing(key.stage_id, key.sequence_id).completed_at = now
        try:
            self._accept_result(rt, stage, key, result, now)
        finally:
            rt.wake_progress()
            self._pump(self._after_completion[stage.stage_id])

    def _accept_result(self, rt: SessionRuntime, stage: Any, key: TaskKey, result: outcome.Outcome, now: float) -> None:
        if isinstance(result, outcome.Error):
            actor_health = self.actors[stage.stage_id].health()
            if not actor_health.healthy:
                self._fail_actor_sessions(stage.stage_id, actor_health.failure_reason, result.error, first=rt)
            else:
                self._fail(rt, result.error)
            return
        if not rt.starting_accepted_work:
            return  # cancelled or failed meanwhile: the result is discarded
        artifacts = result.value
        if not isinstance(artifacts, Mapping) or artifacts.keys() != stage.produces:
            got = sorted(artifacts) if isinstance(artifacts, Mapping) else type(artifacts).__name__
            self._fail(
                rt,
                InvalidStageOutput(
                    f"stage {stage.stage_id!r} returned {got} for sequence {key.sequence_id}; "
                    f"it must return exactly {sorted(stage.produces)}"
                ),
            )
            return
        seq = key.sequence_id
        for artifact, value in artifacts.items():
            targets = self._targets.get(artifact, ())
            if targets:
                rt.add_slot(seq, artifact, value, targets, now, self._consumes)
            if artifact in self._outputs:
                rt.pending_outputs.setdefault(seq, {})[artifact] = value
        self._emit_ready_outputs(rt, now)
        following = seq + 1
        if rt.final_sequence_id is None or following <= rt.final_sequence_id:
            slots = rt.slots
            missing = tuple(a for a in self._consumes_sorted[stage.stage_id] if (following, a) not in slots)
            if missing:
                rt.missing_after[stage.stage_id][following] = missing

    def _emit_ready_outputs(self, rt: SessionRuntime, now: float) -> None:
        while True:
            pending = rt.pending_outputs.get(rt.next_emit)
            if pending is None or len(pending) != len(self._outputs):
                return
            del rt.pending_outputs[rt.next_emit]
            rt.outputs.append((rt.next_emit, dict(sorted(pending.items()))))
            rt.emitted_at[rt.next_emit] = now
            if len(rt.emitted_at) > METRICS_WINDOW:
                trim(rt.emitted_at)
            rt.next_emit += 1
            rt.wake_emitted()

    def _poll_outputs(self, rt: SessionRuntime) -> list[tuple[int, dict[str, Any]]]:
        items = list(rt.outputs)
        rt.outputs.clear()
        if items:
            rt.wake_progress()  # output room freed: a drain may proceed
            self._pump(self._output_producers)
        return items
