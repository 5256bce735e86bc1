"""Careless values given to either worker group (in-process or process-backed): both read them alike.

``gather`` and ``rank0_only`` are sets of method names: a bare string was taken as the set of its characters by
the process group (``gather="step"`` gathered ``"s"``, not ``"step"``) and as a substring test by the in-process
group (``"s" in "step"``). A bare string is now one name, as the stage specs take it; anything else that is not
an iterable of non-empty strings is refused, naming the parameter, before anything is built or spawned.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

from engine.parallel_actor import InProcessWorkerGroup
from engine.workers import ProcessWorkerGroup

from .conftest import RANKS


class Rank:
    """An in-process rank whose method names are substrings of one another."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def step(self) -> int:
        return self.rank

    def st(self) -> int:
        return self.rank


def in_process(built: list[int] | None = None, **kwargs: Any) -> InProcessWorkerGroup:
    def factory(rank: int) -> Rank:
        if built is not None:
            built.append(rank)
        return Rank(rank)

    return InProcessWorkerGroup(factory, **kwargs)


def process(**kwargs: Any) -> ProcessWorkerGroup:
    return ProcessWorkerGroup(f"{RANKS}:EchoRank", close_timeout=5.0, kill_grace=0.5, **kwargs)


def test_the_in_process_group_takes_a_bare_gather_string_as_one_method_name():
    group = in_process(world_size=2, gather="step")
    assert group.call("step")() == [0, 1]
    assert group.call("st")() == 0  # was [0, 1]: "st" in "step"
    group.close()


def test_the_process_group_takes_a_bare_gather_string_as_one_method_name(groups):
    group = groups(world_size=1, gather="info", rank0_only="step").start()
    assert [info["rank"] for info in group.call("info")()] == [0]  # was rank 0's dict: {"i", "n", "f", "o"}
    assert group.call("step", 3)() == 3


BAD_NAMES = [
    (None, "must be a method name or an iterable of method names, got None"),
    (5, "must be a method name or an iterable of method names, got 5"),
    ([["step"]], "must hold method names \\(non-empty strings\\), got \\['step'\\] in \\[\\['step'\\]\\]"),
    (["step", 3], "must hold method names \\(non-empty strings\\), got 3 in \\['step', 3\\]"),
    ([""], "must hold method names \\(non-empty strings\\), got '' in \\[''\\]"),
    (b"step", "must hold method names \\(non-empty strings\\), got 115 in b'step'"),
]


@pytest.mark.parametrize(("value", "message"), BAD_NAMES)
def test_the_in_process_group_refuses_gather_values_that_are_not_method_names(value, message):
    built: list[int] = []
    with pytest.raises(ValueError, match=f"^gather {message}$"):
        in_process(built, gather=value)
    assert built == []  # no rank was built


@pytest.mark.parametrize("field", ["gather", "rank0_only"])
@pytest.mark.parametrize(("value", "message"), BAD_NAMES)
def test_the_process_group_refuses_method_sets_that_are_not_method_names(field, value, message):
    with pytest.raises(ValueError, match=f"^{field} {message}$"):
        process(**{field: value})
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("make", [in_process, process], ids=["in-process", "process"])
def test_both_groups_label_each_rank_with_one_device_id(make):
    for kwargs, labels in [
        ({"world_size": 2}, ("cpu", "cpu")),
        ({"world_size": 1, "device_ids": "cuda:1"}, ("cuda:1",)),  # one label, not its characters
        ({"world_size": 2, "device_ids": iter(["cuda:0", "cuda:1"])}, ("cuda:0", "cuda:1")),
    ]:
        group = make(**kwargs)
        assert group.device_ids == labels
        group.close()


@pytest.mark.parametrize("make", [in_process, process], ids=["in-process", "process"])
@pytest.mark.parametrize(("world_size", "device_ids", "message"), [
    (1, ("cuda:0", "cuda:1", "x"), "^need one device id per rank: 1 ranks, device_ids=\\('cuda:0', 'cuda:1', 'x'\\)$"),
    (2, (), "^need one device id per rank: 2 ranks, device_ids=\\(\\)$"),
    (3, "cpu", "^need one device id per rank: 3 ranks, device_ids=\\('cpu',\\)$"),  # was ('c', 'p', 'u')
    (1, 7, "^device_ids must be an iterable of device labels, got 7$"),
])
def test_both_groups_refuse_device_ids_that_are_not_one_per_rank(make, world_size, device_ids, message):
    with pytest.raises(ValueError, match=message):
        make(world_size=world_size, device_ids=device_ids)


def test_the_in_process_group_refuses_a_rank_factory_that_is_not_callable():
    with pytest.raises(TypeError, match="^rank_factory must be a callable taking the rank, got 'ranks:Rank'$"):
        InProcessWorkerGroup("ranks:Rank", world_size=2)  # was: 'str' object is not callable
