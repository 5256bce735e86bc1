"""A value a worker process sends that the server process cannot load (a class of a module only the child has, an
object whose ``__reduce__``/``__setstate__`` raises when loaded) fails only the call it answers: the reader of
every message from that process never sees it, so the process group serves on. With real rank processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.workers import ProcessWorkerGroup, WorkerCallError

RANKS = "spec_tests.reliability.unloadable_ranks:UnloadableRank"


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
