"""Scheduling: joins, ordering, concurrency limits, capacity reservation, emission, fairness, idle."""

from __future__ import annotations

import pytest
import trio

from engine import (
    Blocker, EdgeSpec, LocalStageActor, PipelineSpec, ResourceGroupSpec, StageOrdering, StageSpec, open_orchestrator,
)

from .conftest import (
    Recorder,
    canonical_spec,
    check_capacity,
    chunk,
    running,
    settle,
    value,
)

NONE = StageOrdering.NONE

# -- joins and ordering ---------------------------------------------------------------


async def test_denoise_joins_condition_and_control_of_the_same_session_and_sequence(rec):
    spec = canonical_spec(denoise={"ordering": NONE})
    async with running(rec, spec) as orch:
        a = orch.create_session("a")
        b = orch.create_session("b")
        a.try_push(0, {"image": "i0"})
        b.try_push(0, {"control": "c0"})  # another session's control does not join
        a.try_push(1, {"control": "c1"})  # another sequence's control does not join
        await settle()
        assert rec.calls_of("encode") == [("a", 0)]
        assert rec.calls_of("denoise") == []
        a.try_push(0, {"control": "c0"})
        await settle()
        assert rec.calls_of("denoise") == [("a", 0)]
        inputs = rec.invocations[-2].inputs  # denoise, then decode
        assert dict(inputs) == {"condition": value("condition", "a", 0), "control": "c0"}


@pytest.mark.parametrize("ordering", [StageOrdering.PER_SESSION_STRICT, NONE])
async def test_strict_stages_take_sequences_in_order(rec, ordering):
    spec = canonical_spec(capacity=4, output_capacity=4, encode={"ordering": ordering})
    async with running(rec, spec) as orch:
        s = orch.create_session("a")
        s.try_push(2, chunk(2))
        s.try_push(1, chunk(1))
        await settle()
        if ordering is NONE:
            assert rec.calls_of("encode", "a") == [2, 1]  # any ready sequence runs
        else:
            assert rec.calls_of("encode", "a") == []  # waits for sequence 0
        s.try_push(0, chunk(0))
        await settle()
        assert sorted(rec.calls_of("encode", "a")) == [0, 1, 2]
        # denoise and decode are strict: always in order, whatever encode did
        assert rec.calls_of("denoise", "a") == [0, 1, 2]
        assert rec.calls_of("decode", "a") == [0, 1, 2]
        assert [seq for seq, _ in s.poll_outputs()] == [0, 1, 2]


async def test_none_ordering_runs_several_sequences_of_one_session_at_once(rec):
    spec = canonical_spec(
        capacity=3, output_capacity=3,
        denoise={"ordering": NONE, "max_in_flight_per_session": 3, "max_in_flight_global": 3},
    )
    for seq in range(3):
        rec.gate("denoise", seq)
    async with running(rec, spec, concurrent={"denoise"}) as orch:
        s = orch.create_session("a", final_sequence_id=2)
        for seq in range(3):
            await s.push(seq, chunk(seq))
        await settle()
        assert sorted(rec.calls_of("denoise", "a")) == [0, 1, 2]
        assert orch.in_flight("denoise") == 3
        assert orch.actors["denoise"].running == 3
        rec.release_all()
        assert [seq async for seq, _ in s.outputs()] == [0, 1, 2]


async def test_max_in_flight_global_limits_a_stage_across_sessions(rec):
    spec = canonical_spec(encode={"max_in_flight_global": 2})
    rec.gate("encode", 0)
    async with running(rec, spec, concurrent={"encode"}) as orch:
        sessions = [orch.create_session(sid) for sid in "abc"]
        for s in sessions:
            s.try_push(0, chunk(0))
        await settle()
        assert sorted(rec.calls_of("encode")) == [("a", 0), ("b", 0)]  # c waits
        assert orch.in_flight("encode") == 2
        rec.release_all()
        await settle()
        assert sorted(rec.calls_of("encode")) == [("a", 0), ("b", 0), ("c", 0)]
        assert orch.actors["encode"].max_running == 2


