"""A value a worker process sends that the server process cannot load (a class of a module only the child has, an
object whose ``__reduce__``/``__setstate__`` raises when loaded) fails only the call it answers: the reader of
every message from that process never sees it, so the process group serves on. With real rank processes."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from engine.tensor_channel import CPU_SLOTS, WorkerTensorChannel
from engine.workers import ProcessWorkerGroup, WorkerCallError

from .unloadable_ranks import shared_fds_here

RANKS = "spec_tests.reliability.unloadable_ranks:UnloadableRank"
TENSOR_RANKS = "spec_tests.reliability.unloadable_ranks:SharedTensorRank"
SETTLE_DEADLINE = 10.0  # seconds for a rank's resource-sharer thread to close what the parent fetched


@pytest.fixture
def group() -> Iterator[ProcessWorkerGroup]:
    group = ProcessWorkerGroup(RANKS, world_size=2, call_timeout=30.0, name="unloadable")
    try:
        yield group.start()
    finally:
        group.close()


def test_a_rank_value_that_does_not_load_fails_that_call_and_the_group_lives_on(group: ProcessWorkerGroup) -> None:
    with pytest.raises(WorkerCallError) as caught:
        group.call("unloadable")()
    assert str(caught.value) == (
        "rank 0: the value unloadable() returned does not load in this process: loading it raised ValueError: "
        "invalid literal for int() with base 10: 'not a number' (the last name it loaded: builtins.int)"
    )
    assert (caught.value.rank, caught.value.method) == (0, "unloadable")
    assert not group.failed and group.failure_reason is None
    assert group.call("step", 4)() == 4  # the next call is answered by the same ranks


def settled_shared_fds(group: ProcessWorkerGroup) -> list[int]:
    """Each rank's open shared-memory descriptors, once none is closing any more (a rank's resource-sharer thread
    closes its copy of a handle just after handing it over); bounded by wall-clock time."""
    give_up = time.monotonic() + SETTLE_DEADLINE
    while any(held := group.call("shared_fds")()) and time.monotonic() < give_up:
        time.sleep(0.01)  # bench-cost: the ranks' sharer threads, bounded
    return held


def test_the_shared_memory_of_a_value_that_is_not_loaded_is_not_left_with_the_rank() -> None:
    """A CPU tensor travels as a handle to shared memory, which its rank holds until the parent fetches it: one in a
    value that does not load (fetched half-way, or not at all because another rank raised) is fetched and closed
    all the same, so it does not pile up in the rank for the rest of its life."""
    with ProcessWorkerGroup(TENSOR_RANKS, world_size=2, call_timeout=60.0, gather=("shared_fds",),
                            name="shared-tensors") as group:
        for _ in range(4):
            with pytest.raises(WorkerCallError, match="rank 0: the value half_loadable\\(\\) returned does not load"):
                group.call("half_loadable")()
        assert settled_shared_fds(group) == [0, 0]
        for _ in range(4):
            with pytest.raises(WorkerCallError, match="rank 0: fails_on_rank_0\\(\\) raised builtins.ValueError"):
                group.call("fails_on_rank_0")()
        assert settled_shared_fds(group) == [0, 0]
        assert not group.failed


def test_the_tensor_channel_transfers_of_a_value_that_is_lost_are_discarded() -> None:
    """A rank's value naming a tensor-channel transfer (a ``WorkerTensorRef``) that is lost in the parent -- it does
    not load, or another rank's error fails the call -- has its transfer discarded for every consumer rank as the
    call fails, so its slot is free: the producer's sends after it into that slot went on waiting for it until
    their timeout (each profile has CPU_SLOTS slots)."""
    with WorkerTensorChannel(consumer_world_size=2, timeout=60.0) as channel, \
            ProcessWorkerGroup(TENSOR_RANKS, world_size=2, call_timeout=90.0, name="lost-refs") as group:
        group.call("take_channel", channel)()
        for transfer in range(1, CPU_SLOTS + 2):
            with pytest.raises(WorkerCallError, match="rank 0: the value sends_unloadable\\(\\) returned does not load"):
                group.call("sends_unloadable")()
            assert [channel.ack_of(rank, transfer) for rank in range(2)] == [-transfer, -transfer]
        with pytest.raises(WorkerCallError, match="rank 1: sends_then_rank_1_raises\\(\\) raised builtins.ValueError"):
            group.call("sends_then_rank_1_raises")()
        transfer = CPU_SLOTS + 2
        assert [channel.ack_of(rank, transfer) for rank in range(2)] == [-transfer, -transfer]
        assert not group.failed


def test_the_shared_memory_of_arguments_that_do_not_load_is_not_left_with_this_process() -> None:
    """A CPU tensor argument travels as a handle to shared memory that this process holds until its rank fetches it:
    arguments that do not load in the rank (fetched half-way) have the rest fetched and closed there, so the
    handles do not pile up here for the life of the server (each held a descriptor for good)."""
    import torch

    from .unloadable_ranks import FailsToLoad

    with ProcessWorkerGroup(TENSOR_RANKS, world_size=2, call_timeout=60.0, name="unloadable-arguments") as group:
        assert group.call("step", 1)() == 1
        before = shared_fds_here()
        for _ in range(4):
            arguments = {"fetched": torch.ones(64), "latent": FailsToLoad(), "held": torch.ones(64)}
            with pytest.raises(WorkerCallError, match="UnloadableValue"):
                group.call("step", arguments)()
            del arguments
        gc.collect()
        give_up = time.monotonic() + SETTLE_DEADLINE
        while shared_fds_here() > before and time.monotonic() < give_up:
            time.sleep(0.01)  # bench-cost: this process's resource-sharer thread closes what it handed over
        assert shared_fds_here() <= before
        assert group.call("step", 2)() == 2 and not group.failed
