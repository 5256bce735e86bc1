"""A session's ordered shutdown, phase by phase, as the pipeline-session table drives it.

1. stop admission (the stop event picks the stop state, and with it the outcome);
2. wait until the session's work settles (a running call is never interrupted);
3. run every stage's session hook through its owning actor, in reverse topological order;
4. verify that no artifact slot or reservation remains (a leak is counted and poisons the session);
5. settle as the stop state decided.

Every phase is bounded by the caller's deadline and recorded in ``rt.phases``.
A failed phase leaves the session POISONED; running the shutdown again retries
only the stages that have not been released. Which phase runs next is asked of
the table (``machine.can``), never decided beside it.
"""

from __future__ import annotations

import contextlib

import trio

from states import pipeline_session as table

from .actors import SessionContext
from .core import SchedulerCore
from .errors import SessionCleanupError, carries, message_of, seconds, shown
from .runtime import SessionRuntime

__all__ = ["SessionShutdown"]

Event = table.Event
# Stops a session's holder asks for (aclose, cancel, a session block's exit): cut short by the holder's own
# cancellation, nothing else would finish them before the orchestrator closes. (An orchestrator's close is finished
# by its next close or its exit; a failed session's cleanup runs in the orchestrator's nursery.) A lifecycle lock
# held by another call means that call drives the shutdown.
_ASKED_BY_THE_HOLDER = frozenset({Event.CLOSE, Event.CANCEL})


