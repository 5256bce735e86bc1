"""A session's ordered shutdown, phase by phase, as the pipeline-session table drives it.

1. stop admission (drain: accepted work goes on; cancel: waiting work is dropped);
2. wait until the session's work settles (a running call is never interrupted);
3. run every stage's session hook through its owning actor, in reverse topological order;
4. verify that no artifact slot or reservation remains (a leak is counted and poisons the session);
5. settle with the recorded reason.

Every phase is bounded by the caller's deadline and recorded in ``rt.phases``.
A failed phase leaves the session POISONED; running the shutdown again retries
only the stages that have not been released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from states import pipeline_session as table
from states.pipeline_session import CloseReason
from states.stage_actor import State as ActorState

from .actors import SessionContext
from .errors import SessionCleanupError
from .runtime import SessionRuntime

if TYPE_CHECKING:
    from .orchestrator import Orchestrator

__all__ = ["SessionShutdown"]

State = table.State
Event = table.Event


class SessionShutdown:
    """Runs shutdowns for one orchestrator (which owns the sessions and counters)."""

    def __init__(self, orch: Orchestrator) -> None:
        self._orch = orch

    async def run(self, rt: SessionRuntime, reason: CloseReason, *, cancel: bool, timeout: float, drain_timeout: float | None = None) -> None:
        """Run the session's ordered shutdown; raises SessionCleanupError if it ends poisoned."""
        now = trio.current_time()
        deadline = now + timeout
        # a drain that overruns must leave time to release the stages: by default
        # it may use half of the whole budget
        drain_deadline = min(deadline, now + (timeout / 2 if drain_timeout is None else drain_timeout))
        async with rt.lifecycle_lock:
            if rt.machine.is_terminal:
                return
            retrying = rt.state is State.POISONED
            self._stop_admission(rt, reason, cancel)
            if rt.state in (State.DRAINING, State.CANCELLING):
                await self._settle_work(rt, drain_deadline, deadline)
            if retrying:
                if rt.in_flight:
                    # a call from the timed-out drain is still running: wait for it first
                    with trio.move_on_at(deadline):
                        while rt.in_flight:
                            await rt.changed.park()
                if rt.in_flight:
                    self._poison(rt, TimeoutError("work still in flight; cleanup not retried"), "retry")
                else:
                    rt.phases.append(("retry", "started"))
                    rt.machine.apply(Event.RETRY_CLEANUP)
            if rt.state is State.RELEASING_STAGES:
                await self._release_stages(rt, deadline)
            if rt.state is State.RELEASING_ARTIFACTS:
                self._release_artifacts(rt)
            if rt.state is State.POISONED:
                raise SessionCleanupError(
                    f"failed to clean up session {rt.session_id!r}; it is poisoned and its "
                    f"cleanup may be retried: {rt.cleanup_error}"
                ) from rt.cleanup_error

    def _stop_admission(self, rt: SessionRuntime, reason: CloseReason, cancel: bool) -> None:
        state = rt.state
        if state is State.RUNNING or (cancel and state is State.DRAINING):
            rt.machine.apply(Event.CANCEL if cancel else Event.CLOSE)
            if rt.close_reason is None or cancel:
                rt.close_reason = reason if rt.close_reason is not CloseReason.FAILED else rt.close_reason
            if cancel:
                rt.discard_buffers()
                rt.outputs.clear()
            rt.wake()
            self._orch._pump()

    async def _settle_work(self, rt: SessionRuntime, drain_deadline: float, deadline: float) -> None:
        if rt.state is State.DRAINING:
            with trio.move_on_at(drain_deadline):
                while not self._orch._work_settled(rt):
                    await rt.changed.park()
            if not self._orch._work_settled(rt):
                rt.phases.append(("drain", "timed out; cancelling"))
                rt.machine.apply(Event.CANCEL)
                rt.discard_buffers()
                rt.wake()
            else:
                rt.phases.append(("drain", "ok"))
        with trio.move_on_at(deadline):
            while not self._orch._work_settled(rt):
                await rt.changed.park()
        if not self._orch._work_settled(rt):
            self._poison(rt, TimeoutError(f"{len(rt.in_flight)} invocation(s) still running at the deadline"), "settle")
            return
        rt.phases.append(("settle", "ok"))
        rt.discard_buffers()  # inputs that can never be consumed now
        rt.machine.apply(Event.WORK_SETTLED)

    async def _release_stages(self, rt: SessionRuntime, deadline: float) -> None:
        context = SessionContext(rt.session_id, rt.epoch)
        reason = rt.close_reason or CloseReason.CLOSED
        first_error: BaseException | None = None
        for stage_id in reversed(self._orch.spec.topological_order):
            if stage_id in rt.cleaned:
                continue
            actor = self._orch.actors[stage_id]
            if actor.health().state is ActorState.FAILED:
                rt.cleaned.add(stage_id)  # a failed owner holds no usable state and is never reused
                rt.phases.append((f"release:{stage_id}", "skipped: actor failed"))
                continue
            error: BaseException | None = None
            with trio.move_on_at(deadline) as scope:
                try:
                    await actor.close_session(context, reason)
                except Exception as exc:
                    error = exc
            if scope.cancelled_caught:
                error = TimeoutError(f"stage {stage_id!r} did not release session {rt.session_id!r} in time")
            if error is None:
                rt.cleaned.add(stage_id)
                rt.phases.append((f"release:{stage_id}", "ok"))
            else:
                self._orch._counters.cleanup_failures += 1
                rt.phases.append((f"release:{stage_id}", f"failed: {error!r}"))
                first_error = first_error or error
        if first_error is not None:
            self._poison(rt, first_error, None)
        else:
            rt.machine.apply(Event.STAGES_RELEASED)

    def _release_artifacts(self, rt: SessionRuntime) -> None:
        leaks = rt.leaked_slots()
        if leaks:
            self._orch._counters.slot_leaks += leaks
            rt.discard_buffers()
            rt.occupancy.clear()
            rt.producing.clear()
            self._poison(rt, RuntimeError(f"{leaks} artifact slot(s) still held after stage release"), "artifacts")
            return
        rt.phases.append(("artifacts", "ok"))
        rt.machine.apply(table.SETTLE_EVENT[rt.close_reason or CloseReason.CLOSED])
        self._forget(rt)

    def _poison(self, rt: SessionRuntime, error: BaseException, phase: str | None) -> None:
        if phase is not None:
            self._orch._counters.cleanup_failures += 1
            rt.phases.append((phase, f"failed: {error!r}"))
        rt.cleanup_error = error
        if rt.machine.can(Event.CLEANUP_FAILED):
            rt.machine.apply(Event.CLEANUP_FAILED)
        rt.settled.set()
        rt.wake()

    def _forget(self, rt: SessionRuntime) -> None:
        if self._orch._sessions.get(rt.session_id) is rt:
            del self._orch._sessions[rt.session_id]
            for turns in self._orch._turns.values():
                try:
                    turns.remove(rt.session_id)
                except ValueError:
                    pass
        rt.settled.set()
        rt.wake()
