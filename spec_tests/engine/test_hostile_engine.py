"""A hostile or careless user of the engine's public API: each mistake is a clear typed error that
changes nothing, and no close is lost or hangs (every wait here is bounded by ``trio.fail_after``)."""

from __future__ import annotations

import enum
import math
import threading

import numpy as np
import pytest
import trio
import trio.testing

from engine import (
    IngressRefused,
    LocalStageActor,
    OutputsBusyError,
    WrongThreadError,
    open_orchestrator,
)
from states.pipeline_session import State
from states.stage_actor import State as ActorState

from .conftest import canonical_spec, chunk, running
from ..virtual_time import elapse

BAD_TIMEOUTS = [math.nan, -1.0, "30", None, True]
BAD_TIMEOUT_IDS = ["nan", "negative", "str", "none", "bool"]


def plain_actors(spec):
    def stage(produces):
        return lambda inv: {a: f"{a}{inv.key.sequence_id}" for a in produces}

    return {s.stage_id: LocalStageActor(stage(s.produces), name=s.stage_id) for s in spec.stages}


async def one_call_running(orch, rec):
    """A session "a" whose chunk 0 is running at denoise (held there by the test's gate)."""
    s = orch.create_session("a")
    await s.push(0, chunk(0))
    await rec.wait_started("denoise", "a", 0)
    return s


# -- closing the orchestrator ---------------------------------------------------------------------


async def test_an_orchestrator_close_its_caller_cancelled_is_finished_by_the_next_close(rec, autojump_clock):
    """A cancelled ``aclose`` once left every later close (open_orchestrator's exit included) waiting forever."""
    gate = rec.gate("denoise", 0)
    with trio.fail_after(10):
        async with running(rec) as orch:
            s = await one_call_running(orch, rec)
            with trio.move_on_after(1) as caller:  # the caller gives up while the running call holds the shutdown
                await orch.aclose()
            assert caller.cancelled_caught
            assert s.status is State.SHUTTING_DOWN
            gate.set()
        assert s.status is State.CLOSED  # the exit finished the close the cancelled call began
    assert rec.actor_closes == ["decode", "denoise", "encode"]
    assert orch.diagnostics().slot_leaks == 0


async def test_concurrent_orchestrator_closes_each_return_once_everything_closed(rec):
    gate = rec.gate("denoise", 0)
    with trio.fail_after(10):
        async with running(rec) as orch:
            s = await one_call_running(orch, rec)
            returned = []

            async def close(name: str) -> None:
                await orch.aclose()
                returned.append((name, s.status, [orch.actor_health(st).state for st in ("encode", "decode")]))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close, "first")
                nursery.start_soon(close, "second")
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
    closed = [State.CLOSED, [ActorState.CLOSED, ActorState.CLOSED]]
    assert sorted(returned) == [("first", *closed), ("second", *closed)]
    assert rec.actor_closes == ["decode", "denoise", "encode"]  # each actor closed once


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=BAD_TIMEOUT_IDS)
async def test_a_bad_close_timeout_is_refused_before_anything_starts(timeout):
    """A NaN or a string once failed the close halfway, and open_orchestrator's exit then never returned."""
    spec = canonical_spec()
    actors = plain_actors(spec)
    with trio.fail_after(10):
        with pytest.raises(ValueError, match="close_timeout must be a number of seconds >= 0"):
            async with open_orchestrator(spec, actors, close_timeout=timeout):
                pytest.fail("the body must not run")  # pragma: no cover
        assert all(a.health().state is ActorState.STARTING for a in actors.values())  # none was started


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=BAD_TIMEOUT_IDS)
async def test_bad_timeouts_of_closes_are_refused_and_change_nothing(rec, timeout):
    with trio.fail_after(10):
        async with running(rec) as orch:
            s = orch.create_session("a")
            await s.push(0, chunk(0))
            with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
                await s.aclose(timeout=timeout)
            if timeout is not None:  # None: the default drain (half of timeout)
                with pytest.raises(ValueError, match="drain_timeout must be a number of seconds >= 0"):
                    await s.aclose(drain_timeout=timeout)
            with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
                await s.cancel(timeout=timeout)
            with pytest.raises(ValueError, match="close_timeout must be a number of seconds >= 0"):
                async with orch.session("b", close_timeout=timeout):
                    pytest.fail("the body must not run")  # pragma: no cover
            assert orch.session_ids == ("a",)
            with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
                await orch.aclose(timeout=timeout)
            # nothing changed: the session still runs and takes input, the orchestrator takes sessions
            assert s.status is State.RUNNING
            await s.push(1, chunk(1))
            s.finish_inputs(1)
            assert [seq async for seq, _ in s.outputs()] == [0, 1]
            async with orch.session("c", final_sequence_id=0) as c:
                await c.push(0, chunk(0))
            assert c.status is State.CLOSED
            await s.aclose(timeout=math.inf)
            assert s.status is State.CLOSED