async def test_resource_group_limits_concurrency_across_stages(rec):
    spec = canonical_spec(
        capacity=3,
        resource_groups=[ResourceGroupSpec("gpu", 1)],
        encode={"resource_group": "gpu"},
        decode={"resource_group": "gpu"},
    )
    running_in_group: list[int] = [0, 0]  # now, max

    def hook(phase: str, inv) -> None:
        if inv.key.stage_id in ("encode", "decode"):
            running_in_group[0] += 1 if phase == "enter" else -1
            running_in_group[1] = max(running_in_group)
            if phase == "enter":
                assert orch.resource_group_usage("gpu") == 1

    rec.hooks.append(hook)
    hold = rec.gate("decode", 0)
    async with running(rec, spec, concurrent={"encode", "decode"}) as orch:
        s = orch.create_session("a")
        assert orch.resource_group_usage("gpu") == 0
        s.try_push(0, chunk(0))
        await rec.wait_started("decode", "a", 0)
        assert orch.resource_group_usage("gpu") == 1
        s.try_push(1, chunk(1))
        await settle()
        assert rec.calls_of("encode", "a") == [0]  # encode 1 waits for the group
        assert str(s.blocker("encode", 1)) == "resource_group:gpu"
        hold.set()
        await settle()
        for seq in range(2, 5):
            await s.push(seq, chunk(seq))
            await settle()
            s.poll_outputs()
        await settle()
        s.poll_outputs()
        await settle()
        assert rec.calls_of("decode", "a") == [0, 1, 2, 3, 4]
        assert running_in_group[1] == 1
        assert orch.resource_group_usage("gpu") == 0
        with pytest.raises(KeyError):
            orch.resource_group_usage("tpu")


# -- capacity reservation ---------------------------------------------------------------


async def test_buffers_stay_within_capacity_with_a_slow_consumer(rec, spec, autojump_clock):
    rec.costs.update(encode=0.01, denoise=0.02, decode=0.1)
    n = 20
    seen: dict[str, int] = {}

    def record(levels: dict[str, int]) -> None:
        for name, held in levels.items():
            seen[name] = max(seen.get(name, 0), held)

    async with running(rec, spec) as orch:
        s = orch.create_session("a", final_sequence_id=n - 1)
        rec.hooks.append(lambda phase, inv: record(check_capacity(s, spec)))

        async def feed() -> None:
            for seq in range(n):
                await s.push(seq, chunk(seq))
                record(check_capacity(s, spec))

        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            async for seq, _ in s.outputs():
                record(check_capacity(s, spec))
                got.append(seq)
    assert got == list(range(n))
    # the slow decode backed work up to (and never past) every edge's capacity
    assert seen["latent->decode"] == 2
    assert seen["control->denoise"] == 2


async def test_output_capacity_bounds_completed_but_unpolled_outputs(orch, rec, spec):
    s = orch.create_session("a")
    fed: list[int] = []

    async def feed() -> None:
        for seq in range(10):
            await s.push(seq, chunk(seq))
            fed.append(seq)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed)
        await settle()
        assert rec.calls_of("decode", "a") == [0, 1]  # two outputs wait unpolled: decode stops
        assert s.outputs_held == 2
        levels = check_capacity(s, spec)
        assert levels["latent->decode"] == 2  # denoise stopped on the full latent edge
        assert len(fed) < 10  # and ingress stopped behind it
        assert [seq for seq, _ in s.poll_outputs()] == [0, 1]
        await settle()
        assert rec.calls_of("decode", "a") == [0, 1, 2, 3]
        check_capacity(s, spec)
        nursery.cancel_scope.cancel()
    await s.cancel()


async def test_in_flight_work_reserves_downstream_room(orch, rec):
    hold = rec.gate("decode", 0)
    s = orch.create_session("a")
    for seq in range(4):
        await s.push(seq, chunk(seq))
        await settle()
    # decode holds latent 0; latents 1, 2 wait; denoise 3 may not start (its latent would overflow)
    assert rec.calls_of("denoise", "a") == [0, 1, 2]
    assert s.buffered("latent", "decode") == 2
    assert s.blocker("denoise", 3) == Blocker.edge("latent", "decode")
    hold.set()
    await settle()
    assert rec.calls_of("denoise", "a") == [0, 1, 2, 3]


# -- ordered emission -------------------------------------------------------------------


