"""The parallel worker stage actor: a worker group's ranks run one invocation, built by input and output builders."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import outcome
import pytest
import trio

from engine.actors import ActorHealth, SessionContext, StageInvocation
from engine.errors import ActorFailedError
from engine.parallel_actor import InProcessWorkerGroup, ParallelWorkerStageActor
from engine.workers import WorkerGroupClosed, WorkerGroupFailed
from states.pipeline_session import CloseReason
from states.stage_actor import State

from .actor_helpers import Completions, make_invocation, started, thread_names

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


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0, "2", None])
def test_worker_group_refuses_a_world_size_that_is_not_a_whole_number_of_ranks(world_size) -> None:
    """As the process groups do: ``True`` was taken for one rank, and ``"2"`` or ``2.0`` failed with Python's own
    TypeError, naming no parameter."""
    with pytest.raises(ValueError, match="^world_size must be an int >= 1, got "):
        InProcessWorkerGroup(lambda rank: object(), world_size=world_size)


# -- InProcessWorkerGroup keeps the process group's rules ----------------------------------------


class Interrupted(BaseException):
    """Stands in for the KeyboardInterrupt of a user who gives up on a slow close."""


class ClosingRank:
    """A rank whose ``close()`` raises ``error`` (if any) and logs each run."""

    def __init__(self, rank: int, log: list, error: BaseException | None = None) -> None:
        self.rank, self.log, self.error = rank, log, error

    def ping(self) -> int:
        return self.rank

    def close(self) -> None:
        self.log.append(self.rank)
        if self.error is not None:
            raise self.error


def test_in_process_close_runs_every_ranks_close_once_even_when_one_raises():
    """Rank 0's close raising left rank 1 unclosed, the group open (``closed`` False, calls running) and each
    close() ran rank 0's close again. As the process group does, its traceback is kept, by rank, and close goes on."""
    closed: list[int] = []
    group = InProcessWorkerGroup(
        lambda rank: ClosingRank(rank, closed, RuntimeError("rank 0 close failed") if rank == 0 else None),
        world_size=2,
    )
    group.close()
    assert closed == [0, 1]
    assert group.closed
    assert list(group.close_errors) == [0]
    assert "RuntimeError: rank 0 close failed" in group.close_errors[0]
    group.close()  # idempotent: no rank's close runs again
    assert closed == [0, 1]
    with pytest.raises(WorkerGroupClosed, match="^worker group is closed$"):
        group.call("ping")


def test_an_interrupted_in_process_close_refuses_calls_and_is_finished_by_the_next():
    closed: list[int] = []
    group = InProcessWorkerGroup(
        lambda rank: ClosingRank(rank, closed, Interrupted() if rank == 0 else None), world_size=2
    )
    with pytest.raises(Interrupted):
        group.close()
    assert (closed, group.closed) == ([0], False)
    with pytest.raises(WorkerGroupClosed):
        group.call("ping")  # closing: no call runs
    group.close()
    assert (closed, group.closed, group.close_errors) == ([0, 1], True, {})


def test_a_failed_in_process_group_refuses_calls_and_runs_late_failure_callbacks_at_once(caplog):
    """After fail(), call() still ran the ranks and a failure callback added later never ran."""
    closed: list[int] = []
    group = InProcessWorkerGroup(lambda rank: ClosingRank(rank, closed), world_size=2)
    seen: list[tuple[str, str]] = []

    def raising(reason: str) -> None:
        raise RuntimeError("a callback's own bug")

    group.add_failure_callback(raising)
    group.add_failure_callback(lambda reason: seen.append(("early", reason)))
    group.fail("rank 1 ran out of memory")
    assert seen == [("early", "rank 1 ran out of memory")]  # after the raising one, which is logged
    assert "a failure callback raised" in caplog.text
    group.add_failure_callback(lambda reason: seen.append(("late", reason)))
    assert seen[-1] == ("late", "rank 1 ran out of memory")
    with pytest.raises(WorkerGroupFailed, match="^worker group failed: rank 1 ran out of memory$"):
        group.call("ping")
    group.fail("another reason")  # failed once: the first reason stays, no callback runs again
    assert (group.failure_reason, len(seen)) == ("rank 1 ran out of memory", 2)
    group.close()
    assert closed == [0, 1]
    with pytest.raises(WorkerGroupFailed):
        group.call("ping")  # as the process group: its failure is what a call reports


def test_a_closed_in_process_group_does_not_fail():
    group = InProcessWorkerGroup(lambda rank: ClosingRank(rank, []))
    seen: list[str] = []
    group.add_failure_callback(seen.append)
    group.close()
    group.fail("too late")
    assert (group.failed, group.failure_reason, seen) == (False, None, [])
