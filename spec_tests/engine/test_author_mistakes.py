"""What a pipeline author's mistakes look like through the public API: a clear error, bounded waits.

A stage that raises or returns the wrong thing, a session hook that raises or never returns, a
call that never returns: each must name the stage and what went wrong, and no wait of the caller
may outlast its deadline (the stuck thread is left to itself; the process can still exit).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest
import trio

from engine import (
    ResourceGroupSpec,
    EdgeSpec,
    InvalidStageOutput,
    LocalStageActor,
    OrchestratorCloseError,
    PipelineSpec,
    SessionCleanupError,
    SessionStateError,
    StageSpec,
    open_orchestrator,
)
from states.pipeline_session import State

from .actor_helpers import SPEC, join_thread, render


class _LookupFails(Mapping):
    """A result whose keys are right and whose value cannot be read (it once crashed the trio run: the scheduler
    raised where it recorded the result, and on a stage's thread that is a TrioInternalError)."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        return iter(["latent"])

    def __len__(self):
        return 1


class _UnhashableKey(_LookupFails):
    def __getitem__(self, key):
        return 1

    def __iter__(self):
        return iter([["latent"]])


@pytest.mark.parametrize(
    ("handler", "named"),
    [
        (lambda inv: (_ for _ in ()).throw(RuntimeError("model exploded")), "RuntimeError: model exploded"),
        (lambda inv: [1, 2], "InvalidStageOutput: stage 'dynamics' returned list"),
        (lambda inv: {"latnt": 1}, "InvalidStageOutput: stage 'dynamics' returned ['latnt']"),
        # keys that do not compare with each other, or are too long to print, once crashed the trio run
        (lambda inv: {"latent": 1, 7: 2}, "InvalidStageOutput: stage 'dynamics' returned ['latent', 7]"),
        (lambda inv: {10**5000: 1}, "InvalidStageOutput: stage 'dynamics' returned [<an int of 16610 bits>]"),
        (lambda inv: _LookupFails(), "InvalidStageOutput: stage 'dynamics' returned a _LookupFails that could not be "
                                     "read (KeyError: 'latent')"),
        (lambda inv: _UnhashableKey(), "InvalidStageOutput: stage 'dynamics' returned a _UnhashableKey that could not "
                                       "be read (TypeError: unhashable type: 'list')"),
    ],
    ids=["raises", "wrong_type", "misspelled_artifact", "mixed_key_types", "unprintable_key", "value_lookup_fails",
         "unhashable_key"],
)
async def test_pushing_to_a_session_a_stage_failed_names_the_stage_s_error(handler, named):
    actors = {"dynamics": LocalStageActor(handler), "render": LocalStageActor(render)}
    async with open_orchestrator(SPEC, actors) as orch:
        s = orch.create_session("a")
        await s.push(0, {"control": 1})
        await s.wait_settled()
        assert s.status is State.FAILED
        assert [item async for item in s.outputs()] == []  # the outputs end; s.error says why
        with pytest.raises(SessionStateError, match="accepts no input") as refused:
            await s.push(1, {"control": 1})
        assert named in str(refused.value)
        assert refused.value.__cause__ is s.error
        with pytest.raises(SessionStateError, match=named.split(":")[0]):
            await s.wait_for_room(["control"])
        if "Invalid" in named:
            assert isinstance(s.error, InvalidStageOutput)


@pytest.mark.parametrize(
    "result", [{"latent": 1, 7: 2}, {10**5000: 1}, _LookupFails(), _UnhashableKey()],
    ids=["mixed_key_types", "unprintable_key", "value_lookup_fails", "unhashable_key"],
)
async def test_an_async_stage_returning_odd_keys_fails_only_its_session(result):
    async def dynamics(invocation):
        return result

    actors = {"dynamics": LocalStageActor(dynamics), "render": LocalStageActor(render)}
    async with open_orchestrator(SPEC, actors) as orch:
        s = orch.create_session("a")
        await s.push(0, {"control": 1})
        with trio.fail_after(5):
            await s.wait_settled()
        assert s.status is State.FAILED
        assert isinstance(s.error, InvalidStageOutput)
        assert "stage 'dynamics' returned " in str(s.error) and "for sequence 0" in str(s.error)
        assert orch.diagnostics().slot_leaks == 0
        other = orch.create_session("b")  # the orchestrator keeps working
        assert other.try_push(0, {"control": 1})


async def test_a_session_hook_that_raises_is_named_by_its_stage_in_the_cleanup_error():
    def closer(context, reason):
        raise RuntimeError("teardown failed")

    actors = {"dynamics": LocalStageActor(lambda inv: {"latent": 1}, session_closer=closer),
              "render": LocalStageActor(render)}
    with pytest.raises(OrchestratorCloseError, match="release:dynamics"):  # still poisoned at shutdown
        async with open_orchestrator(SPEC, actors) as orch:
            s = orch.create_session("a", final_sequence_id=0)
            await s.push(0, {"control": 1})
            with pytest.raises(SessionCleanupError, match=r"release:dynamics failed: RuntimeError\('teardown failed'\)"):
                await s.aclose()
            assert s.status is State.POISONED
            with pytest.raises(SessionCleanupError, match="release:dynamics"):
                await s.aclose()  # the retry runs the hook again and still names it


async def test_a_synchronous_session_hook_that_never_returns_is_bounded_by_the_close_deadline():
    # the real clock: the stages' threads must get to run (the hook blocks until released, so the
    # short deadline cannot be met by luck)
    release = threading.Event()
    entered = threading.Event()

    def closer(context, reason):
        entered.set()
        release.wait()

    dynamics = LocalStageActor(lambda inv: {"latent": 1}, session_closer=closer)
    try:
        async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(render)}) as orch:
            s = orch.create_session("a")
            with pytest.raises(SessionCleanupError, match="stage 'dynamics' did not release session 'a' in time"):
                await s.aclose(timeout=0.2)
            assert entered.is_set()
            assert s.status is State.POISONED
            barrier_done = False
            async with trio.open_nursery() as nursery:

                async def barrier() -> None:
                    nonlocal barrier_done
                    await orch.barrier()
                    barrier_done = True

                nursery.start_soon(barrier)
                await trio.testing.wait_all_tasks_blocked()
                assert not barrier_done  # the hook still runs on its thread, and the actor says so
                release.set()
            assert barrier_done
            await s.aclose()
            assert s.status is State.CLOSED
    finally:
        release.set()
    await join_thread(dynamics)


