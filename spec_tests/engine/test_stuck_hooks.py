"""What waits behind a stage call or session hook past its ``call_timeout`` ends within its own deadline.

Found by a careless user's pass (7 Dec): a session hook (``session_closer``) that never returned failed its actor on
time, but

- a call of another session queued behind it on the actor's thread was never resolved, so that session's cleanup,
  which begins when it fails, waited its whole 300 s for it, and the session's own close, given 2 s, waited behind
  that cleanup for all of it (``async with orch.session(..., close_timeout=2)`` took 305 s);
- the stuck hook's own close waited its whole close deadline, though the actor had failed long before;
- an ``async`` hook of an actor whose handler is synchronous was never timed at all.

Now the calls queued behind an overrun resolve as failed at once (``ActorFailedError``, the overrun its cause), the
hook's close ends as the actor fails, an ``async`` hook beside the thread has the same deadline, and a close that
finds another shutdown of its session under way waits for it no longer than its own deadline.
"""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from engine import ActorFailedError, LocalStageActor, SessionCleanupError, StageCallTimeout, open_orchestrator

from .actor_helpers import SPEC, join_thread, render
from .test_call_timeout import DEADLINE, LOOK, _pass_time

#: a close deadline far past the call timeout, and far short of a failed session's 300 s cleanup
CLOSE = 3 * DEADLINE


def dynamics(invocation):
    return {"latent": invocation.inputs["control"]}


class StuckHook:
    """A ``session_closer`` (sync or async) that hangs for session ``a`` until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release_thread = threading.Event()
        self.release_task = trio.Event()

    def release(self) -> None:
        self.release_thread.set()
        self.release_task.set()

    def sync(self, context, reason) -> None:
        if context.session_id == "a":
            self.started.set()
            self.release_thread.wait()

    async def run_async(self, context, reason) -> None:
        if context.session_id == "a":
            self.started.set()
            await self.release_task.wait()


async def _close(session, ended: dict[str, float | BaseException | None]) -> None:
    started = trio.current_time()
    try:
        await session.aclose(timeout=CLOSE)
    except SessionCleanupError as exc:
        ended["error"] = exc
    ended["took"] = trio.current_time() - started


@pytest.mark.timeout(60)  # a close that waited for the stuck hook would wait for good (the clock is not moved)
@pytest.mark.parametrize("hook_kind", ["sync", "async"])
async def test_a_session_queued_behind_a_stuck_hook_fails_and_closes_within_its_own_deadline(hook_kind, mock_clock):
    hook = StuckHook()
    actor = LocalStageActor(dynamics, name="dynamics", call_timeout=DEADLINE,
                            session_closer=hook.sync if hook_kind == "sync" else hook.run_async)
    try:
        async with open_orchestrator(SPEC, {"dynamics": actor, "render": LocalStageActor(render)}) as orch:
            a, b = orch.create_session("a"), orch.create_session("b")
            await a.push(0, {"control": 0})
            await a.wait_until_idle()
            a_closed: dict = {}
            b_closed: dict = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_close, a, a_closed)
                await trio.to_thread.run_sync(hook.started.wait)
                hook_started = trio.current_time()
                await b.push(0, {"control": 0})  # on the thread: queued behind the stuck hook (sync), or beside it
                if hook_kind == "async":
                    await b.wait_until_idle()  # its calls ran (in real time, which the clock below does not wait for)
                await _pass_time(mock_clock, lambda: b.error is not None)
                failed_after = trio.current_time() - hook_started
                assert DEADLINE <= failed_after <= DEADLINE + 2 * LOOK, failed_after
                assert isinstance(b.error, ActorFailedError) and isinstance(b.error.__cause__, StageCallTimeout), b.error
                nursery.start_soon(_close, b, b_closed)
                await _pass_time(mock_clock, lambda: "took" in a_closed and "took" in b_closed)
            # the stuck hook's session: poisoned as its actor failed, not at its close deadline
            assert a_closed["took"] <= DEADLINE + 2 * LOOK, a_closed
            assert "ran past its call_timeout of 30 s" in str(a_closed["error"]), a_closed
            # the session behind it: its cleanup was not held by a call that would never run (it waited 300 s)
            assert b_closed["took"] <= 2 * LOOK, b_closed
            assert b_closed.get("error") is None, b_closed
            assert b.status.value == "failed", b.status
    finally:
        hook.release()
    await join_thread(actor)


async def test_a_close_behind_another_shutdown_of_its_session_waits_no_longer_than_its_own_deadline(autojump_clock):
    """A failed session's cleanup runs in the background with 300 s to settle its work; a close of the session
    meanwhile waited for it, past its own deadline, and said nothing. Here the work never settles (a call that runs
    until the test ends, with no ``call_timeout``): the close ends at its own deadline, saying why."""
    release = trio.Event()

    async def stuck_at_one(invocation):
        if invocation.key.sequence_id == 1:
            await release.wait()
        return {"latent": invocation.inputs["control"]}

    async def render_fails(invocation):
        raise RuntimeError("render broke")

    async with open_orchestrator(SPEC, {"dynamics": LocalStageActor(stuck_at_one, mailbox_capacity=2),
                                        "render": LocalStageActor(render_fails)}) as orch:
        session = orch.create_session("s")
        await session.push(0, {"control": 0})
        await session.push(1, {"control": 1})  # dynamics' call for 1 hangs; render's for 0 fails the session
        await trio.testing.wait_all_tasks_blocked()
        assert session.error is not None and "render broke" in str(session.error), session.error
        closed: dict = {}
        await _close(session, closed)
        assert CLOSE <= closed["took"] <= CLOSE + 1, closed
        assert "still being shut down by another call" in str(closed["error"]), closed
        release.set()
