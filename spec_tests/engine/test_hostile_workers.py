"""A careless or hostile user of ProcessWorkerGroup: bad values, interrupted starts, arguments that do not travel.

Real spawned ranks (about half a second each), so groups are small and every test closes what it starts.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest

from engine.workers import ProcessWorkerGroup, WorkerCallError, WorkerGroupClosed, WorkerGroupFailed
from states.process_group import State

from . import worker_ranks
from .conftest import RANKS, assert_no_children


@pytest.mark.parametrize(
    ("field", "value"),
    [("world_size", True), ("world_size", 2.0), ("world_size", "2"), ("call_timeout", -1.0),
     ("call_timeout", math.nan), ("call_timeout", True), ("call_timeout", 0), ("close_timeout", math.nan),
     ("close_timeout", math.inf), ("kill_grace", -1), ("kill_grace", "2")],
)
def test_bad_group_values_are_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        ProcessWorkerGroup(f"{RANKS}:EchoRank", **{field: value})


@pytest.mark.parametrize("timeout", [None, "30", True, -1, 0, math.nan, math.inf])
def test_a_bad_start_timeout_is_refused_before_anything_spawns(timeout):
    group = ProcessWorkerGroup(f"{RANKS}:EchoRank", close_timeout=1.0, kill_grace=0.3)
    with pytest.raises(ValueError, match="^timeout must be"):
        group.start(timeout)  # was: a TypeError after the rank was spawned, the group stuck in STARTING,
    assert group.state is State.NEW  # and close() waiting for ever with the rank left running
    assert multiprocessing.active_children() == []
    group.close()
    assert group.closed


class Interrupted(Exception):
    """Stands in for the KeyboardInterrupt of a user who gives up on a slow start."""


def test_an_interrupted_start_kills_the_ranks_and_close_returns(groups):
    group = groups(f"{RANKS}:hanging_factory", world_size=2)

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted()

    def interrupt_once_spawned() -> None:
        deadline = time.monotonic() + 30
        while len(group.pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # bench-cost: real-time poll for the ranks to be spawned, bounded by a deadline
        # to the main thread: one sent to the process may reach another thread, and the main one, asleep in the
        # start's wait, ran the handler only when that wait timed out (60 s, on a loaded host)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=interrupt_once_spawned, daemon=True).start()
        with pytest.raises(Interrupted):
            group.start(timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert len(group.pids) == 2
    assert group.state is State.CLOSED and not group.started  # every rank killed and reaped before it propagated
    assert group.processes_released
    assert_no_children(group.pids)
    closer = threading.Thread(target=group.close, daemon=True)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), "close() hung after an interrupted start"


def test_a_cpu_tensor_argument_reaches_every_rank(groups):
    torch = pytest.importorskip("torch")
    group = groups(f"{RANKS}:TensorRank", world_size=2, gather={"total"}, call_timeout=30).start()
    # was: rank 1 could not fetch the tensor's shared memory (rank 0 had) and exited with code 0, failing the group
    assert group.call("total", torch.arange(10.0), scale=2)() == [90.0, 91.0]
    assert group.call("total", torch.ones(3, 4).t())() == [12.0, 13.0]
    assert not group.failed


def test_arguments_that_do_not_pickle_are_a_typed_error_naming_the_method(groups):
    group = groups(world_size=1).start()
    with pytest.raises(TypeError, match=r"the arguments of step\(\) cannot be sent to the ranks") as caught:
        group.call("step", lambda: 1)
    assert caught.value.__cause__ is not None
    assert group.call("step", 2)() == 2 and not group.failed


def test_arguments_that_do_not_load_in_a_rank_fail_only_that_call(groups):
    group = groups(world_size=2).start()
    with pytest.raises(WorkerCallError, match="cannot be rebuilt in a rank") as caught:
        group.call("step", worker_ranks.ArgumentThatDoesNotLoad())()  # was: both ranks exited, the group failed
    assert caught.value.remote_type == "engine.worker_wire.UnloadableValue"
    assert not group.failed
    assert group.call("step", 3, scale=2)() == 6


@pytest.mark.parametrize("timeout", [-1, 0, math.nan, True])
def test_a_bad_result_timeout_is_refused_and_leaves_the_group_running(groups, timeout):
    group = groups(world_size=1).start()
    pending = group.call("step", 5)
    with pytest.raises(ValueError, match="^timeout must be"):
        pending(timeout)  # was: an immediate "timeout" that failed the whole group
    assert pending() == 5 and not group.failed


def test_a_send_stuck_on_a_stopped_rank_holds_up_neither_another_rank_s_death_nor_close(groups):
    """One lock guarded every rank's pipe: a call whose argument filled a SIGSTOPped rank's pipe held it, and the
    monitor, which takes it to reap a rank, never saw rank 1 die (the group never failed, close left ranks behind)."""
    group = groups(world_size=2).start()
    stopped, other = group.pids
    os.kill(stopped, signal.SIGSTOP)
    sent = threading.Event()

    def call_with_a_big_argument() -> None:
        try:
            group.call("step", b"x" * 4_000_000)  # far more than a pipe holds: the write to rank 0 blocks
        except Exception:
            pass
        sent.set()

    try:
        threading.Thread(target=call_with_a_big_argument, daemon=True).start()
        assert not sent.wait(1.0)  # the stopped rank reads nothing: the caller waits in the write
        os.kill(other, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not group.failed and time.monotonic() < deadline:
            time.sleep(0.01)  # bench-cost: real-time poll for the monitor to see the kill, bounded by a deadline
        assert group.failed and f"rank 1 (pid {other})" in group.failure_reason
    finally:
        closer = threading.Thread(target=group.close, daemon=True)
        closer.start()
        closer.join(30)
    assert not closer.is_alive(), "close() hung behind the stuck write"
    assert sent.wait(5)  # the stopped rank was killed: the write failed and the call returned
    assert_no_children(group.pids)


def test_a_call_that_a_stopped_rank_never_reads_fails_the_group_at_the_call_timeout(groups):
    """The write of a call bigger than a pipe holds had no deadline: with a SIGSTOPped rank the caller waited in it
    until someone closed the group, although call_timeout was set. Now the rank is killed at that deadline."""
    group = groups(world_size=2, call_timeout=1.0).start()
    stopped = group.pids[0]
    os.kill(stopped, signal.SIGSTOP)
    outcome: list[BaseException | None] = []

    def call_with_a_big_argument() -> None:
        try:
            group.call("step", b"x" * 4_000_000)()  # far more than a pipe holds: the write to rank 0 blocks
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    caller = threading.Thread(target=call_with_a_big_argument, daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "the call was still blocked in its write long past its call_timeout"
    assert isinstance(outcome[0], WorkerGroupFailed), outcome
    assert group.failed and f"rank 0 (pid {stopped})" in group.failure_reason
    assert "read none of a message sent to it for 1s" in group.failure_reason, group.failure_reason


def test_a_rank_stopped_half_way_through_a_reply_is_killed_and_reaped_at_close(groups):
    """The monitor thread read each message whole: a rank stopped (SIGSTOP) after the first bytes of a large reply
    held it in that read, so nothing enforced a deadline any more; close() waited 15 s for it and left the ranks
    unreaped. The monitor now reads what a pipe holds and keeps the rest of a message for later."""
    group = groups(f"{RANKS}:HalfReplyRank", world_size=2, call_timeout=1.0).start()
    pids = group.pids
    with pytest.raises(WorkerGroupFailed, match="got no answer from ranks"):
        group.call("half_reply_then_stop")()
    closer = threading.Thread(target=group.close, daemon=True)
    started = time.monotonic()
    closer.start()
    closer.join(30)
    assert not closer.is_alive()
    # close's own bound once the group has failed: kill_grace (0.5 s) to exit, then SIGTERM and SIGKILL 0.5 s apart
    assert time.monotonic() - started < 10, "close() waited on the monitor thread, stuck in a half-written reply"
    assert group.processes_released
    assert_no_children(pids)


def _ended(pid: int) -> bool:
    """Gone, or a zombie (it runs nothing; whoever it was reparented to reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", ["the rank is killed", "the group closes"])
def test_a_process_a_rank_started_ends_with_the_rank(groups, how):
    """A process a rank started (a model's compile workers, a tool it runs) lived on, reparented, after the rank
    died or the group closed. Each rank now leads a process group, which the supervisor kills with the rank."""
    group = groups(world_size=1).start()
    sleeper = group.call("start_sleeper")()
    assert not _ended(sleeper)
    if how == "the rank is killed":
        os.kill(group.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not group.failed and time.monotonic() < deadline:
            time.sleep(0.01)  # bench-cost: real-time poll for the monitor to reap the rank, bounded by a deadline
        assert group.failed
    else:
        group.close()
    deadline = time.monotonic() + 5
    while not _ended(sleeper) and time.monotonic() < deadline:
        time.sleep(0.01)  # bench-cost: real-time poll for SIGKILL to land, bounded by a deadline
    assert _ended(sleeper), f"the rank's process {sleeper} outlived it ({how})"


def test_a_rank_that_started_a_tool_through_the_shell_is_seen_to_die(groups):
    """The descriptors the spawn passed a rank (its pipe, the end whose close tells the parent it exited) were
    inheritable: a tool it started with ``os.system("tool &")`` held them open, so the rank's death went unseen (its
    calls waited for ever with the default call_timeout) until the tool ended. A rank now keeps them to itself."""
    group = groups(world_size=1).start()
    group.call("start_shell_sleeper")()
    pending = group.call("block")
    os.kill(group.pids[0], signal.SIGKILL)
    with pytest.raises(WorkerGroupFailed, match=r"rank 0 \(pid \d+\) exited unexpectedly with code -9"):
        pending(timeout=20.0)  # the failure wakes it at once; a timeout (20 s) fails the group another way


@pytest.mark.parametrize(("data", "reason"), [
    (b"\x00\x00\x00\x00", r"rank 0 sent a message that does not load \(EOFError"),
    (b"\xff\xff\xff\xf9junk", r"its pipe carried no messages: the pipe carries no message framing \(a length of -7\)"),
], ids=["empty-message", "negative-length"])
def test_bytes_from_a_rank_that_are_no_message_fail_the_group_naming_them(groups, data, reason):
    """An empty message crashed the monitor thread (its unpickling raised there: every rank was killed as after a bug
    in it); a negative length was reported a second later as a pipe closed without an exit, which it was not."""
    group = groups(f"{RANKS}:HalfReplyRank", world_size=1).start()
    with pytest.raises(WorkerGroupFailed, match=reason):
        group.call("write_raw", data)(timeout=20.0)
    assert "monitor thread crashed" not in group.failure_reason


class _Interrupted(Exception):
    """Raised by a signal handler in the main thread, as Ctrl-C raises KeyboardInterrupt."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted()


def test_a_close_interrupted_half_way_is_finished_by_the_next_close(groups):
    """A close interrupted while it waited for a busy rank (Ctrl-C) left the group closing, and the next close (a
    ``finally``, a ``with`` block's end) waited for it for ever. Every close now does the work itself."""
    group = groups(world_size=1, close_timeout=2.0).start()
    pending = group.call("block")
    previous = signal.signal(signal.SIGALRM, _raise_interrupted)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupted):
            group.close()  # the rank is busy: the close waits for it, and is interrupted there
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    closer = threading.Thread(target=group.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "the second close waited for the interrupted one"
    assert group.closed and group.processes_released
    with pytest.raises(WorkerGroupClosed):
        pending(timeout=1.0)


def test_a_close_from_a_signal_handler_during_start_ends_the_start(groups):
    """A signal handler that closed the group while start() ran on the same thread waited for that start() for ever.
    The close now raises there, which ends the start, and the start closes the group on its way out."""
    group = groups(f"{RANKS}:hanging_factory", world_size=1)

    def close_in_handler(signum: int, frame: Any) -> None:
        group.close()

    previous = signal.signal(signal.SIGALRM, close_in_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(RuntimeError, match=r"close\(\) ran inside start\(\) on the same thread"):
            group.start(timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert group.closed and group.processes_released
