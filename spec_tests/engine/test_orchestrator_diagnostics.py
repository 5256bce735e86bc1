"""Diagnostics counters (stale, orphaned, duplicate results; slot leaks) and session metrics."""

from __future__ import annotations

import outcome
import pytest
import trio

import engine.runtime
from engine import Diagnostics, SessionCleanupError, StageInvocation, TaskKey
from states.pipeline_session import State

from .conftest import canonical_spec, chunk, running, settle, value


def late(inv: StageInvocation) -> outcome.Outcome:
    return outcome.Value({"condition": "late"})


# -- stale, orphaned and duplicate results ----------------------------------------------


async def test_a_result_from_an_old_epoch_is_counted_stale(orch, rec):
    old = orch.create_session("a", final_sequence_id=0)
    await old.push(0, chunk(0))
    async for _ in old.outputs():
        pass
    await old.aclose()
    inv = rec.invocations[0]
    assert inv.key.stage_id == "encode"
    new = orch.create_session("a")
    assert new.epoch != inv.key.session_epoch
    rec.on_done(inv, late(inv))
    assert orch.diagnostics() == Diagnostics(stale_epoch_results=1)
    assert new.artifact_stats().slot_count == 0  # the late result did not leak into the new epoch
    assert new.poll_outputs() == []


async def test_a_result_for_an_unknown_session_is_counted_orphaned(orch, rec):
    s = orch.create_session("gone", final_sequence_id=0)
    await s.push(0, chunk(0))
    async for _ in s.outputs():
        pass
    await s.aclose()  # forgotten: its keys now belong to nobody
    ghost = StageInvocation(TaskKey("ghost", 1, 0, "encode", 1), {"image": 0}, True, False)
    rec.on_done(ghost, late(ghost))
    assert orch.diagnostics().orphaned_results == 1
    rec.on_done(rec.invocations[0], late(rec.invocations[0]))
    assert orch.diagnostics().orphaned_results == 2

    live = orch.create_session("live")
    never_submitted = StageInvocation(TaskKey("live", live.epoch, 0, "encode", 10**9), {}, True, False)
    rec.on_done(never_submitted, late(never_submitted))
    assert orch.diagnostics().orphaned_results == 3
    assert live.artifact_stats().slot_count == 0
    assert orch.diagnostics().stale_epoch_results == 0


async def test_a_second_resolution_of_a_completed_key_is_counted_duplicate(orch, rec):
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await settle()
    assert [seq for seq, _ in s.poll_outputs()] == [0]
    encode_0 = rec.invocations[0]
    stats = s.artifact_stats()
    rec.on_done(encode_0, late(encode_0))
    assert orch.diagnostics() == Diagnostics(duplicate_results=1)
    assert s.artifact_stats() == stats
    await settle()
    assert s.poll_outputs() == []
    assert rec.calls_of("denoise", "a") == [0]


async def test_an_actor_that_reports_twice_is_counted_and_ignored(rec):
    async with running(rec, canonical_spec(), concurrent={"encode"}) as orch:
        orch.actors["encode"].on_done_calls = 2
        s = orch.create_session("a", final_sequence_id=2)
        got = []
        async with trio.open_nursery() as nursery:

            async def feed() -> None:
                for seq in range(3):
                    await s.push(seq, chunk(seq))

            nursery.start_soon(feed)
            async for seq, artifacts in s.outputs():
                got.append((seq, artifacts))
        assert got == [(seq, {"frames": value("frames", "a", seq)}) for seq in range(3)]
        assert rec.calls_of("denoise", "a") == [0, 1, 2]
        assert orch.diagnostics() == Diagnostics(duplicate_results=3)


async def test_a_fault_free_run_counts_nothing(orch, rec):
    sessions = [orch.create_session(sid, final_sequence_id=4) for sid in "abc"]

    async def run(s) -> list[int]:
        for seq in range(5):
            await s.push(seq, chunk(seq))

    got: dict[str, list[int]] = {}

    async def read(s) -> None:
        got[s.session_id] = [seq async for seq, _ in s.outputs()]

    async with trio.open_nursery() as nursery:
        for s in sessions:
            nursery.start_soon(run, s)
            nursery.start_soon(read, s)
    for s in sessions:
        await s.aclose()
        assert s.status is State.CLOSED
    assert got == {sid: [0, 1, 2, 3, 4] for sid in "abc"}
    assert orch.diagnostics() == Diagnostics()


# -- slot leaks ------------------------------------------------------------------------------


