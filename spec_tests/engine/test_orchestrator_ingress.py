"""Ingress: atomic pushes, backpressure, refusals, finish_inputs, shared ingress, actor map."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import (
    EdgeSpec,
    IngressRefused,
    LocalStageActor,
    Orchestrator,
    PipelineSpec,
    SessionStateError,
    StageOrdering,
    StageSpec,
    open_orchestrator,
)
from states.pipeline_session import State

from .conftest import Recorder, canonical_spec, chunk, running, settle, value

# -- atomic multi-artifact try_push -------------------------------------------------


async def test_try_push_is_all_or_nothing_when_one_edge_is_full(orch, rec):
    rec.gate("encode", 0)
    s = orch.create_session("a")
    # control fills up (denoise cannot run without conditions) while image has room
    assert s.try_push(0, {"control": "c0"})
    assert s.try_push(1, {"control": "c1"})
    assert s.buffered("control", "denoise") == 2
    before = s.artifact_stats()

    assert s.try_push(2, {"image": "i2", "control": "c2"}) is False
    assert s.artifact_stats() == before  # the image was not admitted either
    assert s.buffered("image", "encode") == 0
    assert s.buffered("control", "denoise") == 2

    # the image alone still fits, and is accepted
    assert s.try_push(2, {"image": "i2"})
    assert s.buffered("image", "encode") == 1


class LazyArtifacts(Mapping):
    """Artifacts read as they are asked for; ``image``'s read fails (a loader that raised)."""

    def __init__(self, names: dict[str, Any]) -> None:
        self.names = names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name: str) -> Any:
        if name == "image":
            raise OSError("failed to load 'image'")
        return self.names[name]


@pytest.mark.parametrize("how", ["try_push", "push"])
async def test_a_push_whose_mapping_cannot_be_read_admits_nothing(orch, rec, how):
    """The control was admitted before the image's value failed to read, and the retry was refused: the control
    'for sequence 0 is already buffered', and sequence 0 could never run."""
    s = orch.create_session("a", final_sequence_id=0)
    with pytest.raises(OSError, match="failed to load 'image'"):
        pushed = getattr(s, how)(0, LazyArtifacts({"control": "c0", "image": "i0"}))
        if how == "push":
            await pushed
    assert s.buffered("control", "denoise") == 0 and s.artifact_stats().slot_count == 0
    assert s.try_push(0, {"image": "i0", "control": "c0"})  # the retry is taken whole
    with trio.fail_after(5):
        assert [seq async for seq, _ in s.outputs()] == [0]


async def test_push_waits_for_room_then_completes(orch, rec):
    release = rec.gate("encode", 0)
    s = orch.create_session("a")
    await s.push(0, {"image": "i0"})
    await rec.wait_started("encode", "a", 0)  # image 0 was taken: the edge is empty again
    await s.push(1, {"image": "i1"})
    await s.push(2, {"image": "i2"})
    assert s.buffered("image", "encode") == 2
    assert s.try_push(3, {"image": "i3"}) is False

    pushed = trio.Event()

    async def pusher() -> None:
        await s.push(3, {"image": "i3"})
        pushed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pusher)
        await settle()
        assert not pushed.is_set()  # blocked: the edge is full
        assert s.buffered("image", "encode") == 2
        release.set()  # encode finishes 0 and takes 1: room for one image
        await pushed.wait()
    assert rec.calls_of("encode", "a")[:2] == [0, 1]
    assert s.buffered("image", "encode") <= 2


async def test_blocked_push_raises_when_the_session_is_cancelled(orch, rec):
    rec.gate("encode", 0)
    s = orch.create_session("a")
    for seq in range(3):
        await s.push(seq, {"image": f"i{seq}"})
    await rec.wait_started("encode", "a", 0)
    errors: list[BaseException] = []

    async def pusher() -> None:
        try:
            await s.push(3, {"image": "i3"})
        except SessionStateError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pusher)
        await settle()
        assert not errors
        nursery.start_soon(s.cancel)
        await settle()
        assert len(errors) == 1
        rec.release_all()
    assert s.status is State.CANCELLED