# -- actors have one owner ---------------------------------------------------------------------------


async def test_actors_already_running_elsewhere_are_refused_and_not_closed():
    """A second orchestrator given the first one's actors once closed them while the first still ran."""
    spec = canonical_spec()
    actors = plain_actors(spec)
    with trio.fail_after(10):
        async with open_orchestrator(spec, actors) as first:
            with pytest.raises(ValueError, match="is running and cannot be started again"):
                async with open_orchestrator(spec, actors):
                    pytest.fail("the body must not run")  # pragma: no cover
            assert all(a.health().state is ActorState.RUNNING for a in actors.values())
            s = first.create_session("a", final_sequence_id=1)
            await s.push(0, chunk(0))
            await s.push(1, chunk(1))
            assert [seq async for seq, _ in s.outputs()] == [0, 1]
            await s.aclose()
            assert s.status is State.CLOSED
        with pytest.raises(ValueError, match="is closed and cannot be started again"):
            async with open_orchestrator(spec, actors):
                pytest.fail("the body must not run")  # pragma: no cover


async def test_an_orchestrator_cancelled_as_it_opens_ends_with_no_actor_left_running():
    """A cancel that had reached ``open_orchestrator`` before its actors' nursery was handed over (an app shutting
    down while a pipeline started, as a drained server does) made trio keep that nursery's host task where it was
    started, shielded and asleep for ever: the exit hung, and a server's shutdown with it."""
    spec = canonical_spec()
    actors = plain_actors(spec)
    threads = set(threading.enumerate())
    with trio.fail_after(10):  # a bound only where nothing is shielded: the hang was not one it could end
        with trio.CancelScope() as caller:
            caller.cancel()
            async with open_orchestrator(spec, actors):
                pytest.fail("the body of a cancelled open must not run")  # pragma: no cover
    assert caller.cancelled_caught
    assert all(a.health().state is not ActorState.RUNNING for a in actors.values()), {
        name: a.health().state for name, a in actors.items()}
    # no actor thread left behind (a thread of an earlier test, an idle one of trio's cache, may end meanwhile)
    assert set(threading.enumerate()) - threads == set()


# -- bad input ----------------------------------------------------------------------------------------

HUGE = 10**5000  # Python refuses to print an int this long: a message that quotes it must not try

BAD_SEQUENCE_IDS = [True, False, -1, -HUGE, HUGE, 2**63, 1.0, "0", None]
BAD_SEQUENCE_IDS_SHOWN = [
    "True", "False", "-1", "-<an int of 16610 bits>", "<an int of 16610 bits>", "9223372036854775808",
    "1.0", "'0'", "None",
]


@pytest.mark.parametrize(("seq", "named"), list(zip(BAD_SEQUENCE_IDS, BAD_SEQUENCE_IDS_SHOWN)), ids=BAD_SEQUENCE_IDS_SHOWN)
async def test_a_bad_sequence_id_is_refused_by_name_and_changes_nothing(orch, seq, named):
    s = orch.create_session("a")
    with pytest.raises(IngressRefused, match=r"sequence id must be an int in 0\.\.2\*\*63-1") as refused:
        s.try_push(seq, chunk(0))
    assert str(refused.value).endswith(f"got {named}")
    with pytest.raises(IngressRefused, match="sequence id must be"):
        await s.push(seq, chunk(0))
    assert s.artifact_stats().slot_count == 0
    assert s.metrics().ingress_accepted_at == ()
    s.finish_inputs(0)  # the session still works, from sequence 0
    await s.push(0, chunk(0))
    assert [q async for q, _ in s.outputs()] == [0]


