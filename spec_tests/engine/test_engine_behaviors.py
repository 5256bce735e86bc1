"""Behaviors a review found wrong, each through the public API: failure causes, quiescence under
backpressure, references after a call, long-session metrics, actors that complete inside submit."""

from __future__ import annotations

import contextlib
import gc
import threading
import traceback
import weakref
from typing import Any

import outcome
import pytest
import trio

from engine import (
    ActorFailedError,
    ActorHealth,
    EdgeSpec,
    FatalStageError,
    InProcessWorkerGroup,
    LocalStageActor,
    ParallelWorkerStageActor,
    PipelineSpec,
    StageOrdering,
    StageSpec,
    open_orchestrator,
)
from states.pipeline_session import State
from states.stage_actor import State as ActorState

from .conftest import canonical_spec, chunk, running
from ..virtual_time import elapse

# -- failure causes ------------------------------------------------------------------------------


async def test_a_fatal_stage_error_is_the_cause_of_every_other_session_s_failure(rec, autojump_clock):
    boom = FatalStageError("the denoise model's state is corrupt")
    rec.fail("denoise", 0, boom, session="a")
    async with running(rec) as orch:
        a, b = orch.create_session("a"), orch.create_session("b")
        await b.push(0, {"image": "i0"})  # b waits for its control at denoise
        await a.push(0, chunk(0))
        await a.wait_settled()
        await b.wait_settled()
        assert a.error is boom  # the session whose call surfaced it keeps the original
        assert isinstance(b.error, ActorFailedError) and b.error.__cause__ is boom
        assert a.status is State.FAILED and b.status is State.FAILED


class Rank:
    """A worker rank whose group dies during one call (as a crashed rank process does)."""

    def __init__(self, group: list[InProcessWorkerGroup], die_on: int) -> None:
        self.group = group
        self.die_on = die_on

    def denoise(self, session: str, seq: int) -> str:
        if seq == self.die_on and session == "a":
            self.group[0].fail("rank 0 lost its device")
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return f"latent@{session}/{seq}"


async def test_a_worker_group_failure_keeps_the_original_error_and_gives_it_as_cause():
    holder: list[InProcessWorkerGroup] = []
    group = InProcessWorkerGroup(lambda rank: Rank(holder, die_on=1))
    holder.append(group)
    spec = canonical_spec()
    actors = {
        "encode": LocalStageActor(lambda inv: {"condition": inv.inputs["image"]}, name="encode"),
        "denoise": ParallelWorkerStageActor(
            group, "denoise", name="denoise",
            input_builder=lambda inv: ((inv.key.session_id, inv.key.sequence_id), {}),
            output_builder=lambda value, inv: {"latent": value},
        ),
        "decode": LocalStageActor(lambda inv: {"frames": inv.inputs["latent"]}, name="decode"),
    }
    async with open_orchestrator(spec, actors) as orch:
        a, b = orch.create_session("a"), orch.create_session("b")
        await b.push(0, {"image": "i0"})
        for seq in range(2):
            await a.push(seq, chunk(seq))
        with trio.fail_after(10):
            await a.wait_settled()
            await b.wait_settled()
        original = a.error
        assert isinstance(original, RuntimeError) and "illegal memory access" in str(original)
        assert isinstance(b.error, ActorFailedError)
        assert b.error.__cause__ is original  # the other session learns why, not just that
        assert orch.actor_health("denoise").state is ActorState.FAILED


# -- quiescence -------------------------------------------------------------------------------------


async def test_barrier_returns_while_an_unread_output_queue_holds_ready_work(orch, rec, autojump_clock):
    s = orch.create_session("a")
    for seq in range(4):
        await s.push(seq, chunk(seq))  # output capacity 2: decode of 2 waits for a reader
    with trio.fail_after(5):
        await orch.barrier()
    assert rec.calls_of("decode", "a") == [0, 1]
    assert s.blocker("decode", 2) is not None and str(s.blocker("decode", 2)) == "output_capacity:frames"
    assert [seq for seq, _ in s.poll_outputs()] == [0, 1]
    with trio.fail_after(5):
        await orch.barrier()  # the freed room let 2 and 3 through; quiescent again
    assert rec.calls_of("decode", "a") == [0, 1, 2, 3]


async def test_barrier_returns_while_a_full_edge_holds_ready_work(orch, rec, autojump_clock):
    s = orch.create_session("a")
    for seq in range(4):
        await s.push(seq, {"image": f"i{seq}"})  # no control: conditions fill their edge
    with trio.fail_after(5):
        await orch.barrier()
    assert rec.calls_of("encode", "a") == [0, 1]
    assert str(s.blocker("encode", 2)) == "edge_capacity:condition->denoise"