async def test_a_call_that_never_returns_does_not_hold_the_orchestrator_past_its_close_timeout(autojump_clock):
    release = threading.Event()
    started = threading.Event()

    def stuck(invocation):
        started.set()
        release.wait()
        return {"latent": 1}

    dynamics = LocalStageActor(stuck)
    begun = trio.current_time()
    try:
        with pytest.raises(OrchestratorCloseError) as failed:
            async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(render)},
                                         close_timeout=10) as orch:
                s = orch.create_session("a")
                await s.push(0, {"control": 1})
                await trio.to_thread.run_sync(started.wait)
        assert trio.current_time() - begun <= 10 + 1
        assert "still running" in str(failed.value)
        assert "stage actor 'dynamics' did not close in time" in str(failed.value)
    finally:
        release.set()  # the abandoned thread finishes its call and ends on its own
    await join_thread(dynamics)



def _stages() -> list[StageSpec]:
    return [StageSpec("dynamics", {"control"}, {"latent"}), StageSpec("render", {"latent"}, {"frames"})]


def _edges() -> list[EdgeSpec]:
    return [EdgeSpec("control", "dynamics"), EdgeSpec("latent", "render", "dynamics")]


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: EdgeSpec("control", "dynamics", None, 1.5), "edge control: ingress -> dynamics: capacity_per_session must be an int >= 1, got 1.5"),
        (lambda: EdgeSpec("control", "dynamics", None, "2"), "capacity_per_session must be an int >= 1, got '2'"),
        (lambda: EdgeSpec("control", "dynamics", None, True), "capacity_per_session must be an int >= 1, got True"),
        (lambda: EdgeSpec("control", "dynamics", None, float("nan")), "capacity_per_session must be an int >= 1, got nan"),
        (lambda: StageSpec("x", {"a"}, {"b"}, max_in_flight_global="2"), "stage 'x': max_in_flight_global must be an int >= 1"),
        (lambda: StageSpec("x", {"a"}, {"b"}, max_in_flight_per_session=0.5), "stage 'x': max_in_flight_per_session must be an int"),
        (lambda: ResourceGroupSpec("gpu", 1.5), "resource group 'gpu': max_concurrency must be an int >= 1, got 1.5"),
        (lambda: PipelineSpec(_stages(), _edges(), {"frames"}, output_capacity_per_session=2.5), "output_capacity_per_session must be an int"),
        (lambda: PipelineSpec(_stages(), _edges(), {"framez"}), "output artifact 'framez' is not produced by any stage"),
        (lambda: PipelineSpec(["dynamics"], _edges(), {"frames"}), "stages[0] must be a StageSpec value, got str 'dynamics'"),
        (lambda: PipelineSpec(_stages(), {"control": "dynamics"}, {"frames"}), "edges[0] must be a EdgeSpec value, got str"),
        (lambda: LocalStageActor(render, mailbox_capacity=1.5), "mailbox_capacity must be an int >= 1, got 1.5"),
        # each of these was taken, then failed the first session (or poisoned its close) with a bare TypeError
        (lambda: LocalStageActor(None), "handler must be callable, got NoneType"),
        (lambda: LocalStageActor(render, session_closer=5), "session_closer must be callable or None, got int"),
        (lambda: LocalStageActor(render, name=5), "name must be a string or None, got int"),
        # a generator function's call returned a generator: "InvalidStageOutput: ... returned generator"
        (lambda: LocalStageActor(_yields), "handler must return (a handler: its {artifact: value} mapping), not "
                                           "yield: '_yields' is a generator function"),
        (lambda: LocalStageActor(render, session_closer=_yields), "session_closer must return"),
    ],
    ids=["edge_float", "edge_str", "edge_bool", "edge_nan", "in_flight_str", "in_flight_float", "group_float",
         "output_capacity_float", "misspelled_output", "stage_names", "edges_dict", "mailbox_float",
         "handler_none", "closer_int", "name_int", "handler_yields", "closer_yields"],
)
def test_a_bad_spec_value_is_a_value_error_naming_the_field(build, named):
    with pytest.raises(ValueError) as refused:
        build()
    assert named in str(refused.value)