def two_output_spec() -> PipelineSpec:
    """``a`` comes from stage A, ``b`` from stage B; both are outputs."""
    return PipelineSpec(
        stages=[StageSpec("A", {"x"}, {"a", "m"}), StageSpec("B", {"m"}, {"b"})],
        edges=[EdgeSpec("x", "A", None, 2), EdgeSpec("m", "B", "A", 2)],
        output_artifacts={"a", "b"},
        output_capacity_per_session=2,
    )


async def test_outputs_wait_for_every_output_artifact_of_the_sequence():
    rec = Recorder()
    hold = rec.gate("B", 0)
    async with running(rec, two_output_spec()) as orch:
        s = orch.create_session("s")
        s.try_push(0, {"x": 0})
        s.try_push(1, {"x": 1})
        await settle()
        assert rec.calls_of("A", "s") == [0, 1]
        assert s.poll_outputs() == []  # b of 0 and 1 is missing
        s.try_push(2, {"x": 2})
        await settle()
        assert rec.calls_of("A", "s") == [0, 1]  # pending outputs count against output capacity
        hold.set()
        await settle()
        out = s.poll_outputs()
        assert out[:2] == [
            (0, {"a": value("a", "s", 0), "b": value("b", "s", 0)}),
            (1, {"a": value("a", "s", 1), "b": value("b", "s", 1)}),
        ]
        assert all(list(artifacts) == ["a", "b"] for _, artifacts in out)


def chained_output_spec() -> PipelineSpec:
    """``a`` is an output and also feeds stage B."""
    return PipelineSpec(
        stages=[StageSpec("A", {"x"}, {"a"}), StageSpec("B", {"a"}, {"b"})],
        edges=[EdgeSpec("x", "A", None, 2), EdgeSpec("a", "B", "A", 2)],
        output_artifacts={"a", "b"},
        output_capacity_per_session=2,
    )


async def test_an_artifact_can_be_both_an_output_and_an_internal_edge():
    rec = Recorder()
    hold = rec.gate("B", 0)
    async with running(rec, chained_output_spec()) as orch:
        s = orch.create_session("s", final_sequence_id=1)
        s.try_push(0, {"x": 0})
        await rec.wait_started("B", "s", 0)
        assert s.buffered("a", "B") == 0  # B took a0's slot
        s.try_push(1, {"x": 1})
        await settle()
        assert s.buffered("a", "B") == 1
        assert s.poll_outputs() == []
        hold.set()
        out = [item async for item in s.outputs()]
        assert out == [
            (0, {"a": value("a", "s", 0), "b": value("b", "s", 0)}),
            (1, {"a": value("a", "s", 1), "b": value("b", "s", 1)}),
        ]
        assert rec.invocations[-1].inputs == {"a": value("a", "s", 1)}
        assert s.artifact_stats().slot_count == 0


async def test_outputs_are_emitted_in_sequence_order_when_work_completes_out_of_order(rec):
    spec = canonical_spec(decode={"ordering": NONE, "max_in_flight_per_session": 2, "max_in_flight_global": 2})
    hold = rec.gate("decode", 0)
    async with running(rec, spec, concurrent={"decode"}) as orch:
        s = orch.create_session("a", final_sequence_id=1)
        await s.push(0, chunk(0))
        await s.push(1, chunk(1))
        await settle()
        assert ("decode", "a", 1, "ok") in rec.ends
        assert s.poll_outputs() == []  # 1 is done but 0 is not
        hold.set()
        assert [seq async for seq, _ in s.outputs()] == [0, 1]


# -- fairness ------------------------------------------------------------------------------


async def test_sessions_sharing_denoise_are_served_round_robin(orch, rec):
    hold = rec.gate("denoise", 0, session="a")
    a, b, c = (orch.create_session(sid) for sid in "abc")
    a.try_push(0, chunk(0))
    await rec.wait_started("denoise", "a", 0)
    a.try_push(1, chunk(1))
    a.try_push(2, chunk(2))
    await settle()  # a's 1 and 2 are ready for denoise first
    assert sorted(a._runtime.lanes["denoise"].ready) == [1, 2]
    b.try_push(0, chunk(0))
    c.try_push(0, chunk(0))
    await settle()
    assert rec.calls_of("denoise") == [("a", 0)]
    hold.set()
    await settle()
    # first come first served would be a0 a1 a2 b0 c0
    assert rec.calls_of("denoise") == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("a", 2)]


# -- idle attribution -----------------------------------------------------------------------


