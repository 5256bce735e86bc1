"""Errors a stage or a hook raises that cannot be printed, and other failures met at the engine's edges.

A stage's error may carry a value whose ``repr`` raises (a tensor on a device that failed: its ``repr`` asks the
device). The engine names such an error in its own messages (a failed phase, an actor's failure, a refused push):
where it formatted it with ``repr`` or ``str`` directly, the message's error replaced the one meant. A failed
background cleanup then ended the whole orchestrator and poisoned its healthy sessions, an actor that raised
``FatalStageError`` stayed healthy, and a push to the failed session raised the device's error.
"""

from __future__ import annotations

import threading

import outcome
import pytest
import trio

from engine import (
    ActorFailedError,
    FatalStageError,
    LocalStageActor,
    SessionCleanupError,
    SessionStateError,
    WrongThreadError,
    open_orchestrator,
)
from engine.actors import ActorHealth
from states.pipeline_session import State
from states.stage_actor import State as ActorState

from .actor_helpers import SPEC, render

WAIT = 10.0


class DeadTensor:
    """A value whose ``repr`` raises, as a CUDA tensor's does once its device failed."""

    def __repr__(self) -> str:
        raise RuntimeError("CUDA error: device-side assert triggered")


def passing(invocation):
    return {"latent": invocation.inputs["control"]}


async def test_a_background_cleanup_whose_error_cannot_be_printed_poisons_only_its_session() -> None:
    """Session a's stage fails, and its hook then fails with an error that cannot be printed: a is poisoned (its
    phase says so), b and the orchestrator go on."""

    def dynamics(invocation):
        if invocation.key.session_id == "a":
            raise ValueError("bad chunk")
        return passing(invocation)

    failures = [ValueError("cannot free the cache", DeadTensor())]

    def closer(context, reason):
        if context.session_id == "a" and failures:
            raise failures.pop()

    actors = {"dynamics": LocalStageActor(dynamics, session_closer=closer), "render": LocalStageActor(render)}
    with trio.fail_after(WAIT):
        async with open_orchestrator(SPEC, actors) as orch:
            a, b = orch.create_session("a"), orch.create_session("b", final_sequence_id=0)
            await a.push(0, {"control": 0})
            await a.wait_settled()
            assert a.status is State.POISONED, a.shutdown_phases
            assert ("release:dynamics", "failed: <a ValueError whose repr failed>") in a.shutdown_phases
            await b.push(0, {"control": 0})
            assert [seq async for seq, _ in b.outputs()] == [0]
            assert b.error is None


async def test_a_close_whose_hook_error_cannot_be_printed_is_a_cleanup_error_and_may_be_retried() -> None:
    failures = [ValueError("cannot free the cache", DeadTensor())]

    def closer(context, reason):
        if failures:
            raise failures.pop()

    actors = {"dynamics": LocalStageActor(passing, session_closer=closer), "render": LocalStageActor(render)}
    with trio.fail_after(WAIT):
        async with open_orchestrator(SPEC, actors) as orch:
            a = orch.create_session("a")
            with pytest.raises(SessionCleanupError):
                await a.aclose()
            assert a.status is State.POISONED, a.shutdown_phases
            await a.aclose()  # the retry releases what the failed hook held
            assert a.status is State.CLOSED, a.status


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_fatal_stage_error_that_cannot_be_printed_still_fails_its_actor_and_every_session(kind) -> None:
    def dynamics(invocation):
        if invocation.key.session_id == "a":
            raise FatalStageError(DeadTensor())
        return passing(invocation)

    async def dynamics_async(invocation):
        return dynamics(invocation)

    actor = LocalStageActor(dynamics if kind == "sync" else dynamics_async)
    with trio.fail_after(WAIT):
        async with open_orchestrator(SPEC, {"dynamics": actor, "render": LocalStageActor(render)}) as orch:
            a, b = orch.create_session("a"), orch.create_session("b")
            await a.push(0, {"control": 0})
            await a.wait_settled()
            assert isinstance(a.error, FatalStageError)  # the original error, kept
            assert not actor.health().healthy
            assert "FatalStageError: <its message could not be made" in actor.health().failure_reason
            await b.wait_settled()
            assert isinstance(b.error, ActorFailedError) and b.error.__cause__ is a.error


