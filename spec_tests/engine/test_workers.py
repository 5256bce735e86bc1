"""ProcessWorkerGroup: ranks as spawned processes, with failure, close and parent-death guarantees.

Each group costs a spawn per rank (about half a second), so groups are small
and every test closes what it starts (the ``groups`` fixture is the safety net).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import textwrap
from contextlib import aclosing
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from engine import (
    EdgeSpec, FatalStageError, OrchestratorCloseError, ParallelWorkerStageActor, PipelineSpec, StageSpec,
    WorkerFatalCallError, open_orchestrator,
)
from engine.supervisor import ChildExit, ChildSpec, Supervisor
from engine.worker_child import child_main
from engine.workers import (
    ProcessWorkerGroup,
    WorkerCallError,
    WorkerGroupClosed,
    WorkerGroupFailed,
    WorkerStartupError,
)
from states.pipeline_session import State
from states.stage_actor import State as ActorState

from . import worker_ranks
from .conftest import RANKS, assert_no_children

ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """No such process, or only its zombie is left (an orphan's reaper may be slow)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state in ("Z", "X")


# -- calls ---------------------------------------------------------------------------------


def test_calls_reach_every_rank_and_rank0_only_methods_reach_rank_0(groups):
    group = groups(world_size=2, device_ids=("cuda:3", "cuda:5"), gather={"info"}, rank0_only={"step"}).start()
    assert group.world_size == 2 and group.device_ids == ("cuda:3", "cuda:5")
    result = group.call("step", 3, scale=10)
    assert callable(result)
    assert result() == 30  # rank 0's value
    info = group.call("info")()
    assert [i["rank"] for i in info] == [0, 1]
    assert [i["device"] for i in info] == ["cuda:3", "cuda:5"]  # labels handed to the ranks, nothing more
    assert [i["calls"] for i in info] == [1, 0]  # step went to rank 0 alone
    assert tuple(i["pid"] for i in info) == group.pids
    assert not hasattr(group, "resource_group")  # devices never imply a resource group


def test_a_rank_exception_is_a_typed_error_with_the_child_traceback_and_the_group_lives_on(groups):
    group = groups(worker_ranks.echo_factory, world_size=2).start()  # a callable factory, by reference
    with pytest.raises(WorkerCallError) as caught:
        group.call("boom", "cache miss on chunk 7")()
    error = caught.value
    assert error.rank == 1 and error.method == "boom" and error.remote_type == "builtins.ValueError"
    assert "worker_ranks.py" in error.remote_traceback and "raise ValueError(message)" in error.remote_traceback
    assert "cache miss on chunk 7" in str(error) and error.remote_traceback in str(error)
    with pytest.raises(WorkerCallError, match="pickl"):  # a result that cannot travel back
        group.call("unpicklable")()
    # an exception whose str() raises: the rank ended (exit code 1) and failed the group
    with pytest.raises(WorkerCallError, match=r"<its message could not be made: _Unprintable.__str__ failed>"):
        group.call("boom_unprintable")()
    assert not group.failed and group.failure_reason is None
    assert group.call("step", 4)() == 4


def test_a_rank_s_fatal_stage_error_stays_fatal_in_the_parent(groups):
    """A FatalStageError raised in a rank (a tensor channel's timeout is one) reached the parent as a plain
    WorkerCallError, so the stage actor that made the call went on taking work; it is a WorkerFatalCallError, both a
    WorkerCallError (this call only: the group lives on) and a FatalStageError (its stage actor fails)."""
    group = groups(world_size=1).start()
    with pytest.raises(WorkerFatalCallError, match="the rank's device state is gone") as caught:
        group.call("boom_fatal")()
    assert isinstance(caught.value, FatalStageError) and caught.value.remote_type == "engine.errors.FatalStageError"
    with pytest.raises(WorkerCallError) as plain:
        group.call("boom", "not fatal")()
    assert not isinstance(plain.value, FatalStageError)
    assert not group.failed and group.call("step", 4)() == 4


def test_a_ctrl_c_while_a_rank_still_imports_what_it_runs_neither_kills_it_nor_prints_a_traceback(
    groups, capfd, tmp_path, monkeypatch
):
    """A spawned rank unpickles its factory, importing its module (a pipeline's: torch, seconds of it), before any of
    its own code runs. A terminal's Ctrl-C reaches every process of the group: a rank still importing died of it,
    printing a ``KeyboardInterrupt`` traceback, though ranks ignore it, and the group did not start. The stop
    signals are held from the spawn until the rank binds to its parent, which drops them."""
    from . import gated_import_rank

    monkeypatch.setenv("CHUNKLINE_TEST_IMPORT_GATE", str(tmp_path))
    group = groups(gated_import_rank.factory, world_size=1)
    started: list[BaseException | None] = []

    def start() -> None:
        try:
            group.start(timeout=60)
            started.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            started.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    importing = tmp_path / "importing"
    deadline = time.monotonic() + 30.0
    while not importing.exists() or not importing.read_text():
        assert time.monotonic() < deadline, "the rank never began to import its module"
        time.sleep(0.01)  # bench-cost: real-time poll of another process, bounded by a deadline
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # what a terminal or a service manager sends
        os.kill(int(importing.read_text()), number)
    (tmp_path / "open").touch()
    starter.join(60)
    assert started == [None], started
    assert group.call("step", 2)() == 2
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_ranks_outlive_the_thread_that_started_them(groups):
    """Linux's parent-death signal follows the spawning *thread*: the group spawns from its own."""
    group = groups(world_size=1)
    starter = threading.Thread(target=group.start)
    starter.start()
    starter.join()
    deadline = time.monotonic() + 5
    while Path(f"/proc/self/task/{starter.native_id}").exists():  # the OS thread itself is gone too
        assert time.monotonic() < deadline
        time.sleep(0.005)  # bench-cost: real-time poll for an OS thread to end, bounded by a deadline
    assert group.call("step", 2, scale=3)() == 6  # a rank killed at the thread's end could not answer


def test_a_call_timeout_fails_the_group(groups):
    group = groups(world_size=1, call_timeout=0.2)
    group.start()
    with pytest.raises(WorkerGroupFailed, match="no answer from ranks \\[0\\] within 0.2s"):
        group.call("block")()
    assert group.failed
    with pytest.raises(WorkerGroupFailed):
        group.call("step", 1)


# -- rank death ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "code"), [("sigkill", -signal.SIGKILL), ("os._exit(3)", 3), ("exit(0)", 0)]
)
def test_a_dying_rank_fails_the_group_and_every_pending_call(groups, how, code):
    group = groups(world_size=2).start()
    reasons: list[str] = []
    called = threading.Event()
    group.add_failure_callback(lambda reason: (reasons.append(reason), called.set()))
    pid = group.pids[1]
    if how == "sigkill":
        pending = group.call("block")
        began = time.monotonic()
        os.kill(pid, signal.SIGKILL)
    else:
        began = time.monotonic()
        pending = group.call("crash", code, rank=1)  # rank 0 answers; rank 1 never does
    with pytest.raises(WorkerGroupFailed) as caught:
        pending()
    # the rank's exit fails the call as it is seen; what is guarded is a call left waiting for an answer that never
    # comes (no call timeout here: for ever): a bound of seconds tells the two apart on a loaded host too
    assert time.monotonic() - began < 5.0
    expected = f"rank 1 (pid {pid}) exited unexpectedly with code {code}"
    assert expected in str(caught.value)
    assert called.wait(1.0) and reasons == [expected]
    assert group.failed and group.failure_reason == expected
    with pytest.raises(WorkerGroupFailed, match="exited unexpectedly"):
        group.call("step", 1)  # at once, without waiting
    late: list[str] = []
    group.add_failure_callback(late.append)  # registered after the failure: told at once
    assert late == [expected]
    group.close()
    assert group.exit_codes[1] == code
    assert_no_children(group.pids)


