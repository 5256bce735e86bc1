"""Stage actors (reference A.11, A.12, F.24): one owner, one thread, one bounded mailbox.

Synchronous handlers are held at a ``threading.Event`` gate when a test needs
work to stay in flight; the trio side synchronises only through trio events
(set from the completion callbacks) and ``wait_all_tasks_blocked``.
"""

from __future__ import annotations

import threading
from typing import Any

import outcome
import pytest
import trio
import trio.testing

from engine.actors import (
    ActorHealth,
    LocalStageActor,
    SessionContext,
    StageInvocation,
    TaskKey,
)
from engine.errors import ActorBusyError, ActorFailedError, FatalStageError
from states.pipeline_session import CloseReason
from states.stage_actor import State

from .actor_helpers import Completions, Gates, make_invocation, started, thread_names


# -- LocalStageActor: threads and tasks ------------------------------------------


async def test_sync_handler_runs_on_one_dedicated_thread(nursery: trio.Nursery) -> None:
    idents: list[int] = []

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        idents.append(threading.get_ident())
        return {"y": invocation.inputs["x"] * 2}

    done = Completions()
    actor = LocalStageActor(handler, name="dedicated-thread-actor", mailbox_capacity=10)
    trio_thread = threading.get_ident()
    async with started(actor, nursery):
        assert actor.thread_ident is not None
        assert actor.thread_ident != trio_thread
        for batch in range(3):
            for session in ("s1", "s2", "s3"):
                for seq in range(3):
                    actor.submit(make_invocation(session, batch * 3 + seq), done)
            await actor.barrier()
        assert len(idents) == 27
        assert set(idents) == {actor.thread_ident}
        assert trio_thread not in idents
    assert len(done.results) == 27
    assert all(r == outcome.Value({"y": k.sequence_id * 2}) for k, r in done.results.items())
    # completions come back in the trio thread
    assert done.callback_threads == {trio_thread}


async def test_async_handler_runs_in_the_actor_task(nursery: trio.Nursery) -> None:
    tasks: list[trio.lowlevel.Task] = []
    idents: list[int] = []

    async def handler(invocation: StageInvocation) -> dict[str, Any]:
        await trio.lowlevel.checkpoint()
        tasks.append(trio.lowlevel.current_task())
        idents.append(threading.get_ident())
        return {"y": invocation.inputs["x"]}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=4)
    async with started(actor, nursery):
        assert actor.thread_ident is None  # no thread for an async-only actor
        (actor_task,) = nursery.child_tasks
        for seq in range(4):
            actor.submit(make_invocation(f"s{seq % 2}", seq), done)
        await actor.barrier()
    assert len(tasks) == 4
    assert set(tasks) == {actor_task}
    assert trio.lowlevel.current_task() not in tasks
    assert set(idents) == {threading.get_ident()}
    assert all(isinstance(r, outcome.Value) for r in done.results.values())


async def test_sync_closer_gives_an_async_handler_a_thread(nursery: trio.Nursery) -> None:
    closer_threads: list[int] = []

    async def handler(invocation: StageInvocation) -> dict[str, Any]:
        return {"y": 1}

    def closer(context: SessionContext, reason: CloseReason) -> None:
        closer_threads.append(threading.get_ident())

    actor = LocalStageActor(handler, session_closer=closer)
    async with started(actor, nursery):
        assert actor.thread_ident is not None
        await actor.close_session(SessionContext("s1", 1), CloseReason.CLOSED)
        assert closer_threads == [actor.thread_ident]


# -- LocalStageActor: mailbox ------------------------------------------------------