async def test_can_push_is_a_pure_query(orch, rec):
    rec.gate("encode", 0)
    s = orch.create_session("a")
    assert s.can_push(["image", "control"])
    for _ in range(3):
        assert s.can_push(["image"])
    assert s.artifact_stats().slot_count == 0
    assert rec.calls == []

    s.try_push(0, {"control": "c0"})
    s.try_push(1, {"control": "c1"})
    stats = s.artifact_stats()
    assert s.can_push(["image"])
    assert not s.can_push(["control"])
    assert not s.can_push(["image", "control"])
    assert s.artifact_stats() == stats
    assert s.can_push([])  # nothing asked, nothing full

    with pytest.raises(ValueError, match="condition"):
        s.can_push(["condition"])
    await s.cancel()
    assert s.can_push(["image"]) is False  # not running: nothing can be pushed


# -- refusals --------------------------------------------------------------------------


async def test_refusals_name_what_is_wrong(orch):
    s = orch.create_session("a", final_sequence_id=5)
    with pytest.raises(IngressRefused, match=">= 0"):
        s.try_push(-1, chunk(0))
    with pytest.raises(IngressRefused, match="at least one artifact"):
        s.try_push(0, {})
    with pytest.raises(IngressRefused, match="not an ingress artifact"):
        s.try_push(0, {"condition": "x"})
    with pytest.raises(IngressRefused, match="not an ingress artifact"):
        s.try_push(0, {"image": "i0", "bogus": 1})
    with pytest.raises(IngressRefused, match="past the final sequence"):
        s.try_push(6, chunk(6))
    with pytest.raises(IngressRefused, match="past the final sequence"):
        await s.push(6, chunk(6))
    assert s.artifact_stats().slot_count == 0  # a refused push leaves nothing behind
    assert issubclass(IngressRefused, ValueError)


async def test_duplicate_buffered_artifact_is_refused(orch, rec):
    rec.gate("encode", 0)
    s = orch.create_session("a")
    assert s.try_push(0, {"control": "c0"})
    with pytest.raises(IngressRefused, match="already buffered"):
        s.try_push(0, {"control": "again"})
    # atomic: a batch with one duplicate admits nothing
    with pytest.raises(IngressRefused, match="already buffered"):
        s.try_push(0, {"image": "i0", "control": "again"})
    assert s.buffered("image", "encode") == 0
    assert s.try_push(0, {"image": "i0"})  # the other artifact of the same sequence is fine


async def test_sequence_taken_by_a_strict_stage_is_refused(orch, rec):
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await settle()
    assert rec.calls_of("encode", "a") == [0]
    # encode has taken sequence 0 (the slot is gone), so a new image 0 could never run
    with pytest.raises(IngressRefused, match="already taken sequence 0"):
        s.try_push(0, {"image": "again"})
    with pytest.raises(IngressRefused, match="already taken sequence 0"):
        s.try_push(0, {"control": "again"})


async def test_ingress_to_a_session_that_is_not_running_is_refused(orch):
    s = orch.create_session("a")
    await s.aclose()
    assert s.status is State.CLOSED
    with pytest.raises(SessionStateError, match="accepts no input"):
        s.try_push(0, chunk(0))
    with pytest.raises(SessionStateError):
        await s.push(0, chunk(0))
    c = orch.create_session("b")
    await c.cancel()
    with pytest.raises(SessionStateError):
        c.try_push(0, chunk(0))


# -- finish_inputs --------------------------------------------------------------------


async def test_finish_inputs_rules(orch):
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await s.push(1, chunk(1))
    await settle()  # nothing in flight (see the test below for finish_inputs during work)
    with pytest.raises(ValueError):
        s.finish_inputs(-1)
    with pytest.raises(IngressRefused, match="already accepted"):
        s.finish_inputs(0)  # sequence 1 was accepted
    s.finish_inputs(2)
    assert s.final_sequence_id == 2
    s.finish_inputs(2)  # the same value again is harmless
    with pytest.raises(SessionStateError, match="already ends at sequence 2"):
        s.finish_inputs(3)
    with pytest.raises(IngressRefused, match="past the final sequence"):
        s.try_push(3, chunk(3))
    await s.push(2, chunk(2))
    got = [seq async for seq, _ in s.outputs()]  # ends by itself at the final sequence
    assert got == [0, 1, 2]


