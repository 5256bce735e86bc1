"""ExecutionLease (virtual time, autojump clock): rotation, and drivers that declare themselves idle.

With rotation (the driver's default) a holder that is still active yields at its chunk boundary when others
wait, so busy sessions take turns chunk by chunk; an idle holder is parked, not rotated. A driver with nothing
to run says so (``idle``): it relinquishes the lease at once to a waiter, so an idle session never holds it from
a busy one, and it queues again only on a new control. (The reference rule's turns, handoff and close:
``test_lease_driver.py``.)
"""

from __future__ import annotations

import pytest
import trio

from pipelines.lease import ExecutionLease
from states.lease import State

from ..virtual_time import elapse
from .lease_helpers import IDLE, Log, Runner, settle


# -- rotation ------------------------------------------------------------------------------------------


async def test_the_seed_rule_is_the_default_and_rotation_is_opt_in(autojump_clock):
    assert ExecutionLease(IDLE).book.rotate is False
    assert ExecutionLease(IDLE, rotate=True).book.rotate is True


async def test_with_rotation_busy_sessions_alternate_at_chunk_boundaries(log, autojump_clock):
    lease = ExecutionLease(IDLE, on_transition=log, rotate=True)
    order: list[str] = []

    async def busy(session_id: str) -> None:
        for _ in range(4):
            lease.record_activity(session_id)  # always active: never idle-expired
            async with lease.chunk(session_id):
                order.append(session_id)
                await elapse(0.1)

    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        lease.register("a")
        lease.register("b")
        async with trio.open_nursery() as sessions:
            sessions.start_soon(busy, "a")
            sessions.start_soon(busy, "b")
        nursery.cancel_scope.cancel()
    assert sorted(order) == ["a"] * 4 + ["b"] * 4
    assert all(x != y for x, y in zip(order, order[1:])), order  # strict alternation
    # a yielding holder is reported as queued again, then granted on its next turn
    first = order[0]
    assert log.events(first)[:4] == [(first, "lease_queued"), (first, "lease_granted")] * 2
    assert ("a", "lease_parked") not in log.events() and ("b", "lease_parked") not in log.events()


