"""Stage actors (reference A.11, A.12, F.24): one owner, one thread, one bounded mailbox.

Synchronous handlers are held at a ``threading.Event`` gate when a test needs
work to stay in flight; the trio side synchronises only through trio events
(set from the completion callbacks) and ``wait_all_tasks_blocked``.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
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
from engine.parallel_actor import InProcessWorkerGroup, ParallelWorkerStageActor
from engine.errors import ActorBusyError, ActorFailedError, FatalStageError
from states.pipeline_session import CloseReason
from states.stage_actor import State

GATE_TIMEOUT = 30.0  # a safety net so a broken test fails instead of hanging


# -- helpers -------------------------------------------------------------------


def make_invocation(
    session_id: str = "s1", sequence_id: int = 0, *, stage_id: str = "encode", epoch: int = 1, request_id: int = 0
) -> StageInvocation:
    key = TaskKey(session_id, epoch, sequence_id, stage_id, request_id)
    return StageInvocation(key, {"x": sequence_id}, is_first=sequence_id == 0, is_last=False)


class Completions:
    """The ``on_done`` callback: records every resolution and lets trio wait for one."""

    def __init__(self) -> None:
        self.results: dict[TaskKey, outcome.Outcome] = {}
        self.order: list[TaskKey] = []
        self.callback_threads: set[int] = set()
        self._events: dict[TaskKey, trio.Event] = {}
        self.log: list[tuple] | None = None

    def _event(self, key: TaskKey) -> trio.Event:
        return self._events.setdefault(key, trio.Event())

    def __call__(self, invocation: StageInvocation, result: outcome.Outcome) -> None:
        assert invocation.key not in self.results, "an invocation resolved twice"
        self.results[invocation.key] = result
        self.order.append(invocation.key)
        self.callback_threads.add(threading.get_ident())
        if self.log is not None:
            self.log.append(("done", invocation.key.session_id, invocation.key.sequence_id))
        self._event(invocation.key).set()

    async def wait(self, invocation: StageInvocation) -> outcome.Outcome:
        await self._event(invocation.key).wait()
        return self.results[invocation.key]


class Gates:
    """Per-sequence ``threading.Event`` gates a synchronous handler waits at."""

    def __init__(self) -> None:
        self._gates: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()
        self._all_open = False

    def _gate(self, key: tuple[str, int]) -> threading.Event:
        with self._lock:
            gate = self._gates.setdefault(key, threading.Event())
            if self._all_open:
                gate.set()
            return gate

    def wait(self, invocation: StageInvocation) -> None:
        key = (invocation.key.session_id, invocation.key.sequence_id)
        if not self._gate(key).wait(GATE_TIMEOUT):
            raise TimeoutError(f"gate {key} never opened")

    def open(self, session_id: str, sequence_id: int) -> None:
        self._gate((session_id, sequence_id)).set()

    def open_all(self) -> None:
        """Open every gate, including those a handler has not reached yet."""
        with self._lock:
            self._all_open = True
            gates = list(self._gates.values())
        for gate in gates:
            gate.set()


@asynccontextmanager
async def started(actor: Any, nursery: trio.Nursery) -> AsyncIterator[Any]:
    await nursery.start(actor.run)
    try:
        yield actor
    finally:
        await actor.aclose()


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


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
    assert actor.health() == ActorHealth(State.CLOSED, 0)
    assert "closing-actor-under-test" not in thread_names()
    assert ident not in {t.ident for t in threading.enumerate() if t.name == "closing-actor-under-test"}
    await actor.aclose()  # idempotent
    await actor.aclose()
    assert actor.health().state is State.CLOSED
    with pytest.raises(ActorFailedError, match="closed"):
        actor.submit(make_invocation("s3", 0), done)


async def test_concurrent_aclose_calls_all_return(nursery: trio.Nursery) -> None:
    actor = LocalStageActor(lambda inv: {"y": 0}, name="concurrent-close-actor")
    await nursery.start(actor.run)
    async with trio.open_nursery() as closers:
        for _ in range(3):
            closers.start_soon(actor.aclose)
    assert actor.health().state is State.CLOSED
    assert "concurrent-close-actor" not in thread_names()


async def test_aclose_before_run_closes_without_a_thread() -> None:
    actor = LocalStageActor(lambda inv: {"y": 0})
    await actor.aclose()
    assert actor.health() == ActorHealth(State.CLOSED, 0)
    assert actor.thread_ident is None
    with pytest.raises(ActorFailedError):
        actor.submit(make_invocation(), Completions())


# -- ParallelWorkerStageActor ---------------------------------------------------------------


class Rank:
    """One in-process worker rank: scales its input and adds its rank."""

    def __init__(self, rank: int, log: list) -> None:
        self.rank = rank
        self.log = log
        self.closed = False

    def step(self, x: int, *, scale: int = 1) -> int:
        self.log.append(("step", self.rank, x, scale, threading.get_ident()))
        return x * scale + self.rank

    def close(self) -> None:
        self.closed = True
        self.log.append(("close", self.rank))


def rank_group(log: list, **kwargs: Any) -> tuple[InProcessWorkerGroup, list[Rank]]:
    ranks: list[Rank] = []

    def factory(rank: int) -> Rank:
        ranks.append(Rank(rank, log))
        return ranks[-1]

    return InProcessWorkerGroup(factory, **kwargs), ranks


def builders(seen: list) -> tuple[Callable, Callable]:
    def input_builder(invocation: StageInvocation) -> tuple[tuple, dict]:
        seen.append(("in", invocation.key.sequence_id))
        return (invocation.inputs["x"],), {"scale": 10}

    def output_builder(result: Any, invocation: StageInvocation) -> dict[str, Any]:
        seen.append(("out", invocation.key.sequence_id, result))
        return {"latent": result}

    return input_builder, output_builder


async def test_parallel_actor_uses_builders_and_resolves_deferred_result(nursery: trio.Nursery) -> None:
    log: list = []
    seen: list = []
    worker, _ = rank_group(log, world_size=2)
    input_builder, output_builder = builders(seen)
    actor = ParallelWorkerStageActor(
        worker, "step", input_builder=input_builder, output_builder=output_builder, mailbox_capacity=2
    )
    done = Completions()
    async with started(actor, nursery):
        first, second = make_invocation("s1", 3), make_invocation("s2", 4)
        actor.submit(first, done)
        actor.submit(second, done)
        await actor.barrier()
        # rank 0's value, not the deferred callable
        assert done.results[first.key] == outcome.Value({"latent": 30})
        assert done.results[second.key] == outcome.Value({"latent": 40})
        assert seen == [("in", 3), ("out", 3, 30), ("in", 4), ("out", 4, 40)]
        # every rank got the call, on the actor's one thread
        assert [(e[1], e[2], e[3]) for e in log] == [(0, 3, 10), (1, 3, 10), (0, 4, 10), (1, 4, 10)]
        assert {e[4] for e in log} == {actor.thread_ident}
        assert actor.health() == ActorHealth(State.RUNNING, 0)


async def test_parallel_actor_resolves_deferred_result_on_its_thread(nursery: trio.Nursery) -> None:
    resolved_on: list[int] = []

    class DeferredWorker:
        failed = False
        closed = False

        def forward(self, x: int) -> Callable[[], int]:
            def result() -> int:
                resolved_on.append(threading.get_ident())
                return x + 1

            return result

        def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, method)(*args, **kwargs)

        def close(self) -> None:
            self.closed = True

    actor = ParallelWorkerStageActor(
        DeferredWorker(),
        "forward",
        input_builder=lambda inv: ((inv.inputs["x"],), {}),
        output_builder=lambda result, inv: {"y": result},
    )
    done = Completions()
    async with started(actor, nursery):
        inv = make_invocation("s1", 41)
        actor.submit(inv, done)
        assert await done.wait(inv) == outcome.Value({"y": 42})
        assert resolved_on == [actor.thread_ident]


async def test_parallel_actor_gather_returns_every_rank(nursery: trio.Nursery) -> None:
    log: list = []
    seen: list = []
    worker, _ = rank_group(log, world_size=3, gather=frozenset({"step"}))
    input_builder, output_builder = builders(seen)
    actor = ParallelWorkerStageActor(worker, "step", input_builder=input_builder, output_builder=output_builder)
    done = Completions()
    async with started(actor, nursery):
        inv = make_invocation("s1", 2)
        actor.submit(inv, done)
        assert await done.wait(inv) == outcome.Value({"latent": [20, 21, 22]})
        assert seen[-1] == ("out", 2, [20, 21, 22])


async def test_parallel_actor_health_fails_with_the_workers_reason(nursery: trio.Nursery) -> None:
    log: list = []
    worker, _ = rank_group(log, world_size=2)
    input_builder, output_builder = builders([])
    actor = ParallelWorkerStageActor(worker, "step", input_builder=input_builder, output_builder=output_builder)
    done = Completions()
    async with started(actor, nursery):
        assert actor.health().state is State.RUNNING
        worker.fail("rank 1 ran out of memory")
        health = actor.health()
        assert health.state is State.FAILED
        assert health.failure_reason == "rank 1 ran out of memory"
        with pytest.raises(ActorFailedError, match="rank 1 ran out of memory"):
            actor.submit(make_invocation("s1", 0), done)
        assert log == []  # the failed worker was never called
    assert actor.health().state is State.FAILED
    assert actor.health().failure_reason == "rank 1 ran out of memory"


async def test_parallel_actor_close_closes_the_worker(nursery: trio.Nursery) -> None:
    log: list = []
    worker, ranks = rank_group(log, world_size=2)
    input_builder, output_builder = builders([])
    actor = ParallelWorkerStageActor(
        worker, "step", input_builder=input_builder, output_builder=output_builder, name="parallel-closing"
    )
    done = Completions()
    async with started(actor, nursery):
        inv = make_invocation("s1", 1)
        actor.submit(inv, done)
        await actor.barrier()
        assert not worker.closed
    assert worker.closed
    assert all(rank.closed for rank in ranks)
    assert log[-2:] == [("close", 0), ("close", 1)]
    assert actor.health().state is State.CLOSED
    assert "parallel-closing" not in thread_names()
    await actor.aclose()  # idempotent: the worker is not closed twice
    assert [e for e in log if e[0] == "close"] == [("close", 0), ("close", 1)]
    with pytest.raises(RuntimeError, match="closed"):
        worker.call("step", 1)


async def test_parallel_actor_leaves_a_shared_worker_open(nursery: trio.Nursery) -> None:
    log: list = []
    worker, ranks = rank_group(log, world_size=2)
    input_builder, output_builder = builders([])
    actor = ParallelWorkerStageActor(
        worker, "step", input_builder=input_builder, output_builder=output_builder, close_worker=False
    )
    done = Completions()
    async with started(actor, nursery):
        inv = make_invocation("s1", 1)
        actor.submit(inv, done)
        await done.wait(inv)
    assert not worker.closed
    assert not any(rank.closed for rank in ranks)
    assert actor.health().state is State.CLOSED
    assert worker.call("step", 2, scale=1)() == 2  # still usable by its real owner


async def test_parallel_actor_session_closer_runs_on_its_thread(nursery: trio.Nursery) -> None:
    closed: list[tuple[str, CloseReason, int]] = []

    def closer(context: SessionContext, reason: CloseReason) -> None:
        closed.append((context.session_id, reason, threading.get_ident()))

    worker, _ = rank_group([], world_size=1)
    input_builder, output_builder = builders([])
    actor = ParallelWorkerStageActor(
        worker, "step", input_builder=input_builder, output_builder=output_builder, session_closer=closer
    )
    async with started(actor, nursery):
        await actor.close_session(SessionContext("s1", 2), CloseReason.SHUTDOWN)
        assert closed == [("s1", CloseReason.SHUTDOWN, actor.thread_ident)]


def test_worker_group_rejects_world_size_below_one() -> None:
    with pytest.raises(ValueError, match="world_size"):
        InProcessWorkerGroup(lambda rank: object(), world_size=0)
