"""ProcessWorkerGroup and the shared memory of CPU tensors: a tensor in a call's arguments or a rank's value travels
as a handle to its shared memory, which the sending process holds until the other fetches it. Every one a call
offers is fetched or released, whatever becomes of the call: refused, never begun, cut by a rank's death, or its
deferred result dropped uncalled."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest

from engine.workers import ProcessWorkerGroup, WorkerCallError, WorkerGroupClosed

from .conftest import RANKS


def _shared_memory_fds_settle_to(most: int) -> int:
    """This process's shared-memory descriptors once at most ``most`` are left, or after 10 s: the handle sharer's
    thread closes its copy of a handle only after it has sent it, a moment after the fetch that took it returned."""
    deadline = time.monotonic() + 10.0
    while (count := _shared_memory_fds()) > most and time.monotonic() < deadline:
        time.sleep(0.01)  # bench-cost: real-time poll for another thread's close, bounded by a deadline
    return count


def _shared_memory_fds() -> int:
    """This process's descriptors of tensors' shared memory (as a CPU tensor argument is held for a rank)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "/dev/shm/torch_" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            pass
    return count


def _ranks_shared_memory_fds_settle_to_none(group: ProcessWorkerGroup) -> list[int]:
    """Each rank's shared-memory descriptors once none is left, or after 10 s (each look is a call of the group)."""
    deadline = time.monotonic() + 10.0
    while any(counts := group.call("shared_memory_fds")()) and time.monotonic() < deadline:
        time.sleep(0.01)  # bench-cost: real-time poll for a rank's handle sharer to close what it sent, bounded
    return counts


def test_the_tensor_values_of_deferred_results_dropped_uncalled_are_released_by_the_next_call(groups, capfd):
    """A rank holds the shared memory of a CPU tensor it returned until this process fetches it, which calling the
    deferred result does. One dropped uncalled kept it in the rank for the rank's life, one descriptor a value. The
    group's next call releases it, whether the result was dropped after its answers came or while they were due."""
    group = groups(f"{RANKS}:TensorRank", world_size=2, gather={"ones", "shared_memory_fds"}).start()
    assert [float(t.sum()) for t in group.call("ones", 1000)()] == [1000.0, 1000.0]  # a called one is fetched
    assert _ranks_shared_memory_fds_settle_to_none(group) == [0, 0]
    answered = group.call("ones", 100_000)
    deadline = time.monotonic() + 10.0
    while not answered.done():  # its answers are here: dropped after they came
        assert time.monotonic() < deadline
        time.sleep(0.01)  # bench-cost: real-time poll for the ranks' answers, bounded by a deadline
    del answered
    group.call("ones", 100_000, after=0.2)  # dropped at once: its answers come after the next call was sent
    gc.collect()
    assert group.call("step", 1)() == 1  # released the first; the second is still due
    assert _ranks_shared_memory_fds_settle_to_none(group) == [0, 0]
    assert "Traceback" not in capfd.readouterr().err  # nothing was released twice, nor a handle already taken


def test_the_tensor_arguments_of_calls_no_rank_began_are_released_when_the_group_closes(groups, capfd):
    """CPU tensor arguments travel as shared-memory handles this process holds until a rank fetches them: ten calls
    queued behind one that never returns held one descriptor each (per rank) for as long as the process lived. The
    handles a rank did fetch (the call it runs) are not released again: the process's handle sharer, which served them
    already, would print a KeyError for each."""
    import torch  # imported here: most worker tests send no tensor

    group = groups(world_size=2, close_timeout=0.5).start()
    assert group.call("step", torch.ones(4))().tolist() == [1.0] * 4  # the process's handle sharer is up now
    gc.collect()  # what the first call left in reference cycles goes now, not half-way through the counts
    before = _shared_memory_fds()
    group.call("step", torch.ones(4), hold=True)  # every rank busy for good, holding its argument
    for index in range(10):
        group.call("step", torch.full((1000,), float(index)))
    assert _shared_memory_fds() >= before + 20  # one held for each rank's copy of each queued call
    group.close()
    assert _shared_memory_fds_settle_to(before) <= before
    assert "resource_sharer" not in capfd.readouterr().err  # its thread's traceback for a handle served already


