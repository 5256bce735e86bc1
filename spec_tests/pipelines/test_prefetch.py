"""ConditionPrefetch (reference C.2) against a real engine orchestrator on the LingBot-shaped graph.

    encode_request -> encode -> condition -+
                                 control --+-> denoise -> latent -> decode -> frames

The stage handlers are the engine tests' recording, gateable async handlers
(:class:`spec_tests.engine.conftest.Recorder`). A small driver plays the
pipeline's part: it refills the window when denoise of a chunk finishes (as the
toy world service does) and checks the window invariant after every operation.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import pytest
import trio

from engine import EdgeSpec, PipelineSpec, SessionCleanupError, SessionStateError, StageSpec
from pipelines.prefetch import DEPTH, ConditionPrefetch, ControlOrderError
from spec_tests.engine.conftest import Recorder, running, settle
from states.pipeline_session import CloseReason, State
from ..virtual_time import elapse


def lingbot_spec(*, encode_request_capacity: int = 2, capacity: int = 2) -> PipelineSpec:
    return PipelineSpec(
        stages=(
            StageSpec("encode", {"encode_request"}, {"condition"}),
            StageSpec("denoise", {"condition", "control"}, {"latent"}),
            StageSpec("decode", {"latent"}, {"frames"}),
        ),
        edges=(
            EdgeSpec("encode_request", "encode", None, encode_request_capacity),
            EdgeSpec("condition", "denoise", "encode", capacity),
            EdgeSpec("control", "denoise", None, capacity),
            EdgeSpec("latent", "decode", "denoise", capacity),
        ),
        output_artifacts={"frames"},
        output_capacity_per_session=2,
        latency_anchor_artifact="control",
    )


class Driver:
    """One session's prefetch plus the log of every condition it made."""

    def __init__(self, orch: Any, rec: Recorder, session_id: str, *, chunk_count: int | None = None, refill_on_denoise: bool = True):
        final = None if chunk_count is None else chunk_count - 1
        self.session = orch.create_session(session_id, final_sequence_id=final)
        self.session_id = session_id
        self.made: list[int] = []  # make_condition calls, in order
        self.prefetch = ConditionPrefetch(self.session, make_condition=self._make, chunk_count=chunk_count)
        self.refills: list[tuple[int, int]] = []  # (denoised index, how many admitted)
        self.denoised: dict[int, trio.Event] = {}
        if refill_on_denoise:
            rec.hooks.append(self._hook)

    def _make(self, index: int) -> str:
        self.made.append(index)
        return f"request{index}"

    def _hook(self, when: str, inv: Any) -> None:
        key = inv.key
        if when != "exit" or key.stage_id != "denoise" or key.session_id != self.session_id:
            return
        # the pipeline's refill point: denoise of chunk i is over (normally admits condition[i+2])
        if self.session.status is State.RUNNING:
            self.refills.append((key.sequence_id, self.prefetch.refill()))
            self.check()
        self.denoised.setdefault(key.sequence_id, trio.Event()).set()

    async def wait_denoised(self, index: int) -> None:
        await self.denoised.setdefault(index, trio.Event()).wait()

    def check(self) -> None:
        self.prefetch.check_invariant()
        gap = self.prefetch.next_condition_index - self.prefetch.next_control_index
        assert 0 <= gap <= DEPTH

    def cursors(self) -> tuple[int, int]:
        return self.prefetch.next_condition_index, self.prefetch.next_control_index


async def first_output(session: Any) -> tuple[int, Any]:
    async with aclosing(session.outputs()) as outputs:
        async for item in outputs:
            return item
    raise AssertionError("the session ended without output")


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def orch(rec):
    async with running(rec, lingbot_spec()) as orchestrator:
        yield orchestrator


# -- priming -----------------------------------------------------------------------------------


async def test_two_conditions_are_admitted_before_any_control(orch, rec):
    d = Driver(orch, rec, "a")
    assert d.cursors() == (0, 0)
    assert d.prefetch.prime() == 2
    d.check()
    assert d.cursors() == (2, 0)
    assert d.made == [0, 1]
    await settle()
    assert rec.calls_of("encode", "a") == [0, 1]  # both encodes ran with no control yet
    assert rec.calls_of("denoise", "a") == []
    assert d.session.buffered("condition", "denoise") == 2
    assert d.prefetch.refill() == 0  # the window is full
    assert d.made == [0, 1]
    d.check()