async def test_finish_inputs_while_work_is_in_flight(orch, rec):
    hold = rec.gate("denoise", 1)
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await s.push(1, chunk(1))
    await rec.wait_started("denoise", "a", 1)
    assert s.in_flight == 1
    with pytest.raises(IngressRefused, match="already accepted"):
        s.finish_inputs(0)
    # encode ran 1 as not the last: declaring it last now would split the stages
    with pytest.raises(IngressRefused, match="'encode' has already taken sequence 1"):
        s.finish_inputs(1)
    assert s.final_sequence_id is None  # the refusal changed nothing
    s.finish_inputs(2)
    await s.push(2, chunk(2))
    hold.set()
    assert [seq async for seq, _ in s.outputs()] == [0, 1, 2]
    assert [(inv.key.stage_id, inv.key.sequence_id) for inv in rec.invocations if inv.is_last] == [
        ("encode", 2), ("denoise", 2), ("decode", 2)
    ]


async def test_finish_inputs_for_a_sequence_only_pushed_is_accepted(orch, rec):
    hold = rec.gate("encode", 0)
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await s.push(1, {"control": "c1"})  # buffered at denoise; no stage has taken 1
    await rec.wait_started("encode", "a", 0)
    s.finish_inputs(1)
    await s.push(1, {"image": "i1"})
    hold.set()
    assert [seq async for seq, _ in s.outputs()] == [0, 1]
    assert [inv.key.sequence_id for inv in rec.invocations if inv.is_last] == [1, 1, 1]


async def test_finish_inputs_set_at_creation_cannot_change(orch):
    s = orch.create_session("a", final_sequence_id=0)
    with pytest.raises(SessionStateError):
        s.finish_inputs(4)
    await s.push(0, chunk(0))
    assert [seq async for seq, _ in s.outputs()] == [0]


async def test_is_first_and_is_last_follow_the_final_sequence(orch, rec):
    s = orch.create_session("a", final_sequence_id=1)
    await s.push(0, chunk(0))
    await s.push(1, chunk(1))
    async for _ in s.outputs():
        pass
    flags = {(inv.key.stage_id, inv.key.sequence_id): (inv.is_first, inv.is_last) for inv in rec.invocations}
    for stage in ("encode", "denoise", "decode"):
        assert flags[(stage, 0)] == (True, False)
        assert flags[(stage, 1)] == (False, True)



async def test_is_first_marks_the_first_call_of_a_stage_that_takes_sequences_out_of_order(autojump_clock):
    """``is_first`` is where per-session state is set up (README): at a NONE-ordered stage that took sequence 1
    before 0 it came on the second call (it meant ``sequence == 0``), after the state was needed."""
    calls: list[tuple[int, bool]] = []

    async def any_order(inv):
        calls.append((inv.key.sequence_id, inv.is_first))
        return {"y": inv.inputs["x"]}

    spec = PipelineSpec(
        stages=[StageSpec("a", {"x"}, {"y"}, ordering=StageOrdering.NONE, max_in_flight_per_session=2,
                          max_in_flight_global=2)],
        edges=[EdgeSpec("x", "a", None, 4)], output_artifacts={"y"}, output_capacity_per_session=4)
    with trio.fail_after(10):
        async with open_orchestrator(spec, {"a": LocalStageActor(any_order, mailbox_capacity=2)}) as orch:
            s = orch.create_session("s", final_sequence_id=1)
            await s.push(1, {"x": 1})
            await orch.barrier()
            await s.push(0, {"x": 0})
            assert [seq async for seq, _ in s.outputs()] == [0, 1]
    assert calls == [(1, True), (0, False)]


# -- an ingress artifact shared by two stages ------------------------------------------


