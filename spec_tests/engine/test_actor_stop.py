"""Closing a stage actor, and a stage actor whose task has ended, which takes no more work: what reaches it
then fails at once.

When the actor's task ends (its nursery is cancelled, as an app's shutdown does), its thread is told to
stop behind the call it is running. A session hook or an invocation handed to the actor after that would
be queued behind the stop, where it never runs, and its caller would wait for it until its own deadline
(a shutdown's, 300 s by default). It is refused instead, as a closed actor refuses work.
"""

from __future__ import annotations

import threading
from typing import Any

import outcome

import pytest
import trio
import trio.testing

from engine import open_orchestrator
from engine.actors import ActorHealth, LocalStageActor, SessionContext, StageInvocation
from engine.errors import ActorFailedError
from engine.threads import DedicatedThread, ThreadStopped
from states.pipeline_session import CloseReason, State
from states.stage_actor import State as ActorState

from .conftest import canonical_spec, chunk
from .actor_helpers import GATE_TIMEOUT, Completions, Gates, make_invocation, thread_names

PROMPTLY = 5.0  # a refusal is immediate; this only turns the old wait into a failure


async def test_work_handed_to_an_actor_whose_task_ended_is_refused_at_once() -> None:
    entered, gate = threading.Event(), threading.Event()
    hooks: list[SessionContext] = []

    def handler(invocation: Any) -> dict[str, Any]:
        entered.set()
        assert gate.wait(GATE_TIMEOUT)
        return {"y": invocation.key.sequence_id}

    actor = LocalStageActor(handler, name="gated", session_closer=lambda context, reason: hooks.append(context))
    done = Completions()
    running = make_invocation("s1", 0)
    try:
        async with trio.open_nursery() as nursery:
            task = trio.CancelScope()

            async def run_actor(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with task:
                    await actor.run(task_status=task_status)

            await nursery.start(run_actor)
            actor.submit(running, done)
            await trio.to_thread.run_sync(entered.wait, GATE_TIMEOUT)  # the call runs on the actor's thread
            task.cancel()  # the actor's task ends; its thread is told to stop behind the running call
            await trio.testing.wait_all_tasks_blocked()

            with trio.fail_after(PROMPTLY), pytest.raises(ActorFailedError, match="closed"):
                await actor.close_session(SessionContext("s1", 1), CloseReason.SHUTDOWN)
            with pytest.raises(ActorFailedError, match="closed"):
                actor.submit(make_invocation("s1", 1), done)
            gate.set()
            await done.wait(running)  # the call that was running still finishes and is delivered
    finally:
        gate.set()
    assert hooks == []
    assert actor.health().pending_invocations == 0
    assert list(done.results) == [running.key]


async def test_a_dedicated_thread_told_to_stop_takes_no_more_calls() -> None:
    thread = DedicatedThread("stopping")
    thread.start()
    assert await thread.call(lambda: 41 + 1) == 42
    thread.request_stop()
    with pytest.raises(ThreadStopped, match="told to stop"):
        thread.submit(lambda: None, (), lambda result: None)
    with trio.fail_after(PROMPTLY), pytest.raises(ThreadStopped):
        await thread.call(lambda: None)
    await thread.stop()


async def test_a_cancelled_orchestrator_still_releases_its_sessions_through_live_actors() -> None:
    """An app's shutdown cancels the scope around ``open_orchestrator``: the sessions' ordered shutdown still runs
    every stage's hook, downstream first, through actors that are still running (they are closed after it)."""
    released: list[tuple[str, CloseReason]] = []

    def stage(name: str, consumes: str, produces: str) -> LocalStageActor:
        def closer(context: SessionContext, reason: CloseReason) -> None:
            released.append((name, reason))

        return LocalStageActor(lambda inv: {produces: inv.inputs[consumes]}, name=name, session_closer=closer)

    actors = {"encode": stage("encode", "image", "condition"), "denoise": stage("denoise", "condition", "latent"),
              "decode": stage("decode", "latent", "frames")}
    with trio.fail_after(PROMPTLY):
        with trio.CancelScope() as around:
            async with open_orchestrator(canonical_spec(), actors) as orch:
                session = orch.create_session("a")
                await session.push(0, chunk(0))
                around.cancel()
                await trio.sleep_forever()  # the cancel lands here
    assert around.cancelled_caught
    assert released == [(stage_id, CloseReason.SHUTDOWN) for stage_id in ("decode", "denoise", "encode")]
    assert session.status is State.CLOSED and session.cleanup_error is None


# -- LocalStageActor: close ---------------------------------------------------------------


async def test_aclose_finishes_queued_work_stops_the_thread_and_is_idempotent(
    nursery: trio.Nursery,
) -> None:
    gates = Gates()
    ran: list[int] = []

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        gates.wait(invocation)
        ran.append(invocation.key.sequence_id)
        return {"y": invocation.key.sequence_id}

    done = Completions()
    actor = LocalStageActor(handler, name="closing-actor-under-test", mailbox_capacity=3)
    closed = trio.Event()

    async def close() -> None:
        await actor.aclose()
        closed.set()

    try:
        await nursery.start(actor.run)
        ident = actor.thread_ident
        assert "closing-actor-under-test" in thread_names()
        invocations = [make_invocation("s1", i) for i in range(3)]
        for inv in invocations:
            actor.submit(inv, done)
        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        assert not closed.is_set()  # queued work is still running
        with pytest.raises(ActorFailedError, match="closed"):
            actor.submit(make_invocation("s2", 0), done)  # no new work once closing
        for inv in invocations:
            gates.open(inv.key.session_id, inv.key.sequence_id)
        await closed.wait()
    finally:
        gates.open_all()

    assert ran == [0, 1, 2]
    assert done.order == [inv.key for inv in invocations]
    assert all(isinstance(done.results[inv.key], outcome.Value) for inv in invocations)
    assert actor.health() == ActorHealth(ActorState.CLOSED, 0)
    assert "closing-actor-under-test" not in thread_names()
    assert ident not in {t.ident for t in threading.enumerate() if t.name == "closing-actor-under-test"}
    await actor.aclose()  # idempotent
    await actor.aclose()
    assert actor.health().state is ActorState.CLOSED
    with pytest.raises(ActorFailedError, match="closed"):
        actor.submit(make_invocation("s3", 0), done)


async def test_concurrent_aclose_calls_all_return(nursery: trio.Nursery) -> None:
    actor = LocalStageActor(lambda inv: {"y": 0}, name="concurrent-close-actor")
    await nursery.start(actor.run)
    async with trio.open_nursery() as closers:
        for _ in range(3):
            closers.start_soon(actor.aclose)
    assert actor.health().state is ActorState.CLOSED
    assert "concurrent-close-actor" not in thread_names()


async def test_aclose_before_run_closes_without_a_thread() -> None:
    actor = LocalStageActor(lambda inv: {"y": 0})
    await actor.aclose()
    assert actor.health() == ActorHealth(ActorState.CLOSED, 0)
    assert actor.thread_ident is None
    with pytest.raises(ActorFailedError):
        actor.submit(make_invocation(), Completions())
