"""Shutdown: drain, cancel, stage failures, actor failure, cleanup failure and retry, deadlines."""

from __future__ import annotations

import pytest
import trio

from engine import (
    ActorFailedError,
    FatalStageError,
    InvalidStageOutput,
    OrchestratorClosedError,
    SessionCleanupError,
    LocalStageActor,
    SessionExistsError,
    open_orchestrator,
)
from states.pipeline_session import CloseReason, State

from .actor_helpers import SPEC, render
from .conftest import STAGES, canonical_spec, chunk, running, settle, value

REVERSE = ("decode", "denoise", "encode")


def released(reason: CloseReason) -> list[tuple[str, CloseReason]]:
    return [(stage, reason) for stage in REVERSE]


# -- close drains -------------------------------------------------------------------------


async def test_close_drains_and_outputs_stay_readable(orch, rec):
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await s.push(1, chunk(1))
    await s.aclose()
    assert s.status is State.CLOSED
    assert s.poll_outputs() == [(0, {"frames": value("frames", "a", 0)}), (1, {"frames": value("frames", "a", 1)})]
    assert rec.closes_of("a") == released(CloseReason.CLOSED)
    assert [phase for phase, _ in s.shutdown_phases] == [
        "drain", "settle", "release:decode", "release:denoise", "release:encode", "artifacts",
    ]
    assert "a" not in orch.session_ids


async def test_close_delivers_every_accepted_output_to_a_reader(orch, rec):
    s = orch.create_session("a")
    got: list[int] = []

    async def read() -> None:
        async for seq, _ in s.outputs():
            got.append(seq)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for seq in range(6):
            await s.push(seq, chunk(seq))
        await s.aclose()  # accepted work still runs; the reader ends when the session does
    assert got == list(range(6))
    assert s.status is State.CLOSED


async def test_close_does_not_wait_for_work_that_can_never_run(orch, rec, autojump_clock):
    s = orch.create_session("a")
    for seq in range(4):
        await s.push(seq, {"image": f"i{seq}"})  # no control will ever come
    await settle()
    assert rec.calls_of("encode", "a") == [0, 1]  # 2 and 3 wait for room on the condition edge
    start = trio.current_time()
    await s.aclose()
    assert trio.current_time() - start < 1.0  # ingress is closed: nothing can unblock them
    assert s.status is State.CLOSED


async def test_a_drain_that_times_out_still_leaves_time_to_release_the_stages(orch, rec, autojump_clock):
    s = orch.create_session("a")
    for seq in range(3):
        await s.push(seq, chunk(seq))
    await settle()
    assert rec.calls_of("decode", "a") == [0, 1]  # 2 waits for the unread output queue
    await s.aclose(timeout=5.0)  # nobody reads: the drain times out, the rest is cancelled
    assert ("drain", "timed out; cancelling") in s.shutdown_phases
    assert s.status is not State.POISONED  # nothing was running: the stages can be released
    assert [stage for stage, _ in rec.closes_of("a")] == list(REVERSE)


# -- cancel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
async def test_cancel_lets_the_running_call_finish_and_discards_its_result(orch, rec, stage):
    hold = rec.gate(stage, 0)
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await s.push(1, chunk(1))
    await rec.wait_started(stage, "a", 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.cancel)
        await settle()
        assert s.status is State.CANCELLING
        assert rec.closes == []  # no stage is released under a running call
        calls_at_cancel = list(rec.calls)
        hold.set()
    assert (stage, "a", 0, "ok") in rec.ends  # finished, not interrupted
    assert not any(end[3] == "cancelled" for end in rec.ends)
    assert rec.calls == calls_at_cancel  # nothing started after the cancel
    assert s.poll_outputs() == []
    assert s.metrics().output_emitted_at == ()
    assert s.status is State.CANCELLED
    assert rec.closes_of("a") == released(CloseReason.CANCELLED)
    assert orch.diagnostics().slot_leaks == 0


async def test_cancel_of_a_terminal_session_is_a_no_op(orch, rec):
    s = orch.create_session("a")
    await s.aclose()
    await s.cancel()
    assert s.status is State.CLOSED
    assert len(rec.closes) == 3


async def test_session_context_cancels_when_its_body_raises(rec):
    with pytest.raises(KeyError, match="boom"):
        async with running(rec) as orch, orch.session("a") as s:
            await s.push(0, chunk(0))
            raise KeyError("boom")
    assert s.status is State.CANCELLED
    assert rec.closes_of("a") == released(CloseReason.CANCELLED)