def shared_spec() -> PipelineSpec:
    return PipelineSpec(
        stages=[StageSpec("left", {"x"}, {"a"}), StageSpec("right", {"x"}, {"b"})],
        edges=[EdgeSpec("x", "left", None, 1), EdgeSpec("x", "right", None, 1)],
        output_artifacts={"a", "b"},
        output_capacity_per_session=2,
    )


async def test_shared_ingress_artifact_feeds_both_stages():
    rec = Recorder()
    hold = rec.gate("right", 0)
    async with running(rec, shared_spec()) as orch:
        s = orch.create_session("a", final_sequence_id=1)
        assert s.try_push(0, {"x": "x0"})
        await rec.wait_started("right", "a", 0)
        assert s.try_push(1, {"x": "x1"})
        await settle()
        # left took both; right still holds sequence 1's slot with one reference
        assert rec.calls_of("left", "a") == [0, 1]
        assert rec.calls_of("right", "a") == [0]
        assert s.buffered("x", "left") == 0
        assert s.buffered("x", "right") == 1
        stats = s.artifact_stats()
        assert (stats.slot_count, stats.reference_count) == (1, 1)
        assert not s.can_push(["x"])  # the right-hand edge is full
        hold.set()
        outputs = [item async for item in s.outputs()]
        assert outputs == [
            (0, {"a": value("a", "a", 0), "b": value("b", "a", 0)}),
            (1, {"a": value("a", "a", 1), "b": value("b", "a", 1)}),
        ]
        assert s.artifact_stats().slot_count == 0  # freed once both stages took it
        assert s.can_push(["x"]) is True


# -- pushes out of order -------------------------------------------------------------------


async def test_a_push_ahead_of_a_missing_sequence_leaves_the_last_place_to_it(orch, rec):
    s = orch.create_session("a", final_sequence_id=3)
    assert s.try_push(1, chunk(1))
    # sequence 2 would take the last place on each two-place edge, where 0 (which every stage needs first)
    # could then never come in: it waits instead
    assert s.try_push(2, chunk(2)) is False
    assert s.buffered("image", "encode") == 1
    # the room queries say the same when asked for that sequence (else a caller looping on wait_for_room and
    # try_push would spin): a place is free, but not for 2
    assert s.can_push(["image", "control"]) and s.can_push(["image", "control"], sequence_id=0)
    assert not s.can_push(["image", "control"], sequence_id=2)
    with pytest.raises(ValueError, match="sequence_id"):
        s.can_push(["image"], sequence_id=-1)
    roomed = trio.Event()

    async def wait_then_push() -> None:
        await s.wait_for_room(["image", "control"], sequence_id=2)
        roomed.set()
        assert s.try_push(2, chunk(2))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_then_push)
        await settle()
        assert not roomed.is_set()
        assert s.try_push(0, chunk(0))
    await s.push(3, chunk(3))
    assert [seq async for seq, _ in s.outputs()] == [0, 1, 2, 3]


async def test_a_wait_for_room_past_the_final_sequence_is_refused_as_the_push(orch, rec):
    """A push past the final sequence is refused at once, and so is a wait for its room (it waited for ever). A parked
    wait is refused once finish_inputs makes its sequence one past the end. A
    wait for an artifact buffered or taken already is not refused: a caller may ask about more than it will push
    (a window that sent a sequence's condition ahead of its control asks for both until its next try)."""
    s = orch.create_session("a", final_sequence_id=2)
    await s.push(0, chunk(0))
    with trio.fail_after(5):
        await orch.barrier()
    with pytest.raises(IngressRefused, match="past the final sequence 2"):
        await s.push(3, {"image": 3})
    with pytest.raises(IngressRefused, match="past the final sequence 2"), trio.fail_after(5):
        await s.wait_for_room(["image"], sequence_id=3)
    with trio.fail_after(5):
        await s.wait_for_room(["image", "control"], sequence_id=0)  # taken already: answered by room alone
    t = orch.create_session("b")
    for seq in range(4):  # no control: encode's conditions fill their edge, then images fill theirs
        await t.push(seq, {"image": seq})
    with trio.fail_after(5):
        await orch.barrier()
    refused = []

    async def wait_for_sequence_5() -> None:
        with pytest.raises(IngressRefused, match="past the final sequence 4") as error:
            await t.wait_for_room(["image"], sequence_id=5)
        refused.append(error.value)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_sequence_5)
            await settle()
            assert not refused
            t.finish_inputs(4)
    assert refused