async def test_submit_beyond_mailbox_capacity_is_busy_and_counts_nothing(nursery: trio.Nursery) -> None:
    gates = Gates()
    calls: list[TaskKey] = []

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        calls.append(invocation.key)
        gates.wait(invocation)
        return {"y": 0}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=1)
    try:
        async with started(actor, nursery):
            first, second, third = (make_invocation("s1", i) for i in range(3))
            actor.submit(first, done)
            await trio.testing.wait_all_tasks_blocked()
            actor.submit(second, done)  # one call running, one waiting: the mailbox is full
            assert actor.health().pending_invocations == 2
            with pytest.raises(ActorBusyError, match="mailbox is full"):
                actor.submit(third, done)
            assert actor.health() == ActorHealth(State.RUNNING, 2)
            gates.open("s1", 0)
            gates.open("s1", 1)
            await actor.barrier()
            assert actor.health() == ActorHealth(State.RUNNING, 0)
    finally:
        gates.open_all()
    assert calls == [first.key, second.key]
    assert done.order == [first.key, second.key]
    assert third.key not in done.results


async def test_async_actor_mailbox_is_bounded_too(nursery: trio.Nursery) -> None:
    release = {seq: trio.Event() for seq in range(3)}
    calls: list[int] = []

    async def handler(invocation: StageInvocation) -> dict[str, Any]:
        calls.append(invocation.key.sequence_id)
        await release[invocation.key.sequence_id].wait()
        return {"y": invocation.key.sequence_id}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=1)
    async with started(actor, nursery):
        first, second, third = (make_invocation("s1", i) for i in range(3))
        actor.submit(first, done)
        await trio.testing.wait_all_tasks_blocked()
        assert calls == [0]  # the actor is inside the first call
        actor.submit(second, done)
        with pytest.raises(ActorBusyError):
            actor.submit(third, done)
        assert actor.health().pending_invocations == 2
        release[0].set()
        release[1].set()
        await actor.barrier()
    assert calls == [0, 1]
    assert done.order == [first.key, second.key]


def test_mailbox_capacity_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="mailbox_capacity"):
        LocalStageActor(lambda inv: {}, mailbox_capacity=0)


# -- LocalStageActor: failures -------------------------------------------------------


async def test_handler_exception_fails_only_that_invocation(nursery: trio.Nursery) -> None:
    def handler(invocation: StageInvocation) -> dict[str, Any]:
        if invocation.key.sequence_id == 1:
            raise ValueError("bad chunk 1")
        return {"y": invocation.key.sequence_id}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=3)
    async with started(actor, nursery):
        invocations = [make_invocation("s1", i) for i in range(3)]
        for inv in invocations:
            actor.submit(inv, done)
        await actor.barrier()
        failed = done.results[invocations[1].key]
        assert isinstance(failed, outcome.Error)
        assert isinstance(failed.error, ValueError)
        assert str(failed.error) == "bad chunk 1"
        assert done.results[invocations[0].key] == outcome.Value({"y": 0})
        assert done.results[invocations[2].key] == outcome.Value({"y": 2})
        # F.24: an ordinary handler exception never marks the actor unhealthy
        health = actor.health()
        assert health == ActorHealth(State.RUNNING, 0, None)
        assert health.healthy
        later = make_invocation("s2", 0)
        actor.submit(later, done)
        assert await done.wait(later) == outcome.Value({"y": 0})


async def test_fatal_stage_error_fails_the_actor(nursery: trio.Nursery) -> None:
    def handler(invocation: StageInvocation) -> dict[str, Any]:
        raise FatalStageError("cuda context lost")

    done = Completions()
    actor = LocalStageActor(handler, name="fatal-actor", mailbox_capacity=2)
    async with started(actor, nursery):
        fatal = make_invocation("s1", 0)
        actor.submit(fatal, done)
        result = await done.wait(fatal)
        assert isinstance(result, outcome.Error)
        assert isinstance(result.error, FatalStageError)

        health = actor.health()
        assert health.state is State.FAILED
        assert not health.healthy
        assert health.pending_invocations == 0
        assert health.failure_reason == "FatalStageError: cuda context lost"
        with pytest.raises(ActorFailedError, match="cuda context lost"):
            actor.submit(make_invocation("s2", 0), done)
        assert actor.health().pending_invocations == 0
    # closing a failed actor keeps it FAILED with its reason
    assert actor.health().state is State.FAILED
    assert actor.health().failure_reason == "FatalStageError: cuda context lost"
    assert "fatal-actor" not in thread_names()


