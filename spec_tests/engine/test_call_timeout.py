"""A stage call that never returns, seen through the public API: with a ``call_timeout`` its actor fails.

Without one, a handler stuck in model code (a deadlock, a hung device) held every session of its actor, their
outputs silent, until the sessions' own deadlines; the actor still said it was running. With one, the actor fails
once a call has run that long (never earlier), every session on it fails with the call named as the cause, and the
stuck call keeps its thread until it returns.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import weakref
from collections.abc import Callable

import pytest
import trio
import trio.testing

from engine import ActorFailedError, LocalStageActor, SessionCleanupError, StageCallTimeout, open_orchestrator
from engine.call_watch import LOOK_PERIOD_MAX

from .actor_helpers import SPEC, join_thread, render

DEADLINE = 30.0
LOOK = min(DEADLINE / 8, LOOK_PERIOD_MAX)


class StuckCall:
    """A ``dynamics`` handler (sync or async) whose call for ``(session, seq)`` waits until released (made in trio)."""

    def __init__(self, session: str, seq: int, clock: trio.testing.MockClock) -> None:
        self.at = (session, seq)
        self.clock = clock
        self.started = threading.Event()
        self.started_at = math.nan  # on the test's virtual clock
        self.release_thread = threading.Event()
        self.release_task = trio.Event()

    def release(self) -> None:
        self.release_thread.set()
        self.release_task.set()

    def __enter__(self) -> StuckCall:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()  # before the orchestrator closes, which waits for the call (on a clock that does not move)

    def is_stuck(self, invocation) -> bool:
        return (invocation.key.session_id, invocation.key.sequence_id) == self.at

    def sync(self, invocation):
        if self.is_stuck(invocation):
            self.started_at = self.clock.current_time()
            self.started.set()
            self.release_thread.wait()
        return {"latent": invocation.inputs["control"]}

    async def run_async(self, invocation):
        if self.is_stuck(invocation):
            self.started_at = self.clock.current_time()
            self.started.set()
            await self.release_task.wait()
        return {"latent": invocation.inputs["control"]}


async def _drain(session, into: list) -> None:
    async for seq, _ in session.outputs():
        into.append(seq)


async def _pass_time(clock: trio.testing.MockClock, until: Callable[[], bool]) -> None:
    """Move the (manual) clock half a look at a time until ``until()``: every task sees each step, and no step
    passes while a thread's result is on its way (an autojumping clock would, and close deadlines with it)."""
    while not until():
        assert trio.current_time() < 4 * DEADLINE, "nothing happened long past the call timeout"
        clock.jump(LOOK / 2)
        await trio.testing.wait_all_tasks_blocked()


@pytest.mark.timeout(60)  # a close that waited for the stuck call would wait for good (the clock is not moved)
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_call_past_its_call_timeout_fails_its_actor_and_every_session_on_it(kind, mock_clock):
    stuck = StuckCall("a", 0, mock_clock)
    handler = stuck.sync if kind == "sync" else stuck.run_async
    dynamics = LocalStageActor(handler, name="dynamics", call_timeout=DEADLINE)
    async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(render)}) as orch:
        try:
            a, b = orch.create_session("a"), orch.create_session("b")
            got: dict[str, list[int]] = {"a": [], "b": []}
            async with trio.open_nursery() as readers:
                readers.start_soon(_drain, a, got["a"])
                readers.start_soon(_drain, b, got["b"])
                await a.push(0, {"control": 0})
                await b.push(0, {"control": 0})  # its call waits behind the stuck one: one call at a time
                await trio.to_thread.run_sync(stuck.started.wait)
                await _pass_time(mock_clock, lambda: a.error is not None)
            failed_after = trio.current_time() - stuck.started_at
            assert DEADLINE <= failed_after <= DEADLINE + 2 * LOOK  # never early, at most a look or two late
            assert got == {"a": [], "b": []}
            for session in (a, b):
                assert isinstance(session.error, ActorFailedError)
                cause = session.error.__cause__
                assert isinstance(cause, StageCallTimeout)
                assert "call for session 'a', sequence 0 ran past its call_timeout of 30 s" in str(cause)
            health = dynamics.health()
            assert not health.healthy and "ran past its call_timeout of 30 s" in health.failure_reason
        except BaseException:
            stuck.release()  # a failed check: let the close end however it is made
            raise
        # the orchestrator closes without waiting for the stuck call (on this clock a wait would never end)
    stuck.release()  # the abandoned thread returns at last; its result counts for nothing
    if kind == "sync":
        await join_thread(dynamics)