def test_the_tensor_arguments_of_a_call_a_rank_died_before_fetching_are_released(groups):
    """The handles of the call a rank was running when it died were left alone (it might have fetched them), so a
    rank that died before fetching its arguments left them open here. A rank now says when it has fetched them."""
    import torch

    group = groups(world_size=1, close_timeout=0.5).start()
    assert group.call("step", torch.ones(4))().tolist() == [1.0] * 4
    gc.collect()  # what the first call left in reference cycles goes now, not half-way through the counts
    before = _shared_memory_fds()
    rank = group.pids[0]
    os.kill(rank, signal.SIGSTOP)
    group.call("step", torch.full((1000,), 2.0))  # sent (it fits the pipe); the stopped rank never reads it
    assert _shared_memory_fds() >= before + 1
    os.kill(rank, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not group.failed and time.monotonic() < deadline:
        time.sleep(0.01)  # bench-cost: real-time poll for the monitor to reap the rank, bounded by a deadline
    assert group.failed
    group.close()
    assert _shared_memory_fds_settle_to(before) <= before


def test_a_value_that_does_not_pickle_after_a_tensor_leaves_no_shared_memory_behind(groups):
    """Pickling offers each CPU tensor's shared memory as it goes: a call whose arguments failed to pickle after a
    tensor (a lambda beside it), or a rank value that did, left that offer, one descriptor each, for the process's
    life. What was offered before the failure is taken back."""
    import torch

    group = groups(f"{RANKS}:TensorRank", world_size=2).start()
    assert group.call("total", torch.ones(4))() == 4.0  # the process's handle sharer is up now
    gc.collect()
    before = _shared_memory_fds()
    for _ in range(5):
        with pytest.raises(TypeError, match="cannot be sent to the ranks"):
            group.call("total", torch.ones(100_000), lambda: None)
        with pytest.raises(WorkerCallError, match="tensor_and_lambda"):
            group.call("tensor_and_lambda", 100_000)()
    gc.collect()
    assert _shared_memory_fds_settle_to(before) <= before
    assert group.call("shared_memory_fds")() == 0


def test_one_deferred_result_called_from_two_threads_at_once_gives_both_its_value(groups):
    """A rank's shared-memory handle is served once: two threads loading one value at once each fetched some of its
    handles, and both failed (``does not load in this process: ... EOFError``). One loads; both get the value."""
    group = groups(f"{RANKS}:TensorRank", world_size=1).start()
    for _ in range(3):
        result = group.call("ones", 10_000)
        deadline = time.monotonic() + 10.0
        while not result.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)  # bench-cost: real-time poll for the rank's answer, bounded by a deadline
        start = threading.Barrier(2)
        got: list[object] = []

        def take() -> None:
            start.wait()
            try:
                got.append(float(result().sum()))
            except Exception as exc:  # the failure is what the test looks for
                got.append(exc)

        takers = [threading.Thread(target=take) for _ in range(2)]
        for taker in takers:
            taker.start()
        for taker in takers:
            taker.join(30)
        assert got == [10_000.0, 10_000.0], got


def test_a_value_answered_but_not_fetched_before_its_group_closed_says_so(groups):
    """Its tensors' shared memory went with the ranks: it said the value ``does not load in this process`` and
    named a pickling class, as though the value were at fault."""
    group = groups(f"{RANKS}:TensorRank", world_size=1, close_timeout=2, kill_grace=0.5).start()
    result = group.call("ones", 1000)
    deadline = time.monotonic() + 10.0
    while not result.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)  # bench-cost: real-time poll for the rank's answer, bounded by a deadline
    group.close()
    with pytest.raises(WorkerGroupClosed, match="was not fetched before its group closed"):
        result()