def leak_during_release(orch, rec, *, with_occupancy: bool = True) -> None:
    def leak(context, reason) -> None:
        rt = orch.get_session(context.session_id)._runtime  # corrupt it on purpose
        rt.slots[(0, "image")] = engine.runtime.Slot(None, {"encode"})
        if with_occupancy:
            rt.occupancy[("image", "encode")] += 1

    rec.close_hooks["decode"] = leak


async def test_a_slot_leaked_during_stage_release_is_counted_and_poisons(orch, rec):
    leak_during_release(orch, rec)
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await settle()
    s.poll_outputs()
    with pytest.raises(SessionCleanupError, match="still held"):
        await s.aclose()
    assert s.status is State.POISONED
    assert orch.diagnostics().slot_leaks > 0
    assert isinstance(s.cleanup_error, RuntimeError)
    assert [stage for stage, _ in rec.closes_of("a")] == ["decode", "denoise", "encode"]
    # the leaked slot was dropped: a retry settles without releasing any stage again
    await s.aclose()
    assert s.status is State.CLOSED
    assert len(rec.closes_of("a")) == 3


@pytest.mark.parametrize("with_occupancy", [False, True])
async def test_one_leaked_slot_counts_once(orch, rec, with_occupancy):
    leak_during_release(orch, rec, with_occupancy=with_occupancy)
    s = orch.create_session("a")
    with pytest.raises(SessionCleanupError):
        await s.aclose()
    assert orch.diagnostics().slot_leaks == 1


# -- metrics --------------------------------------------------------------------------------

COSTS = {"encode": 0.01, "denoise": 0.05, "decode": 0.02}


async def test_latency_clock_starts_at_the_anchor_artifact(orch, rec, autojump_clock):
    rec.costs.update(COSTS)
    s = orch.create_session("a", final_sequence_id=0)
    s.try_push(0, {"image": "i0"})  # conditions may be prefetched: no clock yet
    await rec.wait_started("encode", "a", 0)
    assert s.metrics().ingress_accepted_at == ()
    autojump_clock.jump(1.0)
    await settle()
    control_at = trio.current_time()
    s.try_push(0, {"control": "c0"})
    assert s.metrics().ingress_accepted_at == ((0, control_at),)
    assert [seq async for seq, _ in s.outputs()] == [0]
    metrics = s.metrics()
    expected = COSTS["denoise"] + COSTS["decode"]
    assert metrics.control_to_output_latency.count == 1
    assert metrics.control_to_output_latency.p50_seconds == pytest.approx(expected)
    assert metrics.first_output_latency_seconds == pytest.approx(expected)


async def test_without_an_anchor_the_first_ingress_starts_the_clock(rec, autojump_clock):
    rec.costs.update(COSTS)
    async with running(rec, canonical_spec(anchor=None)) as orch:
        s = orch.create_session("a", final_sequence_id=0)
        start = trio.current_time()
        s.try_push(0, {"image": "i0"})
        await rec.wait_started("encode", "a", 0)
        autojump_clock.jump(1.0)
        await settle()
        s.try_push(0, {"control": "c0"})
        assert s.metrics().ingress_accepted_at == ((0, start),)
        assert [seq async for seq, _ in s.outputs()] == [0]
        latency = s.metrics().control_to_output_latency.p50_seconds
        assert latency > 1.0


async def test_first_output_latency_and_chunk_period(orch, rec, autojump_clock):
    rec.costs.update(COSTS)
    n = 6
    s = orch.create_session("a", final_sequence_id=n - 1)

    async def feed() -> None:
        for seq in range(n):
            await s.push(seq, chunk(seq))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed)
        got = [seq async for seq, _ in s.outputs()]
    assert got == list(range(n))
    metrics = s.metrics()
    assert metrics.first_output_latency_seconds == pytest.approx(sum(COSTS.values()))
    # the slowest stage (denoise) paces the stream
    assert metrics.chunk_period.count == n - 1
    assert metrics.chunk_period.p50_seconds == pytest.approx(COSTS["denoise"])
    assert metrics.chunk_period.maximum_seconds == pytest.approx(COSTS["denoise"])
    assert metrics.control_to_output_latency.count == n
    assert metrics.control_to_output_latency.minimum_seconds == pytest.approx(sum(COSTS.values()))
    assert metrics.real_time_factor(0.1) == pytest.approx(0.5)
    timings = s.stage_timings("denoise")
    assert [t.sequence_id for t in timings] == list(range(n))
    assert all(t.completed_at - t.admitted_at == pytest.approx(COSTS["denoise"]) for t in timings)
    with pytest.raises(KeyError):
        s.stage_timings("upscale")