@pytest.mark.parametrize("artifacts", [{"image", "control"}, [("image", 1), ("control", 2)], "image", None])
async def test_ingress_that_is_not_a_mapping_is_refused_and_changes_nothing(orch, artifacts):
    s = orch.create_session("a")
    with pytest.raises(IngressRefused, match=r"ingress must be a mapping \{artifact: value\}, got "):
        s.try_push(0, artifacts)
    assert s.artifact_stats().slot_count == 0
    assert s.metrics().ingress_accepted_at == ()  # nothing recorded for the anchor ("control") either
    s.finish_inputs(0)
    await s.push(0, chunk(0))
    assert [q async for q, _ in s.outputs()] == [0]


async def test_a_non_string_artifact_name_too_long_to_print_is_refused_by_name(orch):
    s = orch.create_session("a")
    with pytest.raises(IngressRefused, match=r"<an int of 16610 bits> is not an ingress artifact"):
        s.try_push(0, {HUGE: 1})
    with pytest.raises(ValueError, match=r"not ingress artifacts: \[<an int of 16610 bits>\]"):
        s.can_push([HUGE])


async def test_a_room_query_with_a_bare_string_asks_about_that_one_artifact(orch):
    s = orch.create_session("a")
    assert s.can_push("image")  # once: "not ingress artifacts: ['i', 'm', 'a', 'g', 'e']"
    with trio.fail_after(5):
        await s.wait_for_room("control")
    with pytest.raises(ValueError, match=r"not ingress artifacts: \['imag'\] \(ingress: \['control', 'image'\]\)"):
        s.can_push("imag")


@pytest.mark.parametrize("final", [True, 2.5, "3", -1, -HUGE, HUGE], ids=["bool", "float", "str", "negative", "-huge", "huge"])
async def test_a_bad_final_sequence_id_is_refused_at_open_and_at_finish(orch, final):
    with pytest.raises(ValueError, match=r"final_sequence_id must be an int in 0\.\.2\*\*63-1, got "):
        orch.create_session("a", final_sequence_id=final)
    with pytest.raises(ValueError, match="final_sequence_id must be"):
        async with orch.session("a", final_sequence_id=final):
            pytest.fail("the body must not run")  # pragma: no cover
    assert orch.session_ids == ()
    s = orch.create_session("a")
    with pytest.raises(ValueError, match="final_sequence_id must be"):
        s.finish_inputs(final)
    assert s.final_sequence_id is None
    s.finish_inputs(1)  # a good one still counts
    await s.push(0, chunk(0))
    await s.push(1, chunk(1))
    assert [q async for q, _ in s.outputs()] == [0, 1]
    assert orch.diagnostics().slot_leaks == 0


async def test_a_sequence_id_true_is_not_sequence_one(rec):
    """``True == 1``: accepted, it once made a later push of sequence 1 a duplicate."""
    async with running(rec) as orch:
        s = orch.create_session("a", final_sequence_id=1)
        with pytest.raises(IngressRefused):
            await s.push(True, chunk(1))
        await s.push(0, chunk(0))
        await s.push(1, chunk(1))
        assert [q async for q, _ in s.outputs()] == [0, 1]
        assert [inv.is_last for inv in rec.invocations if inv.key.stage_id == "decode"] == [False, True]


class _Seq(enum.IntEnum):
    FIRST = 0
    LAST = 1