def _yields(invocation):
    yield {"latent": 1}


class AsyncModel:
    """A model object whose ``__call__`` is an ``async def``: a handler as a class, as authors write one."""

    async def __call__(self, invocation):
        await trio.lowlevel.checkpoint()
        return {"latent": invocation.inputs["control"] * 2}


async def test_an_object_whose_call_is_async_runs_as_an_async_handler():
    """It was run on a thread, its coroutine taken for the result: "returned coroutine", never awaited."""
    async with open_orchestrator(SPEC, {"dynamics": LocalStageActor(AsyncModel()),
                                        "render": LocalStageActor(render)}) as orch:
        session = orch.create_session("a", final_sequence_id=1)
        await session.push(0, {"control": 1})
        await session.push(1, {"control": 2})
        got = [(seq, out["frames"]) async for seq, out in session.outputs()]
    assert got == [(0, 2), (1, 4)] and session.error is None



@pytest.mark.parametrize(("spec", "actors", "named"), [
    (None, None, "spec must be a PipelineSpec, got NoneType"),
    ("spec", None, "actors must be a mapping of stage id to stage actor, got list"),
    ("spec", "function", "actors['dynamics'] is a function, not a stage actor (no run, submit"),
], ids=["spec_none", "actors_list", "plain_function"])
async def test_open_orchestrator_names_a_wrong_kind_of_spec_or_actor(spec, actors, named):
    """An AttributeError or a TypeError came from deep inside the start instead (the actor map's keys and
    ``close_timeout`` were already checked by name)."""
    good = PipelineSpec(_stages(), _edges(), {"frames"})
    actor_map = {stage.stage_id: LocalStageActor(render) for stage in good.stages}
    if actors == "function":
        actor_map["dynamics"] = render
    given = list(actor_map.values()) if actors is None and spec == "spec" else actor_map
    with pytest.raises(ValueError) as refused:
        async with open_orchestrator(None if spec is None else good, given):
            pass
    assert named in str(refused.value)


async def _render_async(invocation):
    return {"frames": invocation.inputs["latent"]}


@pytest.mark.parametrize("handler_kind", ["async", "sync"])
async def test_an_async_session_hook_that_never_returns_is_bounded_by_the_deadlines(handler_kind, autojump_clock):
    async def closer(context, reason):
        await trio.sleep_forever()

    async def dynamics_async(invocation):
        return {"latent": 1}

    handler = dynamics_async if handler_kind == "async" else (lambda inv: {"latent": 1})
    dynamics = LocalStageActor(handler, session_closer=closer)
    begun = trio.current_time()
    with pytest.raises(OrchestratorCloseError, match="release:dynamics"):
        async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(_render_async)},
                                     close_timeout=5) as orch:
            s = orch.create_session("a")
            with pytest.raises(SessionCleanupError, match="stage 'dynamics' did not release session 'a' in time"):
                await s.aclose(timeout=1)
            assert s.status is State.POISONED
    assert trio.current_time() - begun <= 1 + 5 + 1
    assert dynamics.health().state.value == "closed"
    await join_thread(dynamics)