async def test_a_push_to_a_session_failed_by_an_error_that_cannot_be_printed_says_the_session_failed() -> None:
    def dynamics(invocation):
        raise ValueError(DeadTensor())

    actors = {"dynamics": LocalStageActor(dynamics), "render": LocalStageActor(render)}
    with trio.fail_after(WAIT):
        async with open_orchestrator(SPEC, actors) as orch:
            a = orch.create_session("a")
            await a.push(0, {"control": 0})
            await a.wait_settled()
            with pytest.raises(SessionStateError, match="accepts no input: ValueError: <its message could not be"):
                await a.push(1, {"control": 1})
            with pytest.raises(SessionStateError, match="accepts no input"):
                a.try_push(1, {"control": 1})
            assert isinstance(a.error, ValueError)


class Shutdown(BaseException):
    """An application's own way to stop, past ``except Exception``."""


@pytest.mark.parametrize("raised", [
    KeyboardInterrupt(), SystemExit(3), Shutdown("stop"),
    BaseExceptionGroup("a nursery of the body", [KeyboardInterrupt()]),  # a Ctrl-C met inside one
], ids=["ctrl-c", "sys.exit", "own-base-exception", "ctrl-c-in-a-nursery"])
async def test_a_ctrl_c_or_sys_exit_in_the_orchestrators_body_comes_out_as_itself(raised) -> None:
    """"An exception from the body propagates as itself": these came out in a group, past ``except
    KeyboardInterrupt``, and a program's ``sys.exit(3)`` exited 1 with a traceback; an application's own
    ``BaseException``, and a Ctrl-C met in a nursery of the body, still did (in a group once more)."""
    actors = {"dynamics": LocalStageActor(passing), "render": LocalStageActor(render)}
    with pytest.raises(type(raised)) as caught:
        async with open_orchestrator(SPEC, actors):
            raise raised
    assert caught.value is raised


class CompletesFromAThread:
    """A stage actor of one's own whose ``submit`` hands the result back from a thread it starts (the protocol says
    the completion is called in trio); once that is refused, it completes in trio instead."""

    name = "from-a-thread"

    def __init__(self) -> None:
        self.refusals: list[BaseException] = []
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        task_status.started()
        await trio.sleep_forever()

    def submit(self, invocation, on_done) -> None:
        threading.Thread(target=self._complete_from_thread, args=(invocation, on_done)).start()

    def _complete_from_thread(self, invocation, on_done) -> None:
        result = outcome.Value(passing(invocation))
        try:
            on_done(invocation, result)
        except WrongThreadError as exc:
            self.refusals.append(exc)
            assert self._token is not None
            self._token.run_sync_soon(on_done, invocation, result)

    def health(self) -> ActorHealth:
        return ActorHealth(ActorState.RUNNING, 0)

    def is_healthy(self) -> bool:
        return True

    async def close_session(self, context, reason) -> None:
        pass

    async def barrier(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_a_completion_called_from_another_thread_is_refused_and_changes_nothing() -> None:
    """It rescheduled a trio task from that thread: a wait queue corrupted, then a ``TrioInternalError``."""
    actor = CompletesFromAThread()
    with trio.fail_after(WAIT):
        async with open_orchestrator(SPEC, {"dynamics": actor, "render": LocalStageActor(render)}) as orch:
            a = orch.create_session("a", final_sequence_id=1)
            await a.push(0, {"control": 0})
            await a.push(1, {"control": 1})
            assert [seq async for seq, _ in a.outputs()] == [0, 1]
    assert len(actor.refusals) == 2
    assert "on_done() was called from thread" in str(actor.refusals[0])

