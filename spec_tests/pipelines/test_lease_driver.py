"""ExecutionLease: the trio driver of states.lease_book.LeaseBook (virtual time, autojump clock).

Reference semantics (B.8, ``rotate=False``): the lease changes hands only at a
chunk boundary or a tick, and only from a holder that has been idle (no control
activity) for ``idle_timeout`` while someone waits. With rotation (the driver's
default) a holder that is still active also yields at its chunk boundary when
others wait, so busy sessions take turns chunk by chunk.

Here: the reference rule's turns and events, handoff only at a chunk boundary or a tick, and close. Rotation,
and drivers that declare themselves idle: ``test_lease_rotation_and_idle.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from pipelines.lease import ExecutionLease, LeaseClosed
from states.lease import State

from ..virtual_time import elapse
from .lease_helpers import IDLE, Log, Runner, settle


@pytest.fixture
async def lease(log: Log, autojump_clock) -> AsyncIterator[ExecutionLease]:
    driver = ExecutionLease(IDLE, rotate=False, on_transition=log)  # the reference rule
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        yield driver
        nursery.cancel_scope.cancel()


# -- events and turns ------------------------------------------------------------------------------


async def test_activity_queues_and_grants_and_every_transition_is_reported(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    assert log.events() == []  # registering only: WAITING is not published
    assert [(sid, state) for _, sid, state in log.items] == [("a", State.WAITING), ("b", State.WAITING)]
    lease.record_activity("a")
    assert log.events() == [("a", "lease_queued"), ("a", "lease_granted")]
    lease.record_activity("b")
    assert log.events("b") == [("b", "lease_queued")]
    assert lease.book.holder() == "a"
    assert lease.book.queue_position("b") == 1
    lease.record_activity("b")  # already queued: nothing new
    assert log.events("b") == [("b", "lease_queued")]


async def test_chunk_waits_for_the_sessions_turn(lease, log, autojump_clock):
    for sid in ("a", "b"):
        lease.register(sid)
        lease.record_activity(sid)
    a, b = Runner(lease, "a"), Runner(lease, "b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.one)
        await settle()
        assert b.started == 0  # b is queued behind a
        nursery.start_soon(a.one)
        await a.entered.wait()
        await settle()
        assert b.started == 0
        a.release.set()
        await settle()
        assert a.finished == 1
        # a is not idle yet (its activity is fresh): it keeps the lease
        assert lease.book.holder() == "a"
        assert b.started == 0
        await elapse(IDLE * 2)  # a is idle now; the tick hands over
        await b.entered.wait()
        assert log.events() [-2:] == [("a", "lease_parked"), ("b", "lease_granted")]
        b.release.set()
    assert b.finished == 1


# -- handoff only at a boundary or a tick -------------------------------------------------------------


async def test_an_idle_holder_keeps_the_lease_while_nobody_waits(lease, log, autojump_clock):
    lease.register("a")
    lease.record_activity("a")
    a = Runner(lease, "a")
    a.release.set()
    await a.one()
    await elapse(IDLE * 10)
    assert lease.book.holder() == "a"
    assert ("a", "lease_parked") not in log.events()
    a2 = Runner(lease, "a")
    a2.release.set()
    await a2.one()  # still its turn, no waiting
    assert a2.finished == 1


async def test_an_idle_holder_mid_chunk_hands_over_only_at_the_chunk_boundary(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    a, b = Runner(lease, "a"), Runner(lease, "b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.one)
        await a.entered.wait()
        lease.record_activity("b")
        nursery.start_soon(b.one)
        await elapse(IDLE * 5)  # far past a's idle timeout, ticks run, a is still mid-chunk
        assert lease.book.holder() == "a"
        assert b.started == 0
        assert ("a", "lease_parked") not in log.events()
        boundary = trio.current_time()
        a.release.set()  # the chunk boundary: a is idle-expired and b waits
        await b.entered.wait()
        parked = [t for t, sid, state in log.items if sid == "a" and state is State.PARKED]
        assert parked == [boundary]  # at the boundary itself, not at a later tick
        assert log.events()[-2:] == [("a", "lease_parked"), ("b", "lease_granted")]
        b.release.set()


async def test_a_tick_hands_over_from_an_idle_holder_between_chunks(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    start = trio.current_time()
    a = Runner(lease, "a")
    a.release.set()
    await a.one()  # a has run since its grant; now between chunks
    lease.record_activity("b")
    assert log.events("b") == [("b", "lease_queued")]
    b = Runner(lease, "b")
    b.release.set()
    await b.one()  # waits for the tick that parks a
    parked = [t for t, sid, state in log.items if sid == "a" and state is State.PARKED]
    granted = [t for t, sid, state in log.items if sid == "b" and state is State.ACTIVE]
    assert len(parked) == 1 and granted == parked
    assert start + IDLE <= parked[0] <= start + IDLE * 1.25 + 1e-9  # within a quarter timeout
    assert log.events("b") == [("b", "lease_queued"), ("b", "lease_granted")]
    # a parked session is granted again only after new activity
    await elapse(IDLE * 3)
    assert lease.book.state("a") is State.PARKED
    lease.record_activity("a")  # b is idle-expired by now: parked at once, a granted
    assert log.events()[-3:] == [("a", "lease_queued"), ("b", "lease_parked"), ("a", "lease_granted")]


async def test_fresh_activity_keeps_the_holder_active(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    a = Runner(lease, "a")
    a.release.set()
    await a.one()
    lease.record_activity("b")
    for _ in range(10):
        await elapse(IDLE / 2)
        lease.record_activity("a")  # the controller keeps sending
        runner = Runner(lease, "a")
        runner.release.set()
        await runner.one()
    assert lease.book.holder() == "a"
    assert log.events("b") == [("b", "lease_queued")]


async def test_a_newly_granted_session_is_guaranteed_one_chunk(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    a = Runner(lease, "a")
    a.release.set()
    await a.one()
    lease.record_activity("b")  # queued while a holds: protected
    await elapse(IDLE * 3)  # a is parked by a tick, b granted; b's own activity is stale now
    assert lease.book.holder() == "b"
    lease.record_activity("a")  # a queues again; b has not run yet, so it keeps the lease
    await elapse(IDLE * 3)
    assert lease.book.holder() == "b"
    b = Runner(lease, "b")
    b.release.set()
    await b.one()  # b's guaranteed chunk; at its end b is idle-expired and a waits
    assert lease.book.holder() == "a"


# -- close ---------------------------------------------------------------------------------------------


async def test_closing_a_waiting_session_raises_lease_closed_in_its_waiter(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    lease.record_activity("b")
    b = Runner(lease, "b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.one)
        await settle()
        assert b.started == 0
        lease.close("b")
    assert isinstance(b.error, LeaseClosed)
    assert b.started == 0
    assert "b" not in lease.book
    assert lease.book.holder() == "a"


async def test_closing_a_session_mid_chunk_releases_the_lease_after_the_chunk(lease, log, autojump_clock):
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    a, b = Runner(lease, "a"), Runner(lease, "b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.one)
        await a.entered.wait()
        lease.record_activity("b")
        nursery.start_soon(b.one)
        lease.close("a")
        await settle()
        assert lease.book.state("a") is State.CLOSING
        assert lease.book.draining() == "a"
        assert b.started == 0  # a's chunk still runs: nobody else may
        a.release.set()
        await b.entered.wait()
        assert "a" not in lease.book  # forgotten once its chunk ended
        assert log.events("b") == [("b", "lease_queued"), ("b", "lease_granted")]
        b.release.set()
    assert a.finished == 1 and b.finished == 1


async def test_a_failing_chunk_keeps_the_lease_consistent(lease, log, autojump_clock):
    lease.register("a")
    lease.record_activity("a")
    with pytest.raises(RuntimeError, match="chunk failed"):
        async with lease.chunk("a"):
            raise RuntimeError("chunk failed")
    assert not lease.book.is_busy("a")
    assert lease.book.holder() == "a"
    runner = Runner(lease, "a")
    runner.release.set()
    await runner.one()
    assert runner.finished == 1


async def test_close_is_idempotent_and_ignores_unknown_sessions(lease, log, autojump_clock):
    lease.close("never-registered")
    lease.register("a")
    lease.record_activity("a")
    lease.close("a")
    lease.close("a")
    assert "a" not in lease.book