async def test_work_queued_behind_a_fatal_error_never_runs(nursery: trio.Nursery) -> None:
    """A failed actor "runs no more work (queued items resolve as failed)" (engine/actors.py, A.11)."""
    gates = Gates()
    calls: list[TaskKey] = []

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        gates.wait(invocation)
        calls.append(invocation.key)
        if invocation.key.session_id == "s1":
            raise FatalStageError("cuda context lost")
        return {"y": 1}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=2)
    try:
        async with started(actor, nursery):
            fatal, queued = make_invocation("s1", 0), make_invocation("s2", 0)
            actor.submit(fatal, done)
            actor.submit(queued, done)
            gates.open("s1", 0)
            gates.open("s2", 0)
            await actor.barrier()
    finally:
        gates.open_all()
    assert isinstance(done.results[fatal.key], outcome.Error)
    queued_result = done.results[queued.key]
    assert isinstance(queued_result, outcome.Error)
    assert isinstance(queued_result.error, ActorFailedError)
    assert "cuda context lost" in str(queued_result.error)
    assert calls == [fatal.key], "the handler ran again after the actor failed"


# -- LocalStageActor: session close ---------------------------------------------------


async def test_session_closer_runs_on_the_actor_thread_after_earlier_invocations(
    nursery: trio.Nursery,
) -> None:
    gates = Gates()
    log: list[tuple] = []
    closer_calls: list[tuple[SessionContext, CloseReason, int]] = []
    handler_threads: set[int] = set()

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        handler_threads.add(threading.get_ident())
        gates.wait(invocation)
        log.append(("invoke", invocation.key.session_id, invocation.key.sequence_id))
        return {"y": 0}

    def closer(context: SessionContext, reason: CloseReason) -> None:
        closer_calls.append((context, reason, threading.get_ident()))
        log.append(("close", context.session_id))

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=4, session_closer=closer)
    closed = trio.Event()
    resolved_when_closed: list[TaskKey] = []

    async def close_s1() -> None:
        await actor.close_session(SessionContext("s1", 7), CloseReason.CANCELLED)
        resolved_when_closed.extend(done.order)
        closed.set()

    try:
        async with started(actor, nursery):
            actor.submit(make_invocation("s1", 0), done)
            actor.submit(make_invocation("s2", 0), done)
            actor.submit(make_invocation("s1", 1), done)
            nursery.start_soon(close_s1)
            await trio.testing.wait_all_tasks_blocked()
            assert not closed.is_set()
            assert log == []
            gates.open("s1", 0)
            gates.open("s2", 0)
            gates.open("s1", 1)
            await closed.wait()
            later = make_invocation("s2", 1)
            gates.open("s2", 1)
            actor.submit(later, done)
            await done.wait(later)
    finally:
        gates.open_all()
    assert log == [
        ("invoke", "s1", 0),
        ("invoke", "s2", 0),
        ("invoke", "s1", 1),
        ("close", "s1"),
        ("invoke", "s2", 1),
    ]
    # every invocation submitted before the close had resolved when close_session returned
    assert resolved_when_closed == [
        make_invocation("s1", 0).key,
        make_invocation("s2", 0).key,
        make_invocation("s1", 1).key,
    ]
    assert closer_calls == [(SessionContext("s1", 7), CloseReason.CANCELLED, actor.thread_ident)]
    assert handler_threads == {actor.thread_ident}


async def test_close_session_without_closer_returns(nursery: trio.Nursery) -> None:
    done = Completions()
    actor = LocalStageActor(lambda inv: {"y": 0})
    async with started(actor, nursery):
        assert await actor.close_session(SessionContext("s1", 1), CloseReason.CLOSED) is None
        inv = make_invocation("s1", 0)
        actor.submit(inv, done)  # the mailbox is untouched by a no-op close
        assert await done.wait(inv) == outcome.Value({"y": 0})