async def test_an_async_call_that_never_returns_does_not_hold_the_orchestrator_past_its_close_timeout(autojump_clock):
    started = trio.Event()

    async def stuck(invocation):
        started.set()
        await trio.sleep_forever()

    begun = trio.current_time()
    with pytest.raises(OrchestratorCloseError, match="stage actor 'dynamics' did not close in time"):
        async with open_orchestrator(SPEC, {"dynamics": LocalStageActor(stuck), "render": LocalStageActor(_render_async)},
                                     close_timeout=10) as orch:
            s = orch.create_session("a")
            await s.push(0, {"control": 1})
            await started.wait()
    assert trio.current_time() - begun <= 10 + 1


async def test_once_the_close_deadline_is_spent_only_the_stuck_actor_is_reported():
    """A hung session hook uses up the close deadline; the healthy actor closed after it is not blamed.

    Real time (a short deadline): an autojump clock would jump past the healthy actor's
    thread stop, which takes real microseconds.
    """
    release = threading.Event()

    def closer(context, reason):
        release.wait()

    dynamics = LocalStageActor(lambda inv: {"latent": 1}, session_closer=closer)
    try:
        with pytest.raises(OrchestratorCloseError) as failed:
            async with open_orchestrator(SPEC, {"dynamics": dynamics, "render": LocalStageActor(render)},
                                         close_timeout=0.3) as orch:
                orch.create_session("a")
        told = str(failed.value)
        assert "did not release session" in told
        assert "stage actor 'dynamics' did not close in time" in told
        assert "'render'" not in told  # closed in its grace, not reported
    finally:
        release.set()
    await join_thread(dynamics)


class Shutdown(BaseException):
    """A library's own way to stop, past ``except Exception``."""


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), Shutdown("stop")],
                         ids=["sys.exit", "ctrl-c", "own-base-exception"])
async def test_a_session_hook_raising_past_exception_poisons_its_session_not_the_orchestrator(raised):
    """A failed session's cleanup runs in the background: a hook raising ``sys.exit()`` there (a library's own) ended
    the whole orchestrator, its healthy sessions with it, in a group of groups; on a close, its session was left
    releasing, neither closed nor poisoned. It poisons its session, named, as a hook's ``Exception`` does."""

    def failing(inv):
        if inv.key.session_id == "bad":
            raise ValueError("stage error")  # the session fails: its cleanup runs in the background
        return {"latent": inv.inputs["control"]}

    def closer(context, reason):
        if context.session_id == "bad":
            raise raised

    actors = {"dynamics": LocalStageActor(failing, session_closer=closer), "render": LocalStageActor(render)}
    with pytest.raises(OrchestratorCloseError, match="release:dynamics"):  # still poisoned at shutdown
        async with open_orchestrator(SPEC, actors) as orch:
            bad, good = orch.create_session("bad"), orch.create_session("good", final_sequence_id=1)
            await bad.push(0, {"control": 0})
            await bad.wait_settled()
            assert bad.status is State.POISONED
            assert bad.cleanup_error is raised
            assert ("release:dynamics", f"failed: {raised!r}") in bad.shutdown_phases, bad.shutdown_phases
            await good.push(0, {"control": 0})
            await good.push(1, {"control": 1})
            assert [seq async for seq, _ in good.outputs()] == [0, 1]  # the healthy session serves on


async def test_a_synchronous_session_hook_that_returns_a_coroutine_is_named_not_said_released():
    """``session_closer=lambda ctx, reason: release(ctx)`` with ``release`` async: the release never ran (a 'never
    awaited' warning) and ``release:dynamics`` said ``ok``. It is a failed release naming the mistake."""
    released: list[str] = []

    async def release(context):
        released.append(context.session_id)

    actors = {"dynamics": LocalStageActor(lambda inv: {"latent": 1}, session_closer=lambda ctx, reason: release(ctx)),
              "render": LocalStageActor(render)}
    with pytest.raises(OrchestratorCloseError, match="release:dynamics"):
        async with open_orchestrator(SPEC, actors) as orch:
            s = orch.create_session("a", final_sequence_id=0)
            await s.push(0, {"control": 1})
            with pytest.raises(SessionCleanupError, match="its session_closer returned coroutine, which nothing "
                                                          "awaits, so its release never ran; declare the hook itself "
                                                          "'async def'"):
                await s.aclose()
            assert s.status is State.POISONED and released == []