# -- stage failures ---------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
async def test_a_raising_stage_fails_only_its_session(orch, rec, stage):
    boom = RuntimeError(f"{stage} broke")
    rec.fail(stage, 0, boom, session="a")
    a = orch.create_session("a")
    b = orch.create_session("b", final_sequence_id=1)
    await a.push(0, chunk(0))
    await b.push(0, chunk(0))
    await b.push(1, chunk(1))
    await a.wait_settled()
    assert a.status is State.FAILED
    assert a.error is boom
    assert rec.closes_of("a") == released(CloseReason.FAILED)
    assert "a" not in orch.session_ids
    assert [seq async for seq, _ in b.outputs()] == [0, 1]  # the other session is unaffected
    assert b.status is State.RUNNING
    assert orch.actor_health(stage).healthy
    await a.aclose()  # closing a failed session is harmless
    assert a.status is State.FAILED


async def test_fatal_stage_error_fails_every_session_on_the_actor(orch, rec):
    fatal = FatalStageError("device lost")
    rec.fail("denoise", 0, fatal, session="a")
    a = orch.create_session("a")
    b = orch.create_session("b")
    await b.push(0, {"image": "i0"})  # b is running, waiting for its control
    await a.push(0, chunk(0))
    await a.wait_settled()
    await b.wait_settled()
    assert a.status is State.FAILED and b.status is State.FAILED
    assert a.error is fatal  # the session that surfaced it keeps its own error
    assert isinstance(b.error, ActorFailedError)
    assert "device lost" in str(b.error)
    assert not orch.actor_health("denoise").healthy
    # the failed actor's release is skipped; the others still run in reverse order
    assert rec.closes_of("a") == [("decode", CloseReason.FAILED), ("encode", CloseReason.FAILED)]
    assert ("release:denoise", "skipped: actor failed") in a.shutdown_phases

    c = orch.create_session("c")  # a new session fails as soon as it needs the actor
    await c.push(0, chunk(0))
    await c.wait_settled()
    assert c.status is State.FAILED
    assert isinstance(c.error, ActorFailedError)


@pytest.mark.parametrize("result", [{"wrong": 1}, {"frames": 1, "extra": 2}, {}, None])
async def test_invalid_stage_output_fails_the_session(orch, rec, result):
    rec.outputs["decode"] = lambda inv: result
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await s.wait_settled()
    assert s.status is State.FAILED
    assert isinstance(s.error, InvalidStageOutput)
    assert "frames" in str(s.error)
    assert s.poll_outputs() == []


# -- cleanup failure and retry ---------------------------------------------------------------


async def test_a_failing_closer_poisons_the_session_and_retry_cleans_the_rest(orch, rec):
    broken = RuntimeError("release failed")
    rec.fail_close_once("denoise", broken)
    s = orch.create_session("a")
    epoch = s.epoch
    await s.push(0, chunk(0))
    await settle()
    with pytest.raises(SessionCleanupError) as info:
        await s.aclose()
    assert info.value.__cause__ is broken
    assert s.status is State.POISONED
    assert s.cleanup_error is broken
    assert orch.diagnostics().cleanup_failures == 1
    # the remaining stages were still attempted, in reverse order
    assert [stage for stage, _ in rec.closes_of("a")] == ["decode", "denoise", "encode"]
    assert "a" in orch.session_ids
    with pytest.raises(SessionExistsError):
        orch.create_session("a")

    await s.aclose()  # retry: only the stage that failed runs again
    assert [stage for stage, _ in rec.closes_of("a")] == ["decode", "denoise", "encode", "denoise"]
    assert s.status is State.CLOSED
    assert orch.diagnostics().cleanup_failures == 1
    again = orch.create_session("a")
    assert again.epoch > epoch


async def test_a_cleanup_error_names_every_stage_whose_release_failed(orch, rec):
    """Both hooks that failed are named, in the order they ran (the last alone was: the other had to be found in
    ``shutdown_phases``); the error's cause is the first."""
    first, second = RuntimeError("decode's cache"), RuntimeError("encode's cache")
    rec.fail_close_once("decode", first)
    rec.fail_close_once("encode", second)
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await settle()
    with pytest.raises(SessionCleanupError) as info:
        await s.aclose()
    message = str(info.value)
    assert "release:decode failed: RuntimeError(\"decode's cache\")" in message, message
    assert "release:encode failed: RuntimeError(\"encode's cache\")" in message, message
    assert message.index("release:decode") < message.index("release:encode"), message
    assert info.value.__cause__ is first
    await s.aclose()  # the retry names only what fails then: nothing
    assert s.status is State.CLOSED