@pytest.mark.parametrize("leave", ["break", "cancel"])
async def test_a_reader_that_leaves_its_outputs_loop_leaves_the_rest_for_the_next_read(leave, rec, autojump_clock):
    """``outputs()`` takes each output as it yields it: a reader that breaks out after the first (or is cancelled
    in its loop's body) leaves the others queued (they were taken as a batch and lost with the abandoned loop)."""
    async with running(rec, canonical_spec(output_capacity=4)) as orch:
        s = orch.create_session("a")
        for seq in range(4):
            await s.push(seq, chunk(seq))
        with trio.fail_after(5):
            await orch.barrier()
        first = []
        with trio.move_on_after(1):
            async with contextlib.aclosing(s.outputs()) as outputs:
                async for seq, _ in outputs:
                    first.append(seq)
                    if leave == "break":
                        break
                    await trio.Event().wait()  # cancelled here, in the loop's body, holding output 0
        assert first == [0]
        assert [seq for seq, _ in s.poll_outputs()] == [1, 2, 3]


# -- references after a call ------------------------------------------------------------------------


class Payload:
    """A stand-in for a tensor: something a closed session must not keep alive."""

    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_no_actor_keeps_a_call_s_inputs_or_outputs_after_it_ends(kind):
    made: dict[str, weakref.ref] = {}

    def stage(consumes: str, produces: str) -> Any:
        def handle(inv: Any) -> dict[str, Any]:
            out = Payload(f"{produces}{inv.key.sequence_id}")
            made[out.name] = weakref.ref(out)
            assert isinstance(inv.inputs[consumes], Payload)
            return {produces: out}

        async def handle_async(inv: Any) -> dict[str, Any]:
            return handle(inv)

        return LocalStageActor(handle if kind == "sync" else handle_async, name=produces)

    spec = PipelineSpec(
        stages=[StageSpec("encode", {"image"}, {"condition"}), StageSpec("decode", {"condition"}, {"frames"})],
        edges=[EdgeSpec("image", "encode", None, 1), EdgeSpec("condition", "decode", "encode", 1)],
        output_artifacts={"frames"},
    )
    actors = {"encode": stage("image", "condition"), "decode": stage("condition", "frames")}
    async with open_orchestrator(spec, actors) as orch:
        s = orch.create_session("a", final_sequence_id=0)
        image = Payload("image0")
        made["image0"] = weakref.ref(image)
        await s.push(0, {"image": image})
        del image
        outputs = [item async for item in s.outputs()]
        assert [seq for seq, _ in outputs] == [0]
        del outputs  # the reader drops the frame it got
        await s.aclose()
        with trio.fail_after(5):
            await orch.barrier()
        alive = sorted(name for name, ref in made.items() if ref() is not None)
        assert alive == [], f"still referenced after the calls ended: {alive}"


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("error", [ValueError, FatalStageError])
async def test_a_failed_call_s_error_keeps_none_of_its_inputs(kind, error):
    """The handler's frame, its invocation in it, lived on in the error's traceback: for as long as the session
    handle keeps its ``error``, and for a fatal error the actor's life (its health's ``failure_cause``)."""

    def handle(inv: Any) -> dict[str, Any]:
        assert isinstance(inv.inputs["control"], Payload)
        raise error("the device is lost")

    async def handle_async(inv: Any) -> dict[str, Any]:
        return handle(inv)

    spec = PipelineSpec(stages=[StageSpec("denoise", {"control"}, {"frames"})],
                        edges=[EdgeSpec("control", "denoise", None, 1)], output_artifacts={"frames"})
    actor = LocalStageActor(handle if kind == "sync" else handle_async, name="denoise")
    async with open_orchestrator(spec, {"denoise": actor}) as orch:
        s = orch.create_session("a", final_sequence_id=0)
        control = Payload("control0")
        kept = weakref.ref(control)
        await s.push(0, {"control": control})
        del control
        with trio.fail_after(5):
            await s.wait_settled()
        assert isinstance(s.error, error) and "the device is lost" in str(s.error)
        assert (orch.actor_health("denoise").failure_cause is s.error) == (error is FatalStageError)
        gc.collect()
        assert kept() is None, "the failed call's input lives on in its error"
        assert "raise error(" in "".join(traceback.format_exception(s.error))  # its lines are still told


# -- long sessions ------------------------------------------------------------------------------------