async def test_with_rotation_a_single_active_session_keeps_the_lease(log, autojump_clock):
    lease = ExecutionLease(IDLE, on_transition=log, rotate=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        lease.register("a")
        for _ in range(3):
            lease.record_activity("a")
            async with lease.chunk("a"):
                await elapse(0.1)
        nursery.cancel_scope.cancel()
    assert log.events() == [("a", "lease_queued"), ("a", "lease_granted")]  # nobody waits: no yield


async def test_with_rotation_an_idle_holder_is_parked_not_rotated(log, autojump_clock):
    lease = ExecutionLease(IDLE, on_transition=log, rotate=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        lease.register("a")
        lease.register("b")
        lease.record_activity("a")
        async with lease.chunk("a"):
            lease.record_activity("b")
            await elapse(IDLE * 2)  # a is idle-expired by its chunk's end
        assert log.events()[-2:] == [("a", "lease_parked"), ("b", "lease_granted")]
        nursery.cancel_scope.cancel()


# -- idle drivers relinquish -----------------------------------------------------------------------

CHUNK = 0.1  # chunk duration in the starvation tests: far below the idle timeout
LONG_IDLE = 10.0


async def _starvation_scenario(*, declare_idle: bool, rotate: bool = True) -> tuple[list[float], Log]:
    """A keeps a key held and loops chunks; B only wanted its one preview chunk,
    then its driver waits for input. Returns how long each of A's chunks waited."""
    log = Log()
    lease = ExecutionLease(LONG_IDLE, rotate=rotate, on_transition=log)
    waits: list[float] = []

    async def a_holds_a_key() -> None:
        for _ in range(30):
            lease.record_activity("a")  # a control before every chunk: never idle
            asked = trio.current_time()
            async with lease.chunk("a"):
                waits.append(trio.current_time() - asked)
                await elapse(CHUNK)

    async def b_previews_once() -> None:
        async with lease.chunk("b"):
            await elapse(CHUNK)
        if declare_idle:
            lease.idle("b")  # about to wait for input
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        lease.register("a")
        lease.record_activity("a")
        async with trio.open_nursery() as sessions:
            sessions.start_soon(a_holds_a_key)
            await elapse(CHUNK / 2)  # a is mid-chunk when b starts
            lease.register("b")
            lease.record_activity("b")  # pressing Start asks for the preview chunk
            sessions.start_soon(b_previews_once)
            await elapse(CHUNK * 30 + LONG_IDLE * 2)  # room for a stall of a whole idle timeout
            sessions.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    return waits, log


async def test_with_rotation_an_idle_session_never_holds_the_lease_from_a_busy_one(autojump_clock):
    waits, log = await _starvation_scenario(declare_idle=True)
    assert len(waits) == 30  # a got all its chunks within the window
    assert max(waits) <= CHUNK + 1e-9, waits  # never blocked for longer than one chunk of b
    # b ran its one chunk, then gave the lease up each time rotation handed it back
    assert ("b", "lease_granted") in log.events("b")
    assert log.events("b")[-1] == ("b", "lease_parked")
    assert ("a", "lease_parked") not in log.events()


async def test_without_the_idle_declaration_the_busy_session_starves(autojump_clock):
    # the bug this guards against: b is granted while its driver waits for input
    waits, _ = await _starvation_scenario(declare_idle=False)
    assert max(waits) >= LONG_IDLE - CHUNK


async def test_without_rotation_an_idle_holder_hands_over_at_once(log, autojump_clock):
    lease = ExecutionLease(LONG_IDLE, rotate=False, on_transition=log)
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    a, b = Runner(lease, "a"), Runner(lease, "b")
    a.release.set()
    b.release.set()
    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        await a.one()  # a ran; its controls are fresh (not idle-expired)
        lease.record_activity("b")
        nursery.start_soon(b.one)
        await elapse(CHUNK)
        assert b.started == 0 and lease.book.holder() == "a"  # the reference rule: a keeps it
        declared = trio.current_time()
        lease.idle("a")  # a's keys were released: nothing to run
        await b.entered.wait()
        assert trio.current_time() == declared  # not after idle_timeout
        assert log.events()[-2:] == [("a", "lease_parked"), ("b", "lease_granted")]
        await settle()
        nursery.cancel_scope.cancel()
    assert b.finished == 1


async def test_an_idle_holder_keeps_the_lease_until_someone_queues(log, autojump_clock):
    lease = ExecutionLease(LONG_IDLE, on_transition=log)
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    log.clear()
    lease.idle("a")  # nobody waits: no park and re-grant to publish
    assert lease.book.holder() == "a" and log.events() == []
    async with lease.chunk("a"):  # its next chunk needs no new turn
        pass
    assert log.events() == [] and not lease.is_idle("a")
    lease.idle("a")
    lease.record_activity("b")  # a waiter queues: the idle holder hands over at once
    assert log.events() == [("b", "lease_queued"), ("a", "lease_parked"), ("b", "lease_granted")]
    lease.idle("b")
    assert lease.book.holder() == "b"  # nobody waits behind b
    # a's driver has a chunk to run again, but no control came since it stepped aside: it waits
    runner = Runner(lease, "a")
    runner.release.set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.one)
        await elapse(LONG_IDLE * 3)
        assert runner.finished == 0 and lease.book.state("a") is State.PARKED and log.events()[-1] == ("b", "lease_granted")
        lease.record_activity("a")  # its controller sends again: queued, and idle b steps aside
    assert runner.finished == 1 and lease.book.holder() == "a"
    assert log.events()[-3:] == [("a", "lease_queued"), ("b", "lease_parked"), ("a", "lease_granted")]
    assert not lease.is_idle("a") and lease.is_idle("b")


async def test_a_parked_session_returns_to_the_queue_only_on_a_new_control(log, autojump_clock):
    # the seed's rule parks an idle-expired holder; its driver (a held key with no heartbeat,
    # a continuous session) still has work, but only a new control queues it again
    lease = ExecutionLease(IDLE, rotate=False, on_transition=log)
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        a1 = Runner(lease, "a")
        a1.release.set()
        await a1.one()
        lease.record_activity("b")
        await elapse(IDLE * 2)  # the tick parks idle a, b is granted
        assert lease.book.state("a") is State.PARKED and lease.book.holder() == "b"
        lease.idle("b")  # b has nothing more, but nobody waits: b keeps the lease
        a2 = Runner(lease, "a")
        a2.release.set()
        async with trio.open_nursery() as waiting:
            waiting.start_soon(a2.one)
            await elapse(IDLE * 10)  # no re-queue without a message: no alternation
            assert a2.finished == 0 and lease.book.state("a") is State.PARKED
            lease.record_activity("a")  # a new control: queued, b (idle) steps aside
        nursery.cancel_scope.cancel()
    assert a2.finished == 1
    assert log.events("a")[-3:] == [("a", "lease_parked"), ("a", "lease_queued"), ("a", "lease_granted")]


async def test_a_queued_idle_session_hands_a_later_grant_straight_on(log, autojump_clock):
    lease = ExecutionLease(LONG_IDLE, rotate=True, on_transition=log)
    for sid in ("a", "b", "c"):
        lease.register(sid)
        lease.record_activity(sid)
    lease.idle("b")  # b is queued (head) but its driver has nothing to run
    assert lease.book.state("b") is State.QUEUED  # keeps its place until granted
    log.clear()
    runner = Runner(lease, "a")
    runner.release.set()
    lease.record_activity("a")
    await runner.one()  # a yields at its boundary; b is granted and relinquishes at once
    assert log.events() == [
        ("a", "lease_queued"),
        ("b", "lease_granted"),
        ("b", "lease_parked"),
        ("c", "lease_granted"),
    ]
    assert lease.book.queued() == ("a",)


async def test_an_idle_mark_set_mid_chunk_relinquishes_at_the_chunk_end(log, autojump_clock):
    lease = ExecutionLease(LONG_IDLE, rotate=False, on_transition=log)
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    lease.record_activity("b")
    async with lease.chunk("a"):
        lease.idle("a")
        assert lease.book.holder() == "a" and lease.book.is_busy("a")
    assert log.events()[-2:] == [("a", "lease_parked"), ("b", "lease_granted")]


async def test_a_control_for_an_idle_parked_session_does_not_flap_the_lease(log, autojump_clock):
    lease = ExecutionLease(LONG_IDLE, on_transition=log)
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    lease.idle("a")
    lease.record_activity("b")  # a relinquishes to b
    lease.idle("b")  # b has nothing either, but nobody waits: it keeps the lease
    assert lease.book.state("a") is State.PARKED and lease.book.holder() == "b"
    log.clear()
    lease.record_activity("a")  # e.g. a key release: its driver may still have nothing to run
    assert log.events() == [] and lease.book.state("a") is State.PARKED
    async with lease.chunk("a"):  # it had something after all
        pass
    assert log.events() == [("a", "lease_queued"), ("b", "lease_parked"), ("a", "lease_granted")]
    assert not lease.is_idle("a")


async def test_idle_ignores_unknown_and_closing_sessions_and_close_clears_the_mark(autojump_clock):
    lease = ExecutionLease(LONG_IDLE)
    lease.idle("never-registered")
    lease.register("a")
    lease.record_activity("a")
    async with lease.chunk("a"):
        lease.close("a")
        lease.idle("a")  # closing: ignored
        assert not lease.is_idle("a")
    assert "a" not in lease.book
    lease.register("b")
    lease.idle("b")
    assert lease.is_idle("b")
    lease.close("b")
    assert not lease.is_idle("b")


@pytest.mark.parametrize("idle_timeout", [1.0, 30.0])
async def test_a_held_key_without_heartbeats_parks_after_the_configured_idle_timeout(idle_timeout, autojump_clock):
    """Two continuously wanting drivers (a key held in each, as in the toy world); a's controller sent
    one control and then no heartbeat, b's keeps sending. a is parked at the first chunk boundary at or
    after ``idle_timeout`` of silence (never before), b runs, and a never queues again without a control."""
    log = Log()
    lease = ExecutionLease(idle_timeout, rotate=False, on_transition=log)
    chunk_seconds = 0.25
    lease.register("a")
    lease.register("b")
    lease.record_activity("a")
    silent_from = trio.current_time()
    ran: dict[str, int] = {"a": 0, "b": 0}

    async def drive(session_id: str) -> None:  # a held key: there is always a chunk to run
        while True:
            async with lease.chunk(session_id):
                await elapse(chunk_seconds)
            ran[session_id] += 1

    async def heartbeat(session_id: str) -> None:  # the demo page's control_state, once a second
        while True:
            lease.record_activity(session_id)
            await elapse(1.0)

    async with trio.open_nursery() as nursery:
        await nursery.start(lease.run)
        nursery.start_soon(drive, "a")
        await elapse(chunk_seconds / 2)
        nursery.start_soon(heartbeat, "b")
        nursery.start_soon(drive, "b")
        await elapse(idle_timeout * 3)
        nursery.cancel_scope.cancel()
    parked = [at for at, sid, state in log.items if sid == "a" and state is State.PARKED]
    assert len(parked) == 1
    assert silent_from + idle_timeout <= parked[0] <= silent_from + idle_timeout + chunk_seconds + idle_timeout / 4
    assert [state for at, sid, state in log.items if sid == "a" and at > parked[0]] == []  # no alternation
    assert ran["b"] > 0 and lease.book.holder() == "b"