async def test_session_id_reuse_gets_a_higher_epoch(orch):
    first = orch.create_session("a")
    assert first.epoch >= 1
    with pytest.raises(SessionExistsError):
        orch.create_session("a")
    await first.aclose()
    second = orch.create_session("a")
    assert second.epoch > first.epoch
    assert first.status is State.CLOSED  # the old handle keeps its own epoch's status
    assert second.status is State.RUNNING
    third_id = orch.create_session("b")
    assert third_id.epoch > second.epoch


# -- orchestrator shutdown ---------------------------------------------------------------------


async def test_closing_the_orchestrator_shuts_sessions_then_actors_in_reverse(rec):
    spec = canonical_spec()
    hold = rec.gate("denoise", 0, session="a")
    seen_while_running: list[object] = []
    async with trio.open_nursery() as outer:

        async def release_when_blocked() -> None:
            await settle()  # the orchestrator is waiting for a's running denoise call
            seen_while_running.extend([a.status, list(rec.closes), list(rec.actor_closes)])
            hold.set()

        async with open_orchestrator(spec, rec.actors(spec)) as orch:
            a = orch.create_session("a")
            b = orch.create_session("b")
            await a.push(0, chunk(0))
            await b.push(0, {"image": "i0"})
            await rec.wait_started("denoise", "a", 0)
            outer.start_soon(release_when_blocked)
    a_status, closes_then, actor_closes_then = seen_while_running
    assert a_status is State.SHUTTING_DOWN
    assert [c for c in closes_then if c[1] == "a"] == []  # a waits for its running call
    assert actor_closes_then == []  # actors close only after every session
    assert ("denoise", "a", 0, "ok") in rec.ends
    assert rec.calls_of("decode") == []  # the result was discarded
    for s in (a, b):
        assert s.status is State.CLOSED
        assert rec.closes_of(s.session_id) == released(CloseReason.SHUTDOWN)
    assert rec.actor_closes == list(REVERSE)
    with pytest.raises(OrchestratorClosedError):
        orch.create_session("c")


async def test_drain_deadline_cancels_then_poisons_while_the_call_still_runs(orch, rec, autojump_clock):
    never = rec.gate("decode", 0)  # stays shut until the test opens it
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await rec.wait_started("decode", "a", 0)
    start = trio.current_time()
    with pytest.raises(SessionCleanupError):
        await s.aclose(drain_timeout=1.0, timeout=5.0)
    assert trio.current_time() - start == pytest.approx(5.0)
    assert s.status is State.POISONED
    assert isinstance(s.cleanup_error, TimeoutError)
    assert ("drain", "timed out; cancelling") in s.shutdown_phases
    assert rec.closes == []  # nothing released under the running call
    assert orch.diagnostics().cleanup_failures == 1

    with pytest.raises(SessionCleanupError):  # still running: the retry refuses too
        await s.aclose(timeout=1.0)
    assert rec.closes == []

    never.set()
    await settle()
    assert ("decode", "a", 0, "ok") in rec.ends
    await s.aclose()
    assert s.status in (State.CLOSED, State.CANCELLED)
    assert s.poll_outputs() == []  # the late result was discarded
    assert [stage for stage, _ in rec.closes_of("a")] == list(REVERSE)
    assert orch.diagnostics().stale_epoch_results == 0


async def test_a_drain_names_the_accepted_sequences_that_could_never_run() -> None:
    """Sequence 1 pushed, 0 never: a strict stage takes them in order, so the drain ends with nothing it can run. It
    said ``ok`` and dropped sequence 1 without a word; it says which never ran."""
    actors = {"dynamics": LocalStageActor(lambda inv: {"latent": inv.inputs["control"]}),
              "render": LocalStageActor(render)}
    with trio.fail_after(10):
        async with open_orchestrator(SPEC, actors) as orch:
            session = orch.create_session("gap")
            await session.push(1, {"control": 1})
            await session.aclose()
            assert session.status is State.CLOSED
            assert ("drain", "ok; 1 accepted sequence(s) never ran, an input they need never came: 1") in (
                session.shutdown_phases)
            done = orch.create_session("whole", final_sequence_id=0)
            await done.push(0, {"control": 0})
            assert [seq async for seq, _ in done.outputs()] == [0]
            await done.aclose()
            assert ("drain", "ok") in done.shutdown_phases
