"""Many queued sessions: a create costs what it costs with few, and ending them all is one bounded pass.

Speed is not timed here: the work is counted, through the HTTP API of a real app. A record's ``status`` is read
by whatever visits the record, and session ids are a ``str`` subclass that counts its comparisons (a walk of the
queue compares each entry it passes); both are counted test-side only. The shutdown's pass is watched from
another task: between its batches the rest of the server runs (health answers) and no queued session it is
ending is promoted onto a slot freed meanwhile.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server import queued_ends
from server.registry import SessionRecord, SessionRegistry
from server.runtime import SHUTDOWN_REASON, StreamRuntime
from states.stream_session import Event, State

from ..reliability.test_worker_restarts import DyingService, Loader
from ..reliability.test_worker_restarts import serve as restarts_serve
from ..virtual_time import elapse
from .runner_fixtures import CounterService, Served, serve, settings, wait_until
from .runner_fixtures import no_threads  # noqa: F401  (fixture)

SESSIONS = "/v1/stream/sessions"
GRACE = 5.0


class CountedId(str):
    """A session id that counts the comparisons made with it (a dict finds it by hash and identity: none)."""

    def __eq__(self, other: object) -> bool:
        Visits.now.comparisons += 1
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        Visits.now.comparisons += 1
        return str.__ne__(self, other)

    __hash__ = str.__hash__


class Visits:
    """Records visited (a ``status`` read) and queue entries passed (an id compared) since :meth:`reset`."""

    now: Visits

    def __init__(self) -> None:
        self.statuses = 0
        self.comparisons = 0

    def reset(self) -> None:
        self.statuses = self.comparisons = 0

    @property
    def total(self) -> int:
        return self.statuses + self.comparisons


@pytest.fixture
def visits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Visits]:
    """Count status reads and id comparisons, for sessions whose ids are :class:`CountedId`."""
    Visits.now = counter = Visits()
    status = SessionRecord.status

    def counted_status(record: SessionRecord) -> State:
        counter.statuses += 1
        return status.fget(record)  # type: ignore[misc]

    def counted_new_session() -> tuple[str, str]:
        session_id = CountedId(secrets.token_hex(8))
        return session_id, f"chunkline-{session_id}"

    monkeypatch.setattr(SessionRecord, "status", property(counted_status))
    monkeypatch.setattr(StreamRuntime, "new_session", staticmethod(counted_new_session))
    yield counter


@asynccontextmanager
async def queued_behind_one(queued: int, **overrides: Any) -> AsyncIterator[tuple[Served, dict[str, Any], list[str]]]:
    """A server with one slot, its session, and ``queued`` sessions waiting behind it (ids head first)."""
    values: dict[str, Any] = {"queue_size": queued + 1, "session_timeout": 86_400.0,
                              "terminal_retention_count": queued + 1, **overrides}  # every end stays readable
    async with serve(settings(**values), CounterService()) as s:
        live = await s.create("live")
        assert live["status"] != "queued", live
        ids = []
        for index in range(queued):
            created = await s.create(f"waiting-{index}")
            assert created["queue_position"] == index + 1, created
            ids.append(created["session_id"])
        await wait_all_tasks_blocked()
        yield s, live, ids


async def work_of_one_more(queued: int, visits: Visits) -> int:
    """Records visited and queue entries passed by: a create that queues, a look at it, the delete of a session
    queued in the middle, and the end of the live session (its slot goes to the queue's head)."""
    async with queued_behind_one(queued) as (s, live, ids):
        visits.reset()
        created = await s.create("one-more")
        assert created["queue_position"] == queued + 1
        assert (await s.get(created["session_id"]))["queue_position"] == queued + 1
        status, body = await s.json("delete", f"{SESSIONS}/{ids[queued // 2]}")
        assert (status, body["status"]) == (200, "closed")
        status, _ = await s.json("delete", f"{SESSIONS}/{live['session_id']}")
        assert status == 200
        await wait_all_tasks_blocked()
        assert s.runtime.book.worker_of(ids[0]) is not None  # promoted
        assert (await s.get(created["session_id"]))["queue_position"] == queued - 1
        return visits.total


@pytest.mark.usefixtures("no_threads")
async def test_a_create_a_look_a_delete_and_a_promotion_cost_the_same_with_10_or_1000_queued(
    visits: Visits, autojump_clock: Any
) -> None:
    """Each counted every record (the gauges' session counts) or walked the queue (its place): with 10,000
    queued a create took 4 ms, not 1, and ending them one by one was n x n steps."""
    few = await work_of_one_more(10, visits)
    many = await work_of_one_more(1_000, visits)
    assert many == few, (few, many)


async def shutdown_work(queued: int, visits: Visits) -> int:
    async with queued_behind_one(queued) as (s, _, ids):
        visits.reset()
        await s.runtime.shutdown(GRACE)
        work = visits.total
        records = [s.runtime.get(session_id) for session_id in ids]
        assert all(r.status is State.FAILED and r.error == SHUTDOWN_REASON for r in records)
        return work


@pytest.mark.usefixtures("no_threads")
async def test_ending_n_queued_sessions_at_the_shutdown_costs_o_n(visits: Visits, autojump_clock: Any) -> None:
    """It cost n x n: each end counted every record for the gauges and walked the queue for its place (24 s of
    the event loop for 10,000). Linear work grows 100-fold from 10 to 1,000 sessions at most."""
    few = await shutdown_work(10, visits)
    many = await shutdown_work(1_000, visits)
    assert many <= 100 * few, (few, many)


@pytest.mark.usefixtures("no_threads")
async def test_the_shutdown_ends_queued_sessions_in_batches_serving_others_between(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    """One loop ended them all: health, other requests and live sessions waited for the whole of it. Now each
    batch is followed by a checkpoint; health answers mid-pass, the live session that ends mid-pass hands its
    slot to none of the sessions being ended, and every one of them fails with the shutdown's reason, counted."""
    batch = 20  # small batches: many checkpoints within a pass of a few hundred sessions
    monkeypatch.setattr(queued_ends, "BATCH", batch)
    queued = 15 * batch + 7
    async with queued_behind_one(queued) as (s, live, ids):
        runtime = s.runtime
        live_record = runtime.get(live["session_id"])
        seen: list[int] = []  # sessions still queued each time the watcher ran during the pass
        live_ended_with: list[int] = []  # ... when the live session had ended
        health: list[dict[str, Any]] = []
        failed_before = runtime.metrics.summary()["sessions_finished"]["failed"]

        async def watch() -> None:
            runtime.runners[live["session_id"]].abort()  # the live session ends mid-pass: its slot frees up
            while runtime.book.snapshot().queued:
                seen.append(runtime.book.snapshot().queued)
                if live_record.is_terminal and not live_ended_with:
                    live_ended_with.append(seen[-1])
                await trio.lowlevel.checkpoint()

        async def look_at_health() -> None:
            health.append((await s.json("get", "/v1/service/health"))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.shutdown, GRACE)
            await trio.lowlevel.checkpoint()
            nursery.start_soon(watch)
            nursery.start_soon(look_at_health)
        assert live_ended_with and live_ended_with[0] > 0, seen  # it did end while sessions were being ended
        assert 0 < health[0]["queued_sessions"] < queued, health
        # trio may run the pass twice between two runs of the watcher (it orders each round's tasks at random)
        steps = [before - after for before, after in zip(seen, seen[1:])]
        assert max(steps) <= 2 * batch and len(set(seen)) >= queued // (2 * batch), seen
        for session_id in ids:
            record = await s.get(session_id)
            assert (record["status"], record["error"], record["drain_cause"]) == ("failed", SHUTDOWN_REASON, "shutdown")
            assert record["worker_id"] is None  # never promoted: a promoted one would have started, then drained
        assert runtime.metrics.summary()["sessions_finished"]["failed"] - failed_before == queued
        assert runtime.registry.counts()["failed"] == queued and runtime.metrics.summary()["queue_depth"] == 0


@pytest.mark.usefixtures("no_threads")
async def test_many_queued_sessions_expiring_together_end_expired_in_batches(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: Any
) -> None:
    """The sweep ends them a batch at a time too; the live session that expires with them frees its slot
    mid-pass, and none of them takes it: each ends expired, as it was told, and nothing is left queued."""
    batch = 10
    monkeypatch.setattr(queued_ends, "BATCH", batch)
    queued = 6 * batch + 3
    async with queued_behind_one(queued, session_timeout=60.0) as (s, live, ids):
        await elapse(61.5)
        await wait_all_tasks_blocked()
        assert s.runtime.get(live["session_id"]).status is State.EXPIRED
        for session_id in ids:
            record = await s.get(session_id)
            assert (record["status"], record["drain_cause"], record["worker_id"]) == ("expired", "expired", None)
        assert s.runtime.book.snapshot().queued == 0 and not s.runtime.book.promotions_held
        assert s.runtime.metrics.summary()["sessions_finished"]["expired"] == queued + 1


async def test_when_no_worker_can_take_sessions_many_queued_ones_fail_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every slot gave up (a crash loop): the queued sessions fail a batch at a time, each with the reason and the
    cause it had when they failed in one loop, and the failures are counted."""
    monkeypatch.setattr(queued_ends, "BATCH", 10)
    queued = 45
    loader = Loader(DyingService(), None, None)
    async with restarts_serve(loader, queue_size=queued) as s:
        await wait_until(lambda: s.runtime.ready, "the first worker")
        await s.create("held")
        ids = [(await s.create(f"waiting-{index}"))["session_id"] for index in range(queued)]
        s.runtime.workers["worker-0"].service.die.set()  # type: ignore[union-attr]
        await wait_until(lambda: all(s.runtime.get(i).is_terminal for i in ids), "the queued sessions to fail")
        for session_id in ids:
            record = await s.get(session_id)
            assert record["status"] == "failed" and record["drain_cause"] == "worker_failed", record
            assert record["error"].startswith("no worker can take the session: ") and "crash loop" in record["error"]
        assert s.runtime.metrics.summary()["sessions_finished"]["failed"] == queued + 1  # and the held one
        assert not s.runtime.book.promotions_held


class HashedId(str):
    """A session id that counts how often it is hashed (each set or dict it goes into or is looked up in)."""

    hashed = 0

    def __hash__(self) -> int:
        HashedId.hashed += 1
        return str.__hash__(self)

    __eq__ = str.__eq__


def hashes_to_prune(records: int) -> int:
    """Hashes of ids while ``records`` terminal records age out together (and the counts stay right)."""
    registry = SessionRegistry(wall_clock=lambda: 0.0)
    for index in range(records):
        session_id = HashedId(f"s{index}")
        record = SessionRecord(session_id, f"room-{index}", "ctl", {}, None, None, 0.0, None, None)
        registry.add(record)
        registry.apply(record, Event.QUEUE, now=0.0)
        registry.apply(record, Event.EXPIRE, now=1.0)
    assert registry.counts()["expired"] == records
    HashedId.hashed = 0
    assert len(registry.prune(100.0, retention_seconds=10.0, retention_count=1_000_000)) == records
    assert len(registry) == 0 and registry.counts()["expired"] == 0
    return HashedId.hashed


def test_terminal_records_ageing_out_together_are_pruned_in_o_n() -> None:
    """The prune made the set of those to go once for each record it looked at: n x n for n at once."""
    few, many = hashes_to_prune(10), hashes_to_prune(1_000)
    assert many <= 2 * 100 * few, (few, many)