# -- close ------------------------------------------------------------------------------------------


def test_close_shuts_ranks_down_joins_them_and_is_idempotent(groups):
    close_timeout = 20.0  # what a rank that did not exit would be waited for: far above the bound below
    group = groups(f"{RANKS}:FailingCloseRank", world_size=2, close_timeout=close_timeout).start()
    pids = group.pids
    began = time.monotonic()
    group.close()
    assert time.monotonic() - began < close_timeout / 4  # the ranks exited when told: their timeout never ran out
    assert group.closed and not group.failed
    assert group.exit_codes == {0: 0, 1: 0}  # a graceful exit, after running each rank's close()
    assert sorted(group.close_errors) == [0, 1]
    assert "could not release its cache" in group.close_errors[1]
    assert group.processes_released  # every rank reaped, every pipe closed
    assert_no_children(pids)
    group.close()  # idempotent
    with pytest.raises(WorkerGroupClosed):
        group.call("step", 1)


def test_close_is_bounded_when_a_rank_ignores_shutdown_and_sigterm(groups):
    close_timeout, kill_grace = 0.3, 0.3
    group = groups(f"{RANKS}:StubbornRank", world_size=1, close_timeout=close_timeout, kill_grace=kill_grace).start()
    began = time.monotonic()
    group.close()
    # close() is bounded by about timeout + 3 x kill grace; the failure guarded is a hang (a rank never killed), or
    # longer timeouts than this group's waited instead (the fixture's 5 s close timeout): 3 s of slack for a loaded
    # host tells both apart
    assert time.monotonic() - began < close_timeout + 3 * kill_grace + 3.0
    assert group.exit_codes == {0: -signal.SIGKILL}
    assert_no_children(group.pids)