async def test_session_closer_error_reaches_the_caller_and_actor_stays_running(
    nursery: trio.Nursery,
) -> None:
    async def closer(context: SessionContext, reason: CloseReason) -> None:
        raise RuntimeError(f"cannot release {context.session_id}")

    actor = LocalStageActor(lambda inv: {"y": 0}, session_closer=closer)
    async with started(actor, nursery):
        with pytest.raises(RuntimeError, match="cannot release s9"):
            await actor.close_session(SessionContext("s9", 1), CloseReason.FAILED)
        assert actor.health().state is State.RUNNING


# -- LocalStageActor: barrier and health -------------------------------------------------


async def test_barrier_waits_for_pending_invocations(nursery: trio.Nursery) -> None:
    gates = Gates()

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        gates.wait(invocation)
        return {"y": invocation.key.sequence_id}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=2)
    barrier_passed = trio.Event()

    async def barrier() -> None:
        await actor.barrier()
        barrier_passed.set()

    try:
        async with started(actor, nursery):
            await actor.barrier()  # nothing pending: returns at once
            first, second = make_invocation("s1", 0), make_invocation("s1", 1)
            actor.submit(first, done)
            actor.submit(second, done)
            assert actor.health().pending_invocations == 2
            nursery.start_soon(barrier)
            await trio.testing.wait_all_tasks_blocked()
            assert not barrier_passed.is_set()

            gates.open("s1", 0)
            await done.wait(first)
            assert actor.health().pending_invocations == 1
            await trio.testing.wait_all_tasks_blocked()
            assert not barrier_passed.is_set()

            gates.open("s1", 1)
            await barrier_passed.wait()
            assert second.key in done.results
            assert actor.health() == ActorHealth(State.RUNNING, 0)
    finally:
        gates.open_all()


async def test_barrier_waits_for_a_pending_session_close(nursery: trio.Nursery) -> None:
    """Reference A.11: barrier waits until pending invocations *and pending closes* are 0."""
    gates = Gates()
    closed_sessions: list[str] = []

    def closer(context: SessionContext, reason: CloseReason) -> None:
        gates.wait(make_invocation(context.session_id, -1))
        closed_sessions.append(context.session_id)

    actor = LocalStageActor(lambda inv: {"y": 0}, session_closer=closer)
    barrier_passed = trio.Event()

    async def barrier() -> None:
        await actor.barrier()
        barrier_passed.set()

    try:
        async with started(actor, nursery):
            async with trio.open_nursery() as inner:
                inner.start_soon(actor.close_session, SessionContext("s1", 1), CloseReason.CLOSED)
                await trio.testing.wait_all_tasks_blocked()
                inner.start_soon(barrier)
                await trio.testing.wait_all_tasks_blocked()
                passed_early = barrier_passed.is_set()
                gates.open("s1", -1)
            await barrier_passed.wait()
            assert closed_sessions == ["s1"]
            assert not passed_early, "barrier returned while a session close was still pending"
    finally:
        gates.open_all()


async def test_health_reports_state_and_pending_counts(nursery: trio.Nursery) -> None:
    gates = Gates()

    def handler(invocation: StageInvocation) -> dict[str, Any]:
        gates.wait(invocation)
        return {"y": 0}

    done = Completions()
    actor = LocalStageActor(handler, mailbox_capacity=3)
    assert actor.health() == ActorHealth(State.STARTING, 0)
    try:
        async with started(actor, nursery):
            assert actor.health() == ActorHealth(State.RUNNING, 0)
            invocations = [make_invocation("s1", i) for i in range(3)]
            for count, inv in enumerate(invocations, start=1):
                actor.submit(inv, done)
                assert actor.health().pending_invocations == count
            for remaining, inv in zip((2, 1, 0), invocations):
                gates.open(inv.key.session_id, inv.key.sequence_id)
                await done.wait(inv)
                assert actor.health() == ActorHealth(State.RUNNING, remaining)
    finally:
        gates.open_all()
    assert actor.health() == ActorHealth(State.CLOSED, 0)
    assert not actor.health().healthy