async def test_idle_interval_names_the_missing_input(orch, rec, autojump_clock):
    hold = rec.gate("denoise", 0)
    s = orch.create_session("a")
    s.try_push(0, {"image": "i0", "control": "c0"})
    s.try_push(1, {"image": "i1"})
    await settle()
    hold.set()
    await settle()
    autojump_clock.jump(0.5)
    s.try_push(1, {"control": "c1"})
    await settle()
    [interval] = s.idle_intervals("denoise")
    assert (interval.previous_sequence_id, interval.sequence_id) == (0, 1)
    assert interval.idle_seconds == pytest.approx(0.5)
    assert interval.reason == "control"
    assert interval.missing_inputs == ("control",)


async def test_idle_interval_reason_uses_the_spec_artifact_names(autojump_clock):
    spec = PipelineSpec(
        stages=[StageSpec("P", {"u"}, {"v"}), StageSpec("Q", {"v", "w"}, {"z"})],
        edges=[EdgeSpec("u", "P", None, 2), EdgeSpec("v", "Q", "P", 2), EdgeSpec("w", "Q", None, 2)],
        output_artifacts={"z"},
        output_capacity_per_session=4,
    )
    rec = Recorder()
    async with running(rec, spec) as orch:
        s = orch.create_session("s")
        s.try_push(0, {"u": 0, "w": 0})
        await settle()
        autojump_clock.jump(1.0)
        s.try_push(1, {"u": 1, "w": 1})
        await settle()
        [interval] = s.idle_intervals("Q")
        assert interval.reason == "v+w"
        assert interval.missing_inputs == ("v", "w")
        assert interval.idle_seconds == pytest.approx(1.0)


async def test_idle_interval_reports_the_blocker_when_inputs_were_ready(orch, rec, autojump_clock):
    hold = rec.gate("decode", 0)
    s = orch.create_session("a")
    for seq in range(3):
        await s.push(seq, chunk(seq))
    await settle()
    hold.set()
    await settle()
    assert rec.calls_of("decode", "a") == [0, 1]  # 2 waits: two outputs are unpolled
    autojump_clock.jump(0.25)
    s.poll_outputs()
    await settle()
    first, second = s.idle_intervals("decode")
    assert first.reason == "continuous"
    assert (second.sequence_id, second.reason) == (2, "output_capacity:frames")
    assert second.idle_seconds == pytest.approx(0.25)
    assert second.missing_inputs == ()


# -- one actor serving several stages ---------------------------------------------------


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_an_actor_serving_two_stages_runs_every_session_to_its_end(is_async):
    """One actor for two stages, several sessions, every input pushed at once: the actor's mailbox fills with one
    stage's calls, so the other's are refused busy, and each must be offered again once a call of either stage
    frees a place (retried only when its own stage finished a call, every session stopped after its first output)."""
    chunks, sessions = 6, 3
    spec = PipelineSpec(
        stages=(StageSpec("a", {"x"}, {"y"}, max_in_flight_global=3), StageSpec("b", {"y"}, {"z"}, max_in_flight_global=3)),
        edges=(EdgeSpec("x", "a", None, chunks), EdgeSpec("y", "b", "a", 1)),
        output_artifacts={"z"},
        output_capacity_per_session=chunks,
    )

    def step(invocation):
        return {"y": invocation.inputs["x"]} if invocation.key.stage_id == "a" else {"z": invocation.inputs["y"]}

    async def async_step(invocation):
        return step(invocation)

    actor = LocalStageActor(async_step if is_async else step)
    async with open_orchestrator(spec, {"a": actor, "b": actor}) as orch:
        handles = [orch.create_session(f"s{index}", final_sequence_id=chunks - 1) for index in range(sessions)]
        for handle in handles:
            for seq in range(chunks):
                assert handle.try_push(seq, {"x": seq})
        read: dict[str, list[int]] = {handle.session_id: [] for handle in handles}

        async def reader(handle) -> None:
            async for seq, outputs in handle.outputs():
                assert outputs == {"z": seq}
                read[handle.session_id].append(seq)

        with trio.fail_after(30):  # the calls take no time: only a stall reaches it
            async with trio.open_nursery() as nursery:
                for handle in handles:
                    nursery.start_soon(reader, handle)
            await orch.barrier()
        assert read == {handle.session_id: list(range(chunks)) for handle in handles}
        for handle in handles:
            await handle.aclose()
