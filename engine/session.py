"""The handle a caller holds for one orchestrator session."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from states.pipeline_session import EMITTING, Event, State

from .blockers import Blocker
from .errors import OutputsBusyError
from .ingress import as_sequence_id, ingress_names, refused_input
from .metrics import (
    ArtifactStats,
    IdleInterval,
    SessionMetrics,
    StageTiming,
    idle_intervals,
)

if TYPE_CHECKING:
    from .core import SchedulerCore
    from .home_thread import HomeThread
    from .runtime import SessionRuntime
    from .shutdown import SessionShutdown

__all__ = ["Session"]


class Session:
    """One session (one epoch): push ingress, read outputs in order, close.

    The handle stays valid after the session ends: status, error, metrics and
    any outputs emitted before a drained close remain readable. It is driven from its orchestrator's trio run
    only: a call that pushes, reads outputs, waits or ends it from another thread is a ``WrongThreadError``.
    """

    def __init__(
        self, core: SchedulerCore, shutdown: SessionShutdown, runtime: SessionRuntime, home: HomeThread
    ) -> None:
        self._core = core
        self._shutdown = shutdown
        self._runtime = runtime
        self._home = home

    def _here(self, call: str) -> None:
        home = self._home
        if threading.get_ident() != home.ident:  # (the check, without its message made on every call)
            home.check(f"session {self._runtime.session_id!r}", call)

    def __repr__(self) -> str:
        rt = self._runtime
        return f"<Session {rt.session_id!r} epoch={rt.epoch} {rt.state.value}>"

    # -- identity and status -------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._runtime.session_id

    @property
    def epoch(self) -> int:
        return self._runtime.epoch

    @property
    def status(self) -> State:
        return self._runtime.state

    @property
    def final_sequence_id(self) -> int | None:
        return self._runtime.final_sequence_id

    @property
    def error(self) -> BaseException | None:
        """Why the session failed (None unless it failed)."""
        return self._runtime.error

    @property
    def cleanup_error(self) -> BaseException | None:
        """The last cleanup failure (set while the session is poisoned)."""
        return self._runtime.cleanup_error

    @property
    def shutdown_phases(self) -> tuple[tuple[str, str], ...]:
        """What each shutdown phase did, in order: (phase, outcome)."""
        return tuple(self._runtime.phases)

    # -- ingress -----------------------------------------------------------------

    async def push(self, sequence_id: int, artifacts: Mapping[str, Any]) -> None:
        """Admit ``artifacts`` for ``sequence_id`` atomically, waiting for room on every edge."""
        self._here("push")
        await self._core.push(self._runtime, as_sequence_id(sequence_id), _read_once(artifacts))

    def try_push(self, sequence_id: int, artifacts: Mapping[str, Any]) -> bool:
        """Admit all of ``artifacts`` now, or nothing (False when an edge is full)."""
        self._here("try_push")
        return self._core.try_push(self._runtime, as_sequence_id(sequence_id), _read_once(artifacts))

    def can_push(self, artifacts: Iterable[str], *, sequence_id: int | None = None) -> bool:
        """Whether every named ingress artifact has room now (a pure query); with ``sequence_id``, room for that
        sequence: one ahead of the lowest sequence missing on an edge may not take the edge's last place."""
        return self._core.has_room(self._runtime, artifacts, None if sequence_id is None else as_sequence_id(sequence_id))

    async def wait_for_room(self, artifacts: Iterable[str], *, sequence_id: int | None = None) -> None:
        """Wait until every named ingress artifact has room, for ``sequence_id`` if given (as :meth:`can_push`);
        raises if the session stops admitting, and, as :meth:`push` would, for a ``sequence_id`` past the final
        sequence (at once, or once :meth:`finish_inputs` declares one below it)."""
        self._here("wait_for_room")
        names = ingress_names(artifacts)
        rt = self._runtime
        seq = None if sequence_id is None else as_sequence_id(sequence_id)

        def room() -> bool:
            if self._core.has_room(rt, names, seq, refuse_past_end=True):
                return True
            if not rt.admitting:
                raise refused_input(rt)
            return False

        await self._core.wait_until(rt.room, room)

    def finish_inputs(self, final_sequence_id: int) -> None:
        """Declare the last sequence of an open-ended session."""
        self._here("finish_inputs")
        self._core.finish_inputs(self._runtime, as_sequence_id(final_sequence_id))

    # -- outputs -------------------------------------------------------------------

    def poll_outputs(self) -> list[tuple[int, dict[str, Any]]]:
        """Every output emitted so far and not yet taken, in sequence order (never waits)."""
        self._here("poll_outputs")
        return self._core.take_outputs(self._runtime)

    async def outputs(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Yield ``(sequence_id, {artifact: value})`` in order until the session has no more.

        A failed session's outputs end too (they do not raise): ``error`` then says why,
        e.g. the stage's exception or the :class:`~engine.errors.InvalidStageOutput`.
        One task reads them: a second that comes to wait while another waits is an ``OutputsBusyError``
        (each took what the other never saw). Each output is taken as it is yielded: leaving the loop (``break``, a
        cancel) leaves the ones not yet yielded for the next read.
        """
        self._here("outputs")
        rt = self._runtime
        counted_in = False

        def more_or_none() -> bool:
            nonlocal counted_in
            if bool(rt.outputs) or rt.all_emitted or rt.machine.is_terminal or rt.state not in EMITTING:
                return True
            if not counted_in and rt.emitted.waiting:  # outputs() alone waits there: another reader is parked
                raise OutputsBusyError(
                    f"session {rt.session_id!r}: another task is already waiting for its outputs; read them in one "
                    f"task (two readers each miss the outputs the other takes)"
                )
            counted_in = True
            return False

        while True:
            # one at a time: a reader that breaks out or is cancelled leaves the rest for the next read
            taken = self._core.take_outputs(rt, 1)
            if taken:
                yield taken[0]
                continue
            if rt.all_emitted or rt.machine.is_terminal or rt.state not in EMITTING:
                return
            counted_in = False
            await self._core.wait_until(rt.emitted, more_or_none)

    # -- ending ----------------------------------------------------------------------

    async def aclose(self, *, timeout: float = 60.0, drain_timeout: float | None = None) -> None:
        """Drain accepted work, then release stage state in reverse order (or retry a poisoned cleanup).

        The drain may use ``drain_timeout`` (default: half of ``timeout``); work still
        waiting then is cancelled, so the rest of the budget is left for the stages.
        """
        self._here("aclose")
        await self._shutdown.run(self._runtime, Event.CLOSE, timeout=timeout, drain_timeout=drain_timeout)

    async def cancel(self, *, timeout: float = 60.0) -> None:
        """Drop waiting work (running calls finish, results discarded), then release stage state."""
        self._here("cancel")
        await self._shutdown.run(self._runtime, Event.CANCEL, timeout=timeout)

    async def wait_settled(self) -> None:
        """Wait until the session is terminal or poisoned (e.g. after a background failure cleanup)."""
        self._here("wait_settled")
        await self._runtime.settled.wait()

    async def wait_until_idle(self) -> None:
        """Wait until nothing of this session runs or could start now."""
        self._here("wait_until_idle")
        rt = self._runtime
        await self._core.wait_until(rt.changed, lambda: not self._core.busy(rt))

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        with trio.CancelScope(shield=exc_type is not None):
            if exc_type is None:
                await self.aclose()
            else:
                await self.cancel()

    # -- observation -------------------------------------------------------------------

    def metrics(self) -> SessionMetrics:
        with self._core.lock:  # a stage's thread may be completing work of this session
            rt = self._runtime
            return SessionMetrics.from_session(
                rt.ingress_at,
                rt.emitted_at,
                first_ingress_at=rt.first_ingress_at,
                first_emitted_at=rt.first_emitted_at,
                control_to_output=rt.control_to_output,
                chunk_period=rt.chunk_period,
            )

    def stage_timings(self, stage_id: str) -> list[StageTiming]:
        with self._core.lock:  # a stage's thread may be completing work of this session
            rt = self._runtime
            if stage_id not in rt.timings:
                raise KeyError(f"unknown stage {stage_id!r}")
            return [
                StageTiming(stage_id, seq, t.inputs_ready_at, t.admitted_at, t.completed_at)
                for seq, t in sorted(rt.timings[stage_id].items())
            ]

    def idle_intervals(self, stage_id: str) -> list[IdleInterval]:
        with self._core.lock:  # a stage's thread may be completing work of this session
            rt = self._runtime
            return idle_intervals(stage_id, self.stage_timings(stage_id), rt.missing_after[stage_id], rt.blockers[stage_id])

    def stage_timing(self, stage_id: str, sequence_id: int) -> StageTiming | None:
        """One sequence's timing at one stage (O(1): for per-chunk reporting on a hot path)."""
        with self._core.lock:  # a stage's thread may be completing work of this session
            rt = self._runtime
            if stage_id not in rt.timings:
                raise KeyError(f"unknown stage {stage_id!r}")
            t = rt.timings[stage_id].get(sequence_id)
            return None if t is None else StageTiming(stage_id, sequence_id, t.inputs_ready_at, t.admitted_at, t.completed_at)

    def idle_before(self, stage_id: str, sequence_id: int) -> IdleInterval | None:
        """The stage's idle gap before ``sequence_id`` (after ``sequence_id - 1``), with its reason; O(1)."""
        with self._core.lock:  # a stage's thread may be completing work of this session
            previous = self.stage_timing(stage_id, sequence_id - 1)
            current = self.stage_timing(stage_id, sequence_id)
            if previous is None or current is None:
                return None
            rt = self._runtime
            found = idle_intervals(stage_id, [previous, current], rt.missing_after[stage_id], rt.blockers[stage_id])
            return found[0] if found else None

    def control_to_output(self, sequence_id: int) -> float | None:
        """Seconds from the sequence's (anchor) ingress to its output; None if either is unknown; O(1)."""
        with self._core.lock:  # a stage's thread may be completing work of this session
            rt = self._runtime
            accepted, emitted = rt.ingress_at.get(sequence_id), rt.emitted_at.get(sequence_id)
            return None if accepted is None or emitted is None else emitted - accepted

    def artifact_stats(self) -> ArtifactStats:
        with self._core.lock:  # a stage's thread may be completing work of this session
            slots = self._runtime.slots
            return ArtifactStats(len(slots), sum(len(s.consumers) for s in slots.values()))

    def buffered(self, artifact: str, target_stage: str) -> int:
        """Items of ``artifact`` waiting for ``target_stage`` (bounded by the edge's capacity)."""
        if (artifact, target_stage) not in self._core.graph.capacity:
            raise KeyError(f"no edge carries {artifact!r} to {target_stage!r}")
        with self._core.lock:  # a stage's thread may be completing work of this session
            return self._runtime.occupancy[(artifact, target_stage)]

    def blocker(self, stage_id: str, sequence_id: int) -> Blocker | None:
        """The limit that last held ``sequence_id`` back at ``stage_id`` once its inputs were ready."""
        if stage_id not in self._runtime.blockers:
            raise KeyError(f"unknown stage {stage_id!r}")
        return self._core.blocker(self._runtime, stage_id, sequence_id)

    @property
    def outputs_held(self) -> int:
        """Outputs emitted and not yet read, plus those waiting for earlier sequences."""
        rt = self._runtime
        with self._core.lock:
            return len(rt.outputs) + len(rt.pending_outputs)

    @property
    def in_flight(self) -> int:
        """Invocations of this session not yet fully delivered.

        Running ones, and ones that completed on a stage's thread while the trio side of
        that completion (a reader's wake-up, a trio-side submit) is still queued.
        """
        rt = self._runtime
        with self._core.lock:
            return len(rt.reservations) + rt.handoffs_queued


def _read_once(artifacts: Any) -> Any:
    """A mapping other than a plain dict, read whole before anything is admitted: one whose value could not be read
    (a lazy loader that raised) had the artifacts before it admitted, and a retry was refused as already buffered.
    Anything else is left for the push to refuse by name."""
    if type(artifacts) is dict or not isinstance(artifacts, Mapping):
        return artifacts
    return dict(artifacts)