async def test_a_call_inside_its_call_timeout_leaves_the_actor_running(mock_clock):
    """A call that takes most of its deadline is not failed (a manual clock: the call's end is a thread's, in real
    time, and an autojumping clock could pass the deadline while the result travels)."""
    stuck = StuckCall("a", 0, mock_clock)
    dynamics = LocalStageActor(stuck.sync, name="dynamics", call_timeout=DEADLINE)
    async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(render)}) as orch:
        with stuck:
            a = orch.create_session("a", final_sequence_id=1)
            await a.push(0, {"control": 0})
            await trio.to_thread.run_sync(stuck.started.wait)
            await _pass_time(mock_clock, lambda: trio.current_time() >= DEADLINE - LOOK)
            stuck.release()
            await a.push(1, {"control": 1})
            got: list[int] = []
            await _drain(a, got)
            assert got == [0, 1] and a.error is None
            mock_clock.jump(3 * DEADLINE)  # long after, with no call running: nothing to fail
            await trio.testing.wait_all_tasks_blocked()
            assert dynamics.health().healthy


@pytest.mark.parametrize("bad", [0, -1, "30", True, math.nan, math.inf])
def test_a_bad_call_timeout_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="call_timeout must be a finite number of seconds > 0"):
        LocalStageActor(render, call_timeout=bad)


@pytest.mark.timeout(60)  # a close that waited for the stuck hook would wait for good (the clock is not moved)
@pytest.mark.parametrize("closer_kind", ["sync", "async"])
async def test_a_session_hook_past_the_call_timeout_fails_the_actor_not_every_session_silently(closer_kind, mock_clock):
    """A ``session_closer`` runs where the calls run, ahead of those queued behind it: one that never returned (a
    deadlocked library freeing a session's cache) held every other session of its actor, outputs silent and no
    error, whatever the ``call_timeout``. It is timed as a call is: the actor fails and the others fail naming it."""
    started, release_thread, release_task = threading.Event(), threading.Event(), trio.Event()

    def sync_closer(context, reason) -> None:
        if context.session_id == "a":
            started.set()
            release_thread.wait()

    async def async_closer(context, reason) -> None:
        if context.session_id == "a":
            started.set()
            await release_task.wait()

    def release() -> None:
        release_thread.set()
        release_task.set()

    async def render_async(invocation):
        return render(invocation)

    # an async closer runs in the actor's task, which an async handler has; a sync one on the actor's thread
    dynamics = LocalStageActor(
        (lambda invocation: {"latent": invocation.inputs["control"]}) if closer_kind == "sync" else render_dynamics,
        name="dynamics", call_timeout=DEADLINE, session_closer=sync_closer if closer_kind == "sync" else async_closer,
    )
    try:
        async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(render_async)}) as orch:
            a, b = orch.create_session("a"), orch.create_session("b")
            async with trio.open_nursery() as nursery:
                await a.push(0, {"control": 0})
                await a.wait_until_idle()
                nursery.start_soon(_closed_anyhow, a)
                await trio.to_thread.run_sync(started.wait)
                await b.push(0, {"control": 0})  # queued behind the hook
                await _pass_time(mock_clock, lambda: b.error is not None)
                assert isinstance(b.error, ActorFailedError), b.error
                assert isinstance(b.error.__cause__, StageCallTimeout)
                assert "its session_closer for session 'a' ran past its call_timeout of 30 s" in str(b.error.__cause__)
                assert not dynamics.health().healthy
                release()
    finally:
        release()
    if closer_kind == "sync":
        await join_thread(dynamics)


async def render_dynamics(invocation):
    return {"latent": invocation.inputs["control"]}


async def _closed_anyhow(session) -> None:
    """Close ``session``, whose hook hangs: its close fails once the actor has (it is poisoned, as a failed one is)."""
    with contextlib.suppress(SessionCleanupError):
        await session.aclose(timeout=4 * DEADLINE)


class Payload:
    """A stand-in for a tensor: weakly referenceable."""


async def test_a_watched_call_keeps_none_of_its_inputs_once_it_ended(mock_clock):
    """The watch kept the last call it saw running (its invocation, so its inputs) until the actor's next long call:
    a closed session's tensors for good, on an actor that serves no more."""
    stuck = StuckCall("a", 0, mock_clock)
    dynamics = LocalStageActor(stuck.sync, name="dynamics", call_timeout=DEADLINE)
    actors = {"dynamics": dynamics, "render": LocalStageActor(lambda inv: {"frames": 0})}
    async with open_orchestrator(SPEC, actors) as orch:
        with stuck:
            a = orch.create_session("a", final_sequence_id=0)
            control = Payload()
            kept = weakref.ref(control)
            await a.push(0, {"control": control})
            del control
            await trio.to_thread.run_sync(stuck.started.wait)
            await _pass_time(mock_clock, lambda: trio.current_time() >= 3 * LOOK)  # the watch sees the call running
            stuck.release()
            await _drain(a, [])
            await a.aclose()
            await orch.barrier()
            await _pass_time(mock_clock, lambda: trio.current_time() >= 6 * LOOK)  # and then none
            gc.collect()
            assert kept() is None, "the watch still holds the call's input"