async def test_metrics_stay_right_and_bounded_over_100_000_chunks(autojump_clock):
    chunks = 100_000  # 24 times the 4096-record windows: past them, what is kept must stay bounded

    async def handle(inv: Any) -> dict[str, Any]:
        if inv.key.sequence_id == 0:
            await elapse(1.0)  # the first output comes one (virtual) second after its input
        return {"frames": None}

    spec = PipelineSpec(
        stages=[StageSpec("render", {"control"}, {"frames"})],
        edges=[EdgeSpec("control", "render", None, 64)],  # wide edges: the test moves chunks in batches
        output_artifacts={"frames"},
        output_capacity_per_session=64,
        latency_anchor_artifact="control",
    )
    async with open_orchestrator(spec, {"render": LocalStageActor(handle, name="render")}) as orch:
        s = orch.create_session("long", final_sequence_id=chunks - 1)
        start = trio.current_time()
        read = 0

        async def feed() -> None:
            for seq in range(chunks):
                if not s.try_push(seq, {"control": seq}):
                    await s.push(seq, {"control": seq})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            async for _seq, _ in s.outputs():
                read += 1
        metrics = s.metrics()
        assert read == chunks
        assert metrics.first_output_latency_seconds == pytest.approx(1.0)
        latency = metrics.control_to_output_latency
        assert latency.count == chunks
        assert latency.maximum_seconds == pytest.approx(1.0)
        assert latency.minimum_seconds == pytest.approx(0.0, abs=1e-9)
        # 0 and the controls buffered behind it (the edge holds 64) waited the second; later ones none
        assert latency.mean_seconds == pytest.approx(65.0 / chunks, rel=1e-6)
        period = metrics.chunk_period
        assert period.count == chunks - 1
        assert period.maximum_seconds == pytest.approx(0.0, abs=1e-9)  # every later output came at once
        assert trio.current_time() - start == pytest.approx(1.0)
        # bounded: per-sequence records keep a recent window, not the whole session
        assert len(metrics.output_emitted_at) <= 4096 and len(metrics.ingress_accepted_at) <= 4096
        assert len(s.stage_timings("render")) <= 4096
        assert metrics.output_emitted_at[-1][0] == chunks - 1
        await s.aclose()


# -- actors that complete inside submit ---------------------------------------------------------------