def test_a_stop_signal_to_the_whole_process_group_leaves_the_ranks_to_their_group(groups):
    """systemd's ``KillMode=control-group``, ``kill -TERM -PGID``, Ctrl-C or a closed terminal signal every rank too:
    the parent decides when they stop (it drains first). A rank ignored only SIGINT: SIGTERM or SIGHUP killed it,
    and the group failed under the session being drained."""
    group = groups(f"{RANKS}:FailingCloseRank", world_size=1).start()
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        os.kill(group.pids[0], number)
    assert group.call("step", 2)() == 2  # the pipe is in order: each signal came before this call was read
    group.close()
    assert not group.failed and group.exit_codes == {0: 0}, group.failure_reason
    assert "could not release its cache" in group.close_errors[0]  # its close() ran: it left by the goodbye
    assert_no_children(group.pids)


def test_close_fails_calls_still_pending(groups):
    group = groups(world_size=1, close_timeout=0.2, kill_grace=0.3).start()
    pending = group.call("block")
    group.close()
    with pytest.raises(WorkerGroupClosed):
        pending()
    assert not group.failed
    assert_no_children(group.pids)


# -- startup failure --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (f"{RANKS}_missing:EchoRank", ["ModuleNotFoundError", "worker_ranks_missing", "child traceback"]),
        (f"{RANKS}:failing_factory", ["rank 1 failed to start", "factory exploded", "worker_ranks.py"]),
        (f"{RANKS}:exiting_factory", ["exited during startup with code 5"]),
        (lambda **kw: None, ["could not start"]),  # not picklable, so never spawned
        (f"{RANKS}:tuple_hello_factory", ["unknown worker message tuple", "expected one of: RankReady, RankStartFailed"]),
    ],
    ids=["import-error", "factory-raises", "exits", "unpicklable", "unknown-hello"],
)
def test_startup_failure_is_a_typed_error_and_leaves_no_rank_running(groups, factory, expected):
    group = groups(factory, world_size=2)
    with pytest.raises(WorkerStartupError) as caught:
        group.start(timeout=30)
    for text in expected:
        assert text in str(caught.value)
    assert group.closed
    assert_no_children(group.pids)
    with pytest.raises(WorkerGroupClosed):
        group.call("step", 1)
    group.close()