class SessionShutdown:
    """Runs the shutdowns of one scheduler core's sessions, through the core's shutdown interface."""

    def __init__(self, core: SchedulerCore) -> None:
        self._core = core

    async def run(
        self,
        rt: SessionRuntime,
        stop: table.Event | None,
        *,
        timeout: float,
        drain_timeout: float | None = None,
    ) -> None:
        """Run the session's ordered shutdown; raises SessionCleanupError if it ends poisoned.

        ``stop`` is the event that stops admission (None: the session already stopped,
        e.g. it failed); a drain may use ``drain_timeout`` (default half of ``timeout``),
        so that an overrunning drain leaves time to release the stages.
        """
        # checked before anything changes: a NaN or a string found later would fail the shutdown halfway
        seconds("timeout", timeout, zero_ok=True)
        if drain_timeout is not None:
            seconds("drain_timeout", drain_timeout, zero_ok=True)
        now = trio.current_time()
        deadline = now + timeout
        drain_deadline = min(deadline, now + (timeout / 2 if drain_timeout is None else drain_timeout))
        if stop in table.PREEMPTS_SHUTDOWN:  # now, not once a drain under way ended (the table decides)
            self._core.stop(rt, stop)
        try:
            await self._run_locked(rt, stop, drain_deadline, deadline)
        except trio.Cancelled:
            # the caller's cancellation: nobody else drives this shutdown (a drain cut here stayed DRAINING, its
            # buffers held and its id taken until the orchestrator closed), so it ends here as a cancel, shielded,
            # within the same deadline; then the cancellation goes on
            if stop in _ASKED_BY_THE_HOLDER and not rt.machine.is_terminal and not rt.lifecycle_lock.locked():
                if rt.machine.can(Event.DRAIN_TIMED_OUT):  # a drain was under way
                    rt.phases.append(("drain", "cut short: its caller was cancelled"))
                finish = Event.CANCEL if rt.machine.can(Event.CANCEL) else None  # None: a cancel already under way
                with trio.CancelScope(shield=True):
                    with contextlib.suppress(SessionCleanupError):  # poisoned: its status says so, a retry is open
                        await self.run(rt, finish, timeout=max(0.0, deadline - trio.current_time()))
            raise

    async def _run_locked(self, rt: SessionRuntime, stop: table.Event | None, drain_deadline: float, deadline: float) -> None:
        if not rt.lifecycle_lock.locked():
            await rt.lifecycle_lock.acquire()
        else:  # another shutdown of it runs (a close elsewhere, or a failed session's cleanup in the background)
            with trio.move_on_at(deadline) as waiting:
                await rt.lifecycle_lock.acquire()
            if waiting.cancelled_caught:  # it waited out that one's deadline (a failed session's is 300 s) in silence
                raise SessionCleanupError(
                    f"session {rt.session_id!r} was still being shut down by another call (a close elsewhere, or the "
                    f"cleanup that runs once it fails) at this close's deadline; close it again to wait for that one"
                )
        try:
            await self._run_phases(rt, stop, drain_deadline, deadline)
        finally:
            rt.lifecycle_lock.release()

    async def _run_phases(self, rt: SessionRuntime, stop: table.Event | None, drain_deadline: float, deadline: float) -> None:
        if rt.machine.is_terminal:
            return
        retrying = rt.machine.can(Event.RETRY_CLEANUP)
        if stop is not None:
            self._core.stop(rt, stop)
        if rt.machine.can(Event.WORK_SETTLED):
            await self._settle_work(rt, drain_deadline, deadline)
        if retrying:
            await self._retry(rt, deadline)
        if rt.machine.can(Event.STAGES_RELEASED):
            await self._release_stages(rt, deadline)
        if rt.machine.can(rt.machine.settle_event):
            self._release_artifacts(rt)
        if rt.machine.can(Event.RETRY_CLEANUP):
            raise SessionCleanupError(
                f"failed to clean up session {rt.session_id!r}; it is poisoned and its "
                f"cleanup may be retried: {_last_failure(rt)}"
            ) from rt.cleanup_error

    async def _wait_settled(self, rt: SessionRuntime, deadline: float) -> bool:
        with trio.move_on_at(deadline):  # stops the waiting, not the running calls
            await self._core.wait_until(rt.changed, lambda: self._core.work_settled(rt))
        return self._core.work_settled(rt)

    async def _settle_work(self, rt: SessionRuntime, drain_deadline: float, deadline: float) -> None:
        if rt.machine.can(Event.DRAIN_TIMED_OUT):
            settled = await self._wait_settled(rt, drain_deadline)
            if not rt.machine.can(Event.DRAIN_TIMED_OUT):  # a cancel (or a failure) cut the drain short
                rt.phases.append(("drain", f"cut short: {rt.state.value}"))
            elif settled:
                rt.phases.append(("drain", _drained(rt)))
            elif self._core.stop(rt, Event.DRAIN_TIMED_OUT):
                rt.phases.append(("drain", "timed out; cancelling"))
        if not await self._wait_settled(rt, deadline):
            count = len(rt.reservations)
            self._poison(rt, TimeoutError(f"{count} invocation(s) still running at the deadline"), "settle")
            return
        rt.phases.append(("settle", "ok"))
        self._core.drop_buffers(rt)
        self._core.advance(rt, Event.WORK_SETTLED)

    async def _retry(self, rt: SessionRuntime, deadline: float) -> None:
        """Re-enter stage release, once no call from the timed-out attempt still runs."""
        with trio.move_on_at(deadline):  # stops the wait for the timed-out calls
            await self._core.wait_until(rt.changed, lambda: not rt.reservations)
        if rt.reservations:
            self._poison(rt, TimeoutError("work still in flight; cleanup not retried"), "retry")
        else:
            rt.phases.append(("retry", "started"))
            self._core.advance(rt, Event.RETRY_CLEANUP)

    async def _release_stages(self, rt: SessionRuntime, deadline: float) -> None:
        context = SessionContext(rt.session_id, rt.epoch)
        reason = rt.hook_reason
        first_error: BaseException | None = None
        for stage_id in reversed(self._core.topological_order):
            if stage_id in rt.cleaned:
                continue
            actor = self._core.actor(stage_id)
            if actor.health().failed:
                rt.cleaned.add(stage_id)  # a failed owner holds no usable state and is never reused
                rt.phases.append((f"release:{stage_id}", "skipped: actor failed"))
                continue
            error: BaseException | None = None
            with trio.move_on_at(deadline) as release_deadline:
                try:
                    await actor.close_session(context, reason)
                except BaseException as exc:  # a hook's sys.exit() too: its session is poisoned, not the orchestrator
                    if carries(exc, trio.Cancelled):
                        raise
                    error = exc
            if release_deadline.cancelled_caught:
                error = TimeoutError(f"stage {stage_id!r} did not release session {rt.session_id!r} in time")
            if error is None:
                rt.cleaned.add(stage_id)
                rt.phases.append((f"release:{stage_id}", "ok"))
            else:
                self._core.count_cleanup_failure()
                rt.phases.append((f"release:{stage_id}", f"failed: {shown(error, limit=None)}"))
                first_error = first_error or error
        if first_error is not None:
            self._poison(rt, first_error, None)
        else:
            self._core.advance(rt, Event.STAGES_RELEASED)

    def _release_artifacts(self, rt: SessionRuntime) -> None:
        leaks = self._core.check_released(rt)
        if leaks:
            self._poison(rt, RuntimeError(f"{leaks} artifact slot(s) or reservation(s) still held after stage release"), "artifacts")
            return
        rt.phases.append(("artifacts", "ok"))
        self._core.advance(rt, rt.machine.settle_event)
        self._core.forget(rt)
        rt.settled.set()
        rt.wake()

    def _poison(self, rt: SessionRuntime, error: BaseException, phase: str | None) -> None:
        if phase is not None:
            self._core.count_cleanup_failure()
            rt.phases.append((phase, f"failed: {shown(error, limit=None)}"))
        rt.cleanup_error = error
        if rt.machine.can(Event.CLEANUP_FAILED):
            self._core.advance(rt, Event.CLEANUP_FAILED)
        rt.settled.set()
        rt.wake()


#: the sequences a drain names that never ran (how many there were is told in full)
NEVER_RAN_NAMED = 5


def _drained(rt: SessionRuntime) -> str:
    """A drain that ended with nothing left to run: ``ok``, and which accepted sequences never ran (an input they
    need never came: a sequence pushed past a gap, one artifact of two), which the drain drops (it said ``ok`` alone,
    and they were gone without a word)."""
    never_ran = sorted({seq for seq, _ in rt.slots})
    if not never_ran:
        return "ok"
    named = ", ".join(map(str, never_ran[:NEVER_RAN_NAMED])) + (", ..." if len(never_ran) > NEVER_RAN_NAMED else "")
    return f"ok; {len(never_ran)} accepted sequence(s) never ran, an input they need never came: {named}"


def _last_failure(rt: SessionRuntime) -> str:
    """Each phase that failed in the last attempt and how (``release:decode failed: RuntimeError('...')``), naming the
    stage (the last alone was named: with two stages' hooks failing, the other was left out)."""
    attempt = max((index for index, (phase, _) in enumerate(rt.phases) if phase == "retry"), default=-1)
    failed = [f"{phase} {outcome}" for phase, outcome in rt.phases[attempt + 1:] if outcome.startswith("failed")]
    return "; ".join(failed) if failed else message_of(rt.cleanup_error) if rt.cleanup_error is not None else "None"