async def test_a_single_chunk_session_primes_only_condition_zero(orch, rec):
    d = Driver(orch, rec, "a", chunk_count=1)
    assert d.prefetch.prime() == 1
    assert d.cursors() == (1, 0)
    assert d.made == [0]
    assert d.prefetch.try_submit(0, "control0")
    d.check()
    assert [seq async for seq, _ in d.session.outputs()] == [0]
    assert d.refills == [(0, 0)]  # nothing past the last chunk
    assert d.made == [0]
    with pytest.raises(ControlOrderError, match="past the last chunk"):
        d.prefetch.try_submit(1, "control1")
    assert d.prefetch.can_submit(1) is False


def test_chunk_count_must_be_positive():
    with pytest.raises(ValueError, match="chunk_count"):
        ConditionPrefetch(None, make_condition=str, chunk_count=0)  # type: ignore[arg-type]


# -- refill -----------------------------------------------------------------------------------------


async def test_refill_after_denoise_of_chunk_i_admits_condition_i_plus_2(orch, rec):
    denoise0 = rec.gate("denoise", 0)
    decode0 = rec.gate("decode", 0)
    d = Driver(orch, rec, "a")
    d.prefetch.prime()
    assert d.prefetch.try_submit(0, "control0")
    d.check()
    assert d.cursors() == (2, 1)
    await rec.wait_started("denoise", "a", 0)
    await settle()
    assert d.made == [0, 1]  # no refill while denoise 0 runs
    denoise0.set()
    await d.wait_denoised(0)
    assert d.refills == [(0, 1)]
    assert d.made == [0, 1, 2]
    assert d.cursors() == (3, 1)
    await rec.wait_started("decode", "a", 0)
    await rec.wait_started("encode", "a", 2)
    assert rec.started("decode", "a", 0) and ("decode", "a", 0, "ok") not in rec.ends
    # the encode of condition 2 overlaps the decode of chunk 0
    decode0.set()
    # the next chunks follow the same pattern
    assert d.prefetch.try_submit(1, "control1")
    await d.wait_denoised(1)
    assert d.refills[-1] == (1, 1) and d.made[-1] == 3
    d.check()


async def test_the_invariant_holds_after_every_operation_over_a_whole_session(orch, rec):
    n = 8
    d = Driver(orch, rec, "a", chunk_count=n)
    d.prefetch.prime()
    d.check()
    seen: list[int] = []

    async def read() -> None:
        async for seq, artifacts in d.session.outputs():
            seen.append(seq)
            assert artifacts == {"frames": f"frames@a/{seq}"}
            d.check()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        for index in range(n):
            assert d.prefetch.can_submit(index) or index > 0  # may wait for room
            await d.prefetch.submit(index, f"control{index}")
            d.check()
            await settle()
            d.check()
    assert seen == list(range(n))
    assert d.made == list(range(n))  # each condition made exactly once, in order
    assert d.cursors() == (n, n)
    assert rec.calls_of("encode", "a") == list(range(n))
    assert [i for i, _ in d.refills] == list(range(n))


# -- control order ----------------------------------------------------------------------------------


async def test_duplicate_skipped_and_out_of_order_controls_are_refused_and_admit_nothing(orch, rec):
    rec.gate("denoise", 0)
    d = Driver(orch, rec, "a")
    d.prefetch.prime()
    assert d.prefetch.try_submit(0, "control0")
    await settle()
    before = (d.cursors(), list(d.made), d.session.artifact_stats(), d.session.buffered("control", "denoise"))

    for index, what in ((0, "already has its control"), (2, "skips ahead"), (5, "skips ahead")):
        assert d.prefetch.can_submit(index) is False
        with pytest.raises(ControlOrderError, match=what):
            d.prefetch.try_submit(index, f"bad{index}")
        with pytest.raises(ControlOrderError, match=what):
            await d.prefetch.submit(index, f"bad{index}")
        assert (d.cursors(), d.made, d.session.artifact_stats(), d.session.buffered("control", "denoise")) == before
        d.check()
    assert d.prefetch.try_submit(1, "control1")  # the right one still goes in
    d.check()
    with pytest.raises(ControlOrderError):
        d.prefetch.try_submit(0, "late0")  # out of order: behind the cursor
    assert d.cursors() == (2, 2)