def test_startup_timeout_is_a_startup_error(groups):
    group = groups(world_size=1)
    with pytest.raises(WorkerStartupError, match="not ready in time"):
        group.start(timeout=0.01)
    assert_no_children(group.pids)


def test_bad_arguments_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="world_size"):
        ProcessWorkerGroup(f"{RANKS}:EchoRank", world_size=0)
    with pytest.raises(ValueError, match="one device id per rank"):
        ProcessWorkerGroup(f"{RANKS}:EchoRank", world_size=2, device_ids=("cpu",))
    with pytest.raises(ValueError, match="module:callable"):
        ProcessWorkerGroup("spec_tests.engine.worker_ranks.EchoRank")
    unstarted = ProcessWorkerGroup(f"{RANKS}:EchoRank")
    with pytest.raises(RuntimeError, match="not started"):
        unstarted.call("step", 1)
    unstarted.close()
    assert unstarted.closed


# -- the wire --------------------------------------------------------------------------------------


def test_an_unknown_message_from_a_rank_fails_the_group_naming_it(groups):
    group = groups(f"{RANKS}:TupleReplyRank", world_size=1).start()
    with pytest.raises(WorkerGroupFailed, match="rank 0 sent an unknown worker message tuple") as caught:
        group.call("reply_in_tuples")()
    assert "expected one of: Fetched, Result, Raised, Closed" in str(caught.value)
    assert group.failed


def test_a_rank_given_an_unknown_message_exits_naming_it(capfd):
    exits: list[ChildExit] = []
    changed = threading.Condition()

    def on_exit(exit: ChildExit) -> None:
        with changed:
            exits.append(exit)
            changed.notify_all()

    config = {"factory": f"{RANKS}:EchoRank", "rank": 0, "world_size": 1, "device": "cpu"}
    supervisor = Supervisor([ChildSpec("rank0", child_main, config)], on_message=lambda index, data: None,
                            on_exit=on_exit, close_timeout=2.0, kill_grace=0.5)
    try:
        supervisor.start(30)
        assert supervisor.send(0, pickle.dumps(("call", 1, "step", (1,), {})))  # the old tuple format
        with changed:
            assert changed.wait_for(lambda: exits, 10), "the rank did not exit"
    finally:
        supervisor.close()
    assert exits[0].exitcode == 1 and not exits[0].expected
    err = capfd.readouterr().err
    assert "UnknownWorkerMessage: the worker group sent an unknown worker message tuple" in err
    assert "expected one of: Call, Shutdown" in err


# -- parent death -----------------------------------------------------------------------------------

PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from engine.workers import ProcessWorkerGroup
    group = ProcessWorkerGroup("spec_tests.engine.worker_ranks:EchoRank", world_size=2,
                               parent_death_signal=sys.argv[1] == "prctl")
    group.start(timeout=30)
    print(*group.pids, flush=True)
    time.sleep(60)  # bench-cost: the parent lives until the test kills it
    """
)


@pytest.mark.parametrize("mechanism", ["prctl", "watchdog"])
async def test_ranks_exit_when_their_parent_is_killed(mechanism):
    with trio.fail_after(20):
        parent = await trio.lowlevel.open_process([sys.executable, "-c", PARENT_SCRIPT, mechanism], cwd=ROOT, stdout=-1)
        try:
            line = b""
            while not line.endswith(b"\n"):
                data = await parent.stdout.receive_some()
                assert data, f"the helper parent exited early with code {await parent.wait()}"
                line += data
            pids = [int(pid) for pid in line.split()]
            assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        finally:
            parent.kill()  # SIGKILL: no cleanup runs in the parent
            with trio.CancelScope(shield=True):
                await parent.wait()
                await parent.stdout.aclose()
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"ranks {pids} outlived their parent"
            await trio.sleep(0.05)  # bench-cost: real-time poll for orphaned ranks to exit, bounded by a deadline


# -- owned by a stage actor inside the orchestrator --------------------------------------------------

DENOISE_ONLY = PipelineSpec(
    stages=[StageSpec("denoise", {"x"}, {"y"})],
    edges=[EdgeSpec("x", "denoise", None, 2)],
    output_artifacts={"y"},
)


async def _started_group(*, close_timeout: float) -> ProcessWorkerGroup:
    """Two EchoRank ranks, started off the trio thread, for an actor to own."""
    group = ProcessWorkerGroup(f"{RANKS}:EchoRank", world_size=2, close_timeout=close_timeout, kill_grace=0.5)
    await trio.to_thread.run_sync(group.start)
    return group


async def test_killing_a_rank_mid_run_fails_the_actor_and_the_session():
    group = await _started_group(close_timeout=2.0)
    token = trio.lowlevel.current_trio_token()
    holding = trio.Event()

    def input_builder(inv: Any) -> tuple[tuple, dict]:  # on the actor's thread
        x = inv.inputs["x"]
        if x < 0:
            token.run_sync_soon(holding.set)
        return (x,), {"scale": 10, "hold": x < 0}

    actor = ParallelWorkerStageActor(
        group, "step", name="denoise",
        input_builder=input_builder, output_builder=lambda result, inv: {"y": result},
    )
    with trio.fail_after(10):
        async with open_orchestrator(DENOISE_ONLY, {"denoise": actor}, close_timeout=10) as orch:
            session = orch.create_session("s1")
            await session.push(0, {"x": 4})
            async with aclosing(session.outputs()) as outputs:
                assert await anext(outputs) == (0, {"y": 40})
            await session.push(1, {"x": -1})  # the ranks hold this call
            await holding.wait()
            pid = group.pids[1]
            os.kill(pid, signal.SIGKILL)
            await session.wait_settled()
            assert session.status is State.FAILED
            assert "exited unexpectedly with code -9" in str(session.error)
            health = actor.health()
            assert health.state is ActorState.FAILED
            assert f"rank 1 (pid {pid}) exited unexpectedly with code -9" in health.failure_reason
    assert group.closed  # the actor closed the group it owns
    assert_no_children(group.pids)


async def test_an_orchestrator_closed_past_its_deadline_still_closes_the_group_its_actor_owns():
    """A rank call that never returns and an orchestrator's close_timeout that passes: the close is cut short with
    an OrchestratorCloseError, and the actor still closes its group (bounded: its close_timeout, then a kill), which
    ends the call; the ranks, the actor's thread and the group's were left running for as long as the process lived."""
    group = await _started_group(close_timeout=1.0)
    token = trio.lowlevel.current_trio_token()
    calling = trio.Event()

    def input_builder(inv: Any) -> tuple[tuple, dict]:  # on the actor's thread, as the call starts
        token.run_sync_soon(calling.set)
        return (), {}

    actor = ParallelWorkerStageActor(
        group, "block", name="denoise", input_builder=input_builder, output_builder=lambda result, inv: {"y": result},
    )
    with trio.fail_after(30):
        with pytest.raises(OrchestratorCloseError):
            async with open_orchestrator(DENOISE_ONLY, {"denoise": actor}, close_timeout=1) as orch:
                session = orch.create_session("s1")
                await session.push(0, {"x": 1})
                await calling.wait()
    assert group.closed and group.processes_released
    assert_no_children(group.pids)
    deadline = time.monotonic() + 10
    while left := [t.name for t in threading.enumerate() if t.name == "denoise" or t.name.startswith("workers")]:
        assert time.monotonic() < deadline, left  # the actor's thread and the group's end with the call
        await trio.sleep(0.05)  # bench-cost: real-time poll for threads to end, bounded by a deadline