class InlineActor:
    """A StageActor that computes the result and calls ``on_done`` before ``submit`` returns."""

    def __init__(self, produces: str) -> None:
        self.name = f"inline-{produces}"
        self.produces = produces
        self.calls = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def submit(self, invocation: Any, on_done: Any) -> None:
        self.calls += 1
        on_done(invocation, outcome.Value({self.produces: f"{self.produces}{invocation.key.sequence_id}"}))

    def health(self) -> ActorHealth:
        return ActorHealth(ActorState.RUNNING, 0)

    def is_healthy(self) -> bool:
        return True

    async def close_session(self, context: Any, reason: Any) -> None:
        pass

    async def barrier(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


async def test_an_actor_that_completes_inside_submit_does_not_wedge_its_session(autojump_clock):
    spec = canonical_spec()
    actors = {"encode": InlineActor("condition"), "denoise": InlineActor("latent"), "decode": InlineActor("frames")}
    async with open_orchestrator(spec, actors) as orch:
        s = orch.create_session("a", final_sequence_id=9)

        async def feed() -> None:
            for seq in range(10):
                await s.push(seq, chunk(seq))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(feed)
                got = [seq async for seq, _ in s.outputs()]
        assert got == list(range(10))
        assert [a.calls for a in actors.values()] == [10, 10, 10]
        assert s.in_flight == 0
        await s.aclose()
        assert s.status is State.CLOSED
        assert orch.diagnostics().duplicate_results == 0 and orch.diagnostics().slot_leaks == 0


# -- one thread wake-up per stage hop -------------------------------------------------------------


class SubmitterLog(LocalStageActor):
    """A LocalStageActor that notes which thread each invocation was submitted from."""

    def __init__(self, *args: Any, log: list[tuple[str, int, int]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._log = log

    def submit(self, invocation: Any, on_done: Any) -> None:
        self._log.append((self.name, invocation.key.sequence_id, threading.get_ident()))
        super().submit(invocation, on_done)


async def test_a_finished_stage_hands_the_next_stage_its_work_from_its_own_thread():
    log: list[tuple[str, int, int]] = []
    spec = canonical_spec()
    actors = {
        "encode": SubmitterLog(lambda inv: {"condition": inv.inputs["image"]}, name="encode", log=log),
        "denoise": SubmitterLog(lambda inv: {"latent": inv.inputs["control"]}, name="denoise", log=log),
        "decode": SubmitterLog(lambda inv: {"frames": inv.inputs["latent"]}, name="decode", log=log),
    }
    trio_thread = threading.get_ident()
    async with open_orchestrator(spec, actors) as orch:
        s = orch.create_session("a", final_sequence_id=0)
        await s.push(0, chunk(0))
        with trio.fail_after(10):
            assert [seq async for seq, _ in s.outputs()] == [0]
        submitters = {name: ident for name, _, ident in log}
        assert submitters["encode"] == trio_thread  # the push made encode ready
        # each later hop: the stage that made the input submitted the next stage from its own thread
        assert submitters["denoise"] == actors["encode"].thread_ident
        assert submitters["decode"] == actors["denoise"].thread_ident
        await s.aclose()


# -- a stage that takes sequences out of order never strands an earlier one -------------------------------------


async def _copy_x(inv):
    return {"y": inv.inputs["x"]}


async def _copy_y(inv):
    return {"z": inv.inputs["y"]}


def _out_of_order_spec(shape: str) -> tuple[PipelineSpec, dict[str, LocalStageActor]]:
    """``a`` (ordering NONE, two calls at once) alone before a one-place output queue, or before a strict ``b``
    over a one-place edge; in ``join`` it waits for a second ingress artifact ``c``."""
    free = {"ordering": StageOrdering.NONE, "max_in_flight_per_session": 2, "max_in_flight_global": 2}
    a_inputs = {"x", "c"} if shape == "join" else {"x"}
    ingress = [EdgeSpec("x", "a", None, 2)] + ([EdgeSpec("c", "a", None, 2)] if shape == "join" else [])
    if shape == "output":
        spec = PipelineSpec(stages=[StageSpec("a", a_inputs, {"y"}, **free)], edges=ingress,
                            output_artifacts={"y"}, output_capacity_per_session=1)
        return spec, {"a": LocalStageActor(_copy_x, mailbox_capacity=2)}
    spec = PipelineSpec(stages=[StageSpec("a", a_inputs, {"y"}, **free), StageSpec("b", {"y"}, {"z"})],
                        edges=[*ingress, EdgeSpec("y", "b", "a", 1)], output_artifacts={"z"}, output_capacity_per_session=4)
    return spec, {"a": LocalStageActor(_copy_x, mailbox_capacity=2), "b": LocalStageActor(_copy_y)}


@pytest.mark.parametrize("shape", ["output", "edge", "join"])
async def test_a_later_sequence_ready_first_never_takes_the_place_an_earlier_one_needs(shape, autojump_clock):
    """Sequence 1 became ready at a NONE-ordered stage before 0 (pushed first, or its join complete first) and its
    result took the only place downstream, where it waited for 0 for good: nothing came out, and a drain then
    reported ``ok``, CLOSED, with both chunks lost. A stage now takes a later sequence only while a place stays for
    the lower one: 1 waits, 0 runs, then 1; both come out, in order, and the drain is a real one."""
    spec, actors = _out_of_order_spec(shape)
    with trio.fail_after(10):
        async with open_orchestrator(spec, actors) as orch:
            s = orch.create_session("s", final_sequence_id=1)
            if shape == "join":
                await s.push(0, {"x": 0})
                await s.push(1, {"x": 1, "c": 1})
            else:
                await s.push(1, {"x": 1})
            await orch.barrier()
            assert s.blocker("a", 1) is not None  # 1 waits for 0: the last place downstream is 0's
            await s.push(0, {"c": 0} if shape == "join" else {"x": 0})
            got = [seq async for seq, _ in s.outputs()]
            assert got == [0, 1]
            await s.aclose()
            assert s.status is State.CLOSED and ("drain", "ok") in s.shutdown_phases


async def test_an_idle_gap_held_by_backpressure_names_the_limit_not_an_input_that_came_a_moment_late(autojump_clock):
    """Sequence 1's input came a moment after the stage ended sequence 0, and the unread output then held it for
    half a second: the gap was blamed on the input (``reason='x'``), though ``blocker()`` named the output queue."""
    spec = PipelineSpec(stages=[StageSpec("a", {"x"}, {"y"})], edges=[EdgeSpec("x", "a", None, 2)],
                        output_artifacts={"y"}, output_capacity_per_session=1)
    async def handle(inv: Any) -> dict[str, Any]:  # in trio: the autojumping clock waits for no thread
        return {"y": 1}

    async with open_orchestrator(spec, {"a": LocalStageActor(handle)}) as orch:
        s = orch.create_session("s", final_sequence_id=1)
        await s.push(0, {"x": 0})
        await orch.barrier()  # output 0 unread: the output queue is full
        await s.push(1, {"x": 1})
        await trio.sleep(0.5)  # bench-cost: a slow reader, on the autojumping clock (virtual, no wall time)
        assert [seq async for seq, _ in s.outputs()] == [0, 1]
        assert str(s.blocker("a", 1)) == "output_capacity:y"
        (interval,) = s.idle_intervals("a")
        assert interval.reason == "output_capacity:y", interval
        assert interval.idle_seconds >= 0.5
