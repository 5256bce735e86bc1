"""SlotPool (reference B.5): fixed per-session cache slots, LIFO reuse, errors that name the pool."""

from __future__ import annotations

import threading

import numpy
import pytest

from engine.slots import SlotPool, SlotPoolFullError, SlotReleaseError


def test_hands_out_fresh_slots_in_order_then_the_most_recently_released():
    pool = SlotPool(4)
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2]
    pool.release(1)
    pool.release(0)
    assert pool.acquire() == 0  # last released, first reused
    assert pool.acquire() == 1
    assert pool.acquire() == 3  # never used before, handed out once released ones are gone
    assert pool.try_acquire() is None


def test_counts_follow_acquire_and_release():
    pool = SlotPool(3, name="KV")
    assert (pool.capacity, pool.name, pool.in_use, pool.available) == (3, "KV", 0, 3)
    a, b = pool.acquire(), pool.acquire()
    assert (pool.in_use, pool.available, pool.in_use_slots()) == (2, 1, frozenset({a, b}))
    pool.release(a)
    assert (pool.in_use, pool.available, pool.in_use_slots()) == (1, 2, frozenset({b}))


def test_full_pool_error_names_the_pool_and_capacity():
    pool = SlotPool(2, name="VAE decoder cache")
    pool.acquire(), pool.acquire()
    with pytest.raises(SlotPoolFullError, match=r"^VAE decoder cache pool is full \(capacity=2\)$"):
        pool.acquire()
    assert pool.try_acquire() is None
    assert pool.in_use == 2


def test_default_name_appears_in_errors():
    pool = SlotPool(1)
    pool.acquire()
    with pytest.raises(SlotPoolFullError, match=r"^Session cache pool is full \(capacity=1\)$"):
        pool.acquire()


def test_double_release_names_the_pool():
    pool = SlotPool(2, name="KV")
    slot = pool.acquire()
    pool.release(slot)
    with pytest.raises(SlotReleaseError, match=r"KV pool: slot 0 .*released twice"):
        pool.release(slot)
    assert (pool.in_use, pool.available) == (0, 2)


def test_release_of_a_never_acquired_slot_is_refused():
    pool = SlotPool(3, name="KV")
    pool.acquire()
    with pytest.raises(SlotReleaseError, match="KV pool: slot 2 is not in use"):
        pool.release(2)
    assert pool.acquire() == 1  # the refused release changed nothing


@pytest.mark.parametrize(("slot", "refusal"), [
    (3, "slot 3 is outside capacity"), (100, "slot 100 is outside capacity"),
    # a bool, a float or a string is no slot index (it was called one outside capacity, whatever its value)
    *((bad, "slot must be an int >= 0, got ") for bad in (-1, True, "0", 1.0, None)),
])
def test_a_refused_release_names_the_pool_and_why(slot, refusal):
    pool = SlotPool(3, name="KV")
    pool.acquire()
    with pytest.raises(SlotReleaseError, match=f"KV pool: {refusal}"):
        pool.release(slot)
    assert pool.in_use == 1


def test_a_numpy_integer_is_a_slot_index_as_a_sequence_id_is():
    pool = SlotPool(3, name="KV")
    slot = pool.acquire()
    pool.release(numpy.int64(slot))
    assert pool.in_use == 0
    assert SlotPool(numpy.int32(2)).capacity == 2


@pytest.mark.parametrize("capacity", [0, -1, True, 1.5, "2"])
def test_capacity_must_be_a_positive_int(capacity):
    with pytest.raises(ValueError, match="Spare pool capacity"):
        SlotPool(capacity, name="Spare")


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_name_must_be_non_empty(name):
    with pytest.raises(ValueError, match="name"):
        SlotPool(2, name=name)


def test_errors_are_typed():
    assert issubclass(SlotPoolFullError, RuntimeError)
    assert issubclass(SlotReleaseError, ValueError)


def test_no_growth_across_many_cycles():
    pool = SlotPool(4)
    for i in range(10_000):
        held = [pool.acquire() for _ in range(1 + i % 4)]
        for slot in reversed(held):
            pool.release(slot)
        assert len(pool._released) <= pool.capacity  # the free list never outgrows the pool
    assert (pool.in_use, pool.available) == (0, 4)
    assert sorted(pool.acquire() for _ in range(4)) == [0, 1, 2, 3]
    assert pool.try_acquire() is None


def test_threads_never_share_a_slot():
    pool = SlotPool(4, name="threaded")
    owners: list[int | None] = [None] * pool.capacity
    errors: list[str] = []
    start = threading.Barrier(8)

    def worker(me: int) -> None:
        start.wait()
        done = 0
        while done < 2_000:
            slot = pool.try_acquire()
            if slot is None:
                continue
            if owners[slot] is not None:
                errors.append(f"slot {slot} held by {owners[slot]} and {me}")
            owners[slot] = me
            owners[slot] = None
            pool.release(slot)
            done += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert (pool.in_use, pool.available, pool.in_use_slots()) == (0, 4, frozenset())