# -- backpressure fallback ----------------------------------------------------------------------------


async def test_control_and_missing_condition_are_admitted_atomically():
    rec = Recorder()
    # encode_request capacity 1 and encode held on chunk 0: the window cannot refill
    async with running(rec, lingbot_spec(encode_request_capacity=1)) as orch:
        enc0 = rec.gate("encode", 0)
        rec.gate("denoise", 0)
        d = Driver(orch, rec, "a", refill_on_denoise=False)
        assert d.prefetch.prime() == 2  # request 0 went to the encode actor, request 1 waits
        await rec.wait_started("encode", "a", 0)
        assert d.session.buffered("encode_request", "encode") == 1
        assert d.prefetch.try_submit(0, "control0")
        assert d.cursors() == (2, 1)
        made = list(d.made)
        assert d.prefetch.refill() == 0  # backpressure keeps condition 2 out
        assert d.cursors() == (2, 1)
        d.check()
        assert d.prefetch.try_submit(1, "control1")  # condition 1 is in: control only
        assert d.cursors() == (2, 2)
        d.check()

        # control 2: its condition is missing and both edges are full -> refused, nothing admitted
        stats = d.session.artifact_stats()
        assert d.prefetch.can_submit(2) is False
        assert d.prefetch.try_submit(2, "control2") is False
        assert d.session.artifact_stats() == stats
        assert d.session.buffered("control", "denoise") == 2
        assert d.session.buffered("encode_request", "encode") == 1
        assert d.cursors() == (2, 2)
        assert 2 not in dict(d.session.metrics().ingress_accepted_at)
        d.check()
        d.session.finish_inputs(2)  # before any stage takes 2, so every stage is told it is the last

        # submit waits for room on both edges, then admits control + condition together
        done = trio.Event()

        async def submit2() -> None:
            await d.prefetch.submit(2, "control2")
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit2)
            await settle()
            assert not done.is_set()
            assert d.cursors() == (2, 2)
            enc0.set()  # encode 0 ends and takes request 1; denoise 0 takes control 0
            await done.wait()
        assert d.cursors() == (3, 3)
        d.check()
        slots = d.session._runtime.slots
        assert (2, "control") in slots
        assert (2, "encode_request") in slots or rec.started("encode", "a", 2)
        assert 2 in dict(d.session.metrics().ingress_accepted_at)
        assert d.made.count(2) >= 1 and d.made[: len(made)] == made
        rec.release_all()
        assert [seq async for seq, _ in d.session.outputs()] == [0, 1, 2]
        assert rec.calls_of("encode", "a") == [0, 1, 2]


# -- purity of can_submit ----------------------------------------------------------------------------------


async def test_can_submit_is_a_pure_query(orch, rec):
    d = Driver(orch, rec, "a", refill_on_denoise=False)
    # nothing primed: the condition of chunk 0 is missing
    for _ in range(3):
        assert d.prefetch.can_submit(0) is True
        assert d.prefetch.can_submit(1) is False
    await settle()
    assert d.made == []
    assert rec.calls_of("encode", "a") == []  # no encode was started
    assert d.session.artifact_stats().slot_count == 0
    assert d.cursors() == (0, 0)
    assert d.session.metrics().ingress_accepted_at == ()


# -- latency anchor ---------------------------------------------------------------------------------


async def test_condition_only_ingress_does_not_start_the_control_to_output_timer(orch, rec, autojump_clock):
    d = Driver(orch, rec, "a")
    d.prefetch.prime()
    await settle()
    assert d.session.metrics().ingress_accepted_at == ()  # two conditions in, no timer yet
    await elapse(5)  # the encodes are long done when the control arrives
    start = trio.current_time()
    assert d.prefetch.try_submit(0, "control0")
    stamps = dict(d.session.metrics().ingress_accepted_at)
    assert stamps == {0: start}
    await first_output(d.session)
    metrics = d.session.metrics()
    assert [seq for seq, _ in metrics.ingress_accepted_at] == [0]  # condition 2 (refill) not counted
    assert d.made == [0, 1, 2]
    # the latency runs from the control, not from the prefetched condition 5 s earlier
    assert metrics.control_to_output_latency.count == 1
    assert metrics.control_to_output_latency.maximum_seconds < 5
    assert metrics.first_output_latency_seconds < 5


# -- several sessions -----------------------------------------------------------------------------------