@pytest.mark.parametrize("as_integer", [np.int64, np.uint8, _Seq], ids=["numpy-int64", "numpy-uint8", "IntEnum"])
async def test_sequence_ids_of_other_integer_types_count_as_the_same_ints(rec, as_integer):
    """A numpy index (``np.int64(0)``) was refused as "must be an int"; now any integer type in range is taken and
    kept as a plain int, so the stages, the outputs and the final sequence see 0 and 1 as always."""
    async with running(rec) as orch:
        s = orch.create_session("a", final_sequence_id=as_integer(1))
        assert type(s.final_sequence_id) is int
        assert s.can_push(["image", "control"], sequence_id=as_integer(0))
        await s.push(as_integer(0), chunk(0))
        assert s.try_push(as_integer(1), chunk(1))
        assert [(type(q), q) async for q, _ in s.outputs()] == [(int, 0), (int, 1)]
        assert [(type(inv.key.sequence_id), inv.is_last) for inv in rec.invocations if inv.key.stage_id == "decode"] == [
            (int, False), (int, True)]
        open_ended = orch.create_session("b")
        open_ended.finish_inputs(as_integer(0))
        assert type(open_ended.final_sequence_id) is int
        with pytest.raises(IngressRefused, match="sequence 1 is past the final sequence 0"):
            open_ended.try_push(as_integer(1), chunk(1))


# -- a cancel during a drain --------------------------------------------------------------------------


async def test_a_cancel_cuts_a_running_drain_short(rec, autojump_clock):
    """A cancel once waited for a drain under way to finish every buffered chunk, and the session ended CLOSED."""
    gate = rec.gate("denoise", 0)
    with trio.fail_after(10):
        async with running(rec) as orch:
            s = orch.create_session("a")
            for seq in range(2):
                await s.push(seq, chunk(seq))
            await rec.wait_started("denoise", "a", 0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.aclose)
                await trio.testing.wait_all_tasks_blocked()
                assert s.status is State.DRAINING
                cancelled = trio.Event()

                async def cancel() -> None:
                    await s.cancel()
                    cancelled.set()

                nursery.start_soon(cancel)
                await trio.testing.wait_all_tasks_blocked()
                assert s.status is State.CANCELLING  # at once, though the drain still holds the shutdown
                assert not cancelled.is_set()  # the running call is never interrupted: both wait for it
                gate.set()
            assert s.status is State.CANCELLED
            assert rec.calls_of("denoise", "a") == [0]  # chunk 1 was waiting: dropped, never run
            assert ("drain", "cut short: cancelling") in s.shutdown_phases
            assert [reason.value for _, reason in rec.closes_of("a")] == ["cancelled"] * 3
        assert orch.diagnostics().slot_leaks == 0


@pytest.mark.parametrize("how", ["aclose", "session_exit"])
async def test_a_caller_cancelled_while_its_session_drains_leaves_it_cancelled_not_stranded(rec, autojump_clock, how):
    """The caller of ``aclose`` (or of ``async with orch.session(...)``'s exit) cancelled by its own deadline mid-drain
    left the session DRAINING with nobody driving its shutdown: its buffers held, its id taken until the orchestrator
    closed. The shutdown now ends as a cancel (the running call finishes, the waiting chunk is dropped), shielded,
    and then the caller's cancellation goes on."""
    gate = rec.gate("denoise", 0)
    with trio.fail_after(10):
        async with running(rec) as orch:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_open_after, gate, 2.0)  # the running call ends after the caller gave up
                with trio.move_on_after(1.0) as caller:
                    if how == "aclose":
                        s = orch.create_session("a")
                        for seq in range(2):
                            await s.push(seq, chunk(seq))
                        await rec.wait_started("denoise", "a", 0)
                        await s.aclose()
                    else:
                        async with orch.session("a") as s:
                            for seq in range(2):
                                await s.push(seq, chunk(seq))
                            await rec.wait_started("denoise", "a", 0)
                assert caller.cancelled_caught
                assert trio.current_time() >= 2.0  # the shielded cancel waited for the running call, never cut it
            assert s.status is State.CANCELLED, s.shutdown_phases
            assert s.shutdown_phases[0] == ("drain", "cut short: its caller was cancelled"), s.shutdown_phases
            assert rec.calls_of("denoise", "a") == [0]  # chunk 1 was waiting: dropped, never run
            assert orch.create_session("a").status is State.RUNNING  # the id is free again