async def _push_in_order_given(order: list[int], capacity: int, any_order_encode: bool) -> list[int]:
    """Each push in its own task, started in ``order``; the sequences output, or TooSlowError on a deadlock."""
    encode = {}
    if any_order_encode:
        encode = dict(ordering=StageOrdering.NONE, max_in_flight_per_session=2, max_in_flight_global=2)
    async with running(Recorder(), canonical_spec(capacity=capacity, output_capacity=capacity, encode=encode)) as orch:
        s = orch.create_session("a", final_sequence_id=len(order) - 1)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for seq in order:
                    nursery.start_soon(s.push, seq, chunk(seq))
                    await settle()  # the push either went in or waits for room before the next one starts
                outputs = [seq async for seq, _ in s.outputs()]
        await s.aclose()
    return outputs


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(6)), st.integers(1, 3), st.booleans())
def test_pushes_in_any_order_all_come_out_in_order(order, capacity, any_order_encode):
    """However a caller orders its pushes (each in its own task), no edge fills with later sequences for good,
    also where the first stage takes sequences in any order."""
    outputs = trio.run(_push_in_order_given, list(order), capacity, any_order_encode,
                       clock=trio.testing.MockClock(autojump_threshold=0))
    assert outputs == list(range(6))


# -- the actor map ------------------------------------------------------------------------


def _actors(stage_ids):
    async def handler(inv):  # pragma: no cover - never runs
        return {}

    return {sid: LocalStageActor(handler, name=sid) for sid in stage_ids}


@pytest.mark.parametrize(
    "stage_ids",
    [("encode", "denoise"), ("encode", "denoise", "decode", "extra"), ("encode", "denoise", "upscale")],
)
async def test_actors_must_match_the_stages(stage_ids):
    spec = canonical_spec()
    async with trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match="actors must match"):
            Orchestrator(spec, _actors(stage_ids), nursery)


async def test_open_orchestrator_refuses_a_wrong_actor_map_with_a_plain_value_error():
    with pytest.raises(ValueError, match="actors must match"):
        async with open_orchestrator(canonical_spec(), _actors(("encode", "denoise"))):
            pass  # pragma: no cover


# -- a push returns before its outputs can be read ----------------------------------------


async def test_a_push_has_returned_to_its_caller_before_any_task_reads_its_outputs():
    """A caller that notes each push once it returns (as a driver stamps its controls) never meets an output it has
    no note for: an admission is done in the pushing task, even when the push waited for room freed on a stage's
    own thread. (Completing a waiting push on the stage's thread let its outputs be read before it returned.)"""
    spec = canonical_spec()

    def instant(stage: StageSpec):
        return lambda invocation: {artifact: invocation.key.sequence_id for artifact in stage.produces}

    actors = {stage.stage_id: LocalStageActor(instant(stage), name=stage.stage_id) for stage in spec.stages}
    chunks = 400
    pushed: set[int] = set()
    unnoted: list[int] = []
    async with open_orchestrator(spec, actors) as orch:
        session = orch.create_session("a", final_sequence_id=chunks - 1)

        async def drive() -> None:
            for k in range(chunks):
                await session.push(k, chunk(k))
                pushed.add(k)

        async def read() -> None:
            async for k, _ in session.outputs():
                if k not in pushed:
                    unnoted.append(k)
                # a reader that works on each output without yielding holds the trio thread while the stages run
                # on, so resumed pushers and readers meet in one batch (trio runs a batch in either order)
                time.sleep(0.0005)  # bench-cost: a slow synchronous reader, 0.5 ms an output (0.2 s in all)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drive)
                nursery.start_soon(read)
    assert unnoted == []
    assert pushed == set(range(chunks))