async def test_sessions_keep_independent_windows(orch, rec):
    a = Driver(orch, rec, "a", chunk_count=4)
    b = Driver(orch, rec, "b", chunk_count=4)
    a.prefetch.prime()
    b.prefetch.prime()
    await a.prefetch.submit(0, "a0")
    await a.wait_denoised(0)
    await a.prefetch.submit(1, "a1")
    await a.wait_denoised(1)
    assert a.cursors() == (4, 2)
    assert b.cursors() == (2, 0)  # b sent no control: its window stays primed, no refill
    assert b.made == [0, 1]
    with pytest.raises(ControlOrderError):
        a.prefetch.try_submit(0, "again")
    with pytest.raises(ControlOrderError):
        b.prefetch.try_submit(1, "skip")
    await b.prefetch.submit(0, "b0")
    await b.wait_denoised(0)
    assert b.cursors() == (3, 1)
    assert a.cursors() == (4, 2)
    for driver in (a, b):
        driver.check()
    outputs: dict[str, list[int]] = {"a": [], "b": []}

    async def read(driver: Driver) -> None:
        async for seq, _ in driver.session.outputs():
            outputs[driver.session_id].append(seq)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, a)
        nursery.start_soon(read, b)
        for index in range(2, 4):
            await a.prefetch.submit(index, f"a{index}")
            a.check()
        for index in range(1, 4):
            await b.prefetch.submit(index, f"b{index}")
            b.check()
    assert outputs == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert rec.calls_of("encode", "a") == rec.calls_of("encode", "b") == [0, 1, 2, 3]


# -- failure and cleanup paths ---------------------------------------------------------------------------


async def test_a_stage_failure_still_cleans_up_the_session(orch, rec):
    boom = RuntimeError("denoise broke")
    rec.fail("denoise", 1, boom, session="a")
    d = Driver(orch, rec, "a")
    other = Driver(orch, rec, "b", chunk_count=2)
    d.prefetch.prime()
    other.prefetch.prime()
    await d.prefetch.submit(0, "control0")
    await d.prefetch.submit(1, "control1")
    await d.session.wait_settled()
    assert d.session.status is State.FAILED
    assert d.session.error is boom
    assert [stage for stage, _ in rec.closes_of("a")] == ["decode", "denoise", "encode"]
    assert {reason for _, reason in rec.closes_of("a")} == {CloseReason.FAILED}
    assert d.prefetch.can_submit(2) is False
    with pytest.raises(SessionStateError):
        d.prefetch.try_submit(2, "control2")
    assert d.prefetch.next_control_index == 2
    d.check()
    # the other session is unaffected
    await other.prefetch.submit(0, "b0")
    await other.prefetch.submit(1, "b1")
    assert [seq async for seq, _ in other.session.outputs()] == [0, 1]


async def test_refill_after_the_session_stopped_admitting_raises_and_admits_nothing(orch, rec):
    """The pipeline refills from its denoise-completion callback, which can run after the
    session failed or began closing: refill then raises SessionStateError (the caller must
    check the session first, as the toy world service does) and moves no cursor."""
    rec.fail("decode", 0, RuntimeError("decode broke"), session="a")
    d = Driver(orch, rec, "a", refill_on_denoise=False)
    d.prefetch.prime()
    await d.prefetch.submit(0, "control0")
    await d.session.wait_settled()
    assert d.session.status is State.FAILED
    with pytest.raises(SessionStateError):
        d.prefetch.refill()
    assert d.cursors() == (2, 1)
    assert d.prefetch.can_submit(1) is False


async def test_a_cleanup_failure_poisons_and_the_retry_finishes_the_release(orch, rec):
    broken = RuntimeError("release failed")
    rec.fail_close_once("denoise", broken)
    d = Driver(orch, rec, "a")
    d.prefetch.prime()
    await d.prefetch.submit(0, "control0")
    assert (await first_output(d.session))[0] == 0
    await settle()
    with pytest.raises(SessionCleanupError):
        await d.session.aclose()
    assert d.session.status is State.POISONED
    assert d.prefetch.can_submit(1) is False
    await d.session.aclose()  # retry releases the rest
    assert d.session.status is State.CLOSED
    assert [stage for stage, _ in rec.closes_of("a")] == ["decode", "denoise", "encode", "denoise"]
    assert d.session.artifact_stats().slot_count == 0