async def _open_after(gate: trio.Event, seconds: float) -> None:
    await elapse(seconds)
    gate.set()


@pytest.mark.parametrize("names", [5, None], ids=["int", "none"])
async def test_a_room_query_that_names_no_artifacts_is_a_value_error(orch, names):
    """It was ``TypeError: 'int' object is not iterable`` from deep inside."""
    s = orch.create_session("a")
    with pytest.raises(ValueError, match="artifacts must be an artifact name or names, got "):
        s.can_push(names)
    with pytest.raises(ValueError, match="artifacts must be an artifact name or names, got "):
        await s.wait_for_room(names)


async def test_buffered_on_an_edge_that_does_not_exist_is_refused(orch):
    """It answered 0, as for an empty edge; the other per-stage queries refuse an unknown stage."""
    s = orch.create_session("a")
    assert s.buffered("image", "encode") == 0
    for artifact, target in (("bogus", "encode"), ("image", "decode")):
        with pytest.raises(KeyError, match="no edge carries"):
            s.buffered(artifact, target)


# -- a session driven from another thread ---------------------------------------------------------------


async def test_a_session_or_orchestrator_called_from_another_thread_is_refused_and_changes_nothing(orch):
    """A plain thread, or a second trio.run in one, that drives a session corrupted the scheduler's trio side: a push
    was taken, an aclose from another run hung for its drain deadline or ended in a TrioInternalError."""
    s = orch.create_session("a")
    await s.push(0, chunk(0))

    def from_elsewhere() -> list[str]:
        refused = []
        calls = {  # poll_outputs first: without the check it returns, where a push can leave this run hung
            "poll_outputs": s.poll_outputs,
            "try_push": lambda: s.try_push(1, chunk(1)),
            "finish_inputs": lambda: s.finish_inputs(1),
            "create_session": lambda: orch.create_session("b"),
            "push": lambda: trio.run(s.push, 1, chunk(1)),
            "outputs": lambda: trio.run(s.outputs().__anext__),
            "aclose": lambda: trio.run(s.aclose),
            "cancel": lambda: trio.run(s.cancel),
            "wait_until_idle": lambda: trio.run(s.wait_until_idle),
            "barrier": lambda: trio.run(orch.barrier),
            "orchestrator aclose": lambda: trio.run(orch.aclose),
        }
        for name, call in calls.items():
            with pytest.raises(WrongThreadError, match=r"belongs to the trio run in thread 'MainThread'; \w+\(\) was "
                                                        r"called from thread .*: call it from that run") as caught:
                call()
            refused.append(name)
            assert ("the orchestrator" if name in {"create_session", "barrier", "orchestrator aclose"}
                    else "session 'a'") in str(caught.value)
        return refused

    with trio.fail_after(10):
        assert len(await trio.to_thread.run_sync(from_elsewhere, abandon_on_cancel=True)) == 11
        assert s.status is State.RUNNING and orch.session_ids == ("a",)
        assert len(s.metrics().ingress_accepted_at) == 1  # sequence 0's; nothing of sequence 1 was taken
        s.finish_inputs(1)  # from its own run the session works on
        await s.push(1, chunk(1))
        assert [q async for q, _ in s.outputs()] == [0, 1]


async def test_a_second_task_reading_a_session_s_outputs_is_refused_and_the_first_gets_them_all(orch):
    """Two readers split the outputs between them without a word: each missed what the other took."""
    s = orch.create_session("a")
    got = []

    async def read() -> None:
        async for seq, _ in s.outputs():
            got.append(seq)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()  # the first reader waits for output 0
            with pytest.raises(OutputsBusyError, match="session 'a': another task is already waiting for its outputs"):
                async for _ in s.outputs():
                    pass
            s.finish_inputs(2)
            for seq in range(3):
                await s.push(seq, chunk(seq))
    assert got == [0, 1, 2]
