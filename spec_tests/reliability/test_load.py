"""Load: the real server (hypercorn's trio ``serve`` on loopback), capacity 4, queue 8, and 64 clients
creating, polling and deleting sessions concurrently in bounded loops.

Every answer is 200, 202 or 429 and agrees with the others: never more than 4 sessions retained nor 8
queued, queue positions FIFO and current. Afterwards nothing is retained or queued, every slot is
free and every record is terminal. No request hangs: each answers within a generous hang bound (the
server never waits on pipeline work in a request; request latency is measured by ``bench.server``,
not asserted here, because a loaded CI machine would make a tight bound flaky).

No controller joins, so assigned sessions wait in ``assigned``/``joining_room`` until deleted
(``controller_timeout`` is an hour). The admission book is watched from inside the process: its
``admit``/``release`` and the runtime's ``queue_position`` are wrapped (test-side only) so that every
decision is checked against a model FIFO at the moment it is made.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.lowlevel

from server.app import create_app
from server.runtime import StreamRuntime
from server.settings import ServerSettings

from ..server.http_served import AGENT_PIPELINE, serve_http
from ..server.runner_fixtures import CounterService, counter_loader
from .helpers import Leaks, wait_until

CAPACITY = 4
QUEUE = 8
CLIENTS = 64
ITERATIONS = 5
MAX_POLLS = 3  # GETs per iteration (fewer once the session is no longer queued)
AGENT_START = 240.0  # seconds: an agent process imports torch (slow on a loaded 2-core host)
HANG_BOUND = 30.0  # seconds: a request slower than this is stuck, not slow (it took 11 s on a loaded 2-core host)
SESSIONS = "/v1/stream/sessions"
WAITING = {"assigned", "joining_room"}


@attrs.define
class Answer:
    client: int
    method: str
    path: str
    status: int
    body: Any
    seconds: float


class _WatchedBook:
    """The runtime's admission book, with ``admit`` and ``release`` seen by the watch (the book has slots)."""

    def __init__(self, book: Any, admit: Any, release: Any) -> None:
        self._book = book
        self.admit = admit
        self.release = release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._book, name)


class Watch:
    """Checks every admission decision against a model FIFO, at the moment the book makes it."""

    def __init__(self, runtime: StreamRuntime) -> None:
        self.runtime = runtime
        self.book = runtime.book  # the real one (wrapped below)
        self.queue: list[str] = []  # the model FIFO
        self.max_retained = 0
        self.max_queued = 0
        self.decisions: Counter[str] = Counter()
        self.problems: list[str] = []
        admit, release, position = self.book.admit, self.book.release, runtime.queue_position

        def watched_admit(session_id: str, now: float, ahead: int = 0) -> Any:
            before = self.book.snapshot()
            admission, transitions = admit(session_id, now, ahead=ahead)
            self.decisions[admission.status] += 1
            if admission.status == "assigned" and before.retained >= CAPACITY:
                self.problem(f"{session_id} assigned with {before.retained} retained")
            if admission.status == "queued" and (before.free_slots or before.retained < CAPACITY):
                self.problem(f"{session_id} queued while a slot was free: {before}")
            if admission.status == "rejected" and before.free_slots + QUEUE - before.queued > ahead:
                self.problem(f"{session_id} rejected with room: {before}")
            self.follow(transitions)
            return admission, transitions

        def watched_release(session_id: str, now: float) -> Any:
            transitions = release(session_id, now)
            self.follow(transitions)
            return transitions

        def watched_position(record: Any) -> Any:
            got = position(record)
            if got is not None:
                expected = self.queue.index(record.session_id) + 1 if record.session_id in self.queue else None
                if got != expected:
                    self.problem(f"{record.session_id}: queue position {got}, model FIFO says {expected}")
            return got

        runtime.book = _WatchedBook(self.book, watched_admit, watched_release)  # type: ignore[assignment]
        runtime.queue_position = watched_position  # type: ignore[method-assign]

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def follow(self, transitions: list[Any]) -> None:
        for t in transitions:
            kind = getattr(t, "kind", None)
            if kind == "queued":
                self.queue.append(t.session_id)
                if t.queue_position != len(self.queue):
                    self.problem(f"{t.session_id} queued at {t.queue_position}, model FIFO length {len(self.queue)}")
            elif kind == "promoted":
                self.decisions["promoted"] += 1
                if not self.queue or self.queue[0] != t.session_id:
                    self.problem(f"{t.session_id} promoted out of FIFO order (head: {self.queue[:1]})")
                if t.queue_position != 1:
                    self.problem(f"{t.session_id} promoted from position {t.queue_position}")
                if t.session_id in self.queue:
                    self.queue.remove(t.session_id)
            elif kind == "dequeued":
                if t.session_id not in self.queue:
                    self.problem(f"{t.session_id} dequeued but not queued")
                else:
                    if t.queue_position != self.queue.index(t.session_id) + 1:
                        self.problem(f"{t.session_id} dequeued from {t.queue_position}, model says "
                                     f"{self.queue.index(t.session_id) + 1}")
                    self.queue.remove(t.session_id)
        self.check_book()

    def check_book(self) -> None:
        snapshot = self.book.snapshot()
        self.max_retained = max(self.max_retained, snapshot.retained)
        self.max_queued = max(self.max_queued, snapshot.queued)
        if snapshot.retained > CAPACITY or snapshot.queued > QUEUE:
            self.problem(f"over the limits: {snapshot}")
        if snapshot.queued and snapshot.free_slots:
            self.problem(f"a free slot with sessions queued: {snapshot}")
        if list(self.book.queued_ids()) != self.queue:
            self.problem(f"book FIFO {list(self.book.queued_ids())} != model {self.queue}")


@pytest.mark.parametrize("workers", ["in-process", "local"])
async def test_64_clients_create_poll_delete_under_capacity_4_queue_8(workers: str) -> None:
    """``local``: the same load through the authority, its one worker a ``chunkline worker`` agent process."""
    leaks = Leaks(fd_slack=4)
    limits = dict(max_sessions_per_worker=CAPACITY, queue_size=QUEUE, controller_timeout=3600, room_empty_timeout=3600)
    if workers == "in-process":
        settings = ServerSettings(pipeline="in-test", **limits)
        app = create_app(settings, service_loader=counter_loader(CounterService()))
    else:
        # a generous heartbeat deadline: this test loads the authority's loop on purpose, liveness is not its subject
        app = create_app(ServerSettings(pipeline=AGENT_PIPELINE, workers="local", heartbeat_deadline=30.0, **limits))
    runtime: StreamRuntime = app.extensions["chunkline"]
    async with serve_http(app) as base_url:  # hypercorn on loopback; agents join the local rooms there
        await wait_until(lambda: runtime.ready, "the runtime to be ready", deadline=AGENT_START)
        worker_id = next(iter(runtime.workers))  # worker-0, or the agent's fresh id
        watch = Watch(runtime)
        answers: list[Answer] = []

        async def request(client: httpx.AsyncClient, index: int, method: str, path: str, **kw: Any) -> Answer:
            started = time.monotonic()
            response = await client.request(method, path, **kw)
            answer = Answer(index, method, path, response.status_code, response.json(), time.monotonic() - started)
            answers.append(answer)
            watch.check_book()
            return answer

        async def client_loop(index: int, client: httpx.AsyncClient) -> None:
            for iteration in range(ITERATIONS):
                created = await request(client, index, "POST", SESSIONS, json={"identity": f"c{index}-{iteration}"})
                body = created.body
                if created.status == 429:
                    assert body["error"] == "queue_full", body
                    continue
                session_id = body["session_id"]
                if created.status == 200:
                    assert body["status"] == "assigned" and body["worker_id"] == worker_id, body
                    assert body["queue_position"] is None and body["token"], body
                else:
                    assert created.status == 202, (created.status, body)
                    assert body["status"] == "queued" and body["worker_id"] is None, body
                    assert 1 <= body["queue_position"] <= QUEUE, body
                position = body["queue_position"]
                for _ in range(MAX_POLLS):
                    polled = await request(client, index, "GET", f"{SESSIONS}/{session_id}")
                    assert polled.status == 200, (polled.status, polled.body)
                    view = polled.body
                    if view["status"] == "queued":
                        assert position is not None, f"{session_id} went back to the queue: {view}"
                        assert 1 <= view["queue_position"] <= position, (position, view)  # only moves forward
                        position = view["queue_position"]
                        await trio.lowlevel.checkpoint()
                        continue
                    assert view["status"] in WAITING and view["queue_position"] is None, view
                    assert view["worker_id"] == worker_id, view
                    position = None
                    break
                deleted = await request(client, index, "DELETE", f"{SESSIONS}/{session_id}")
                assert deleted.status == 200 and deleted.body == {"session_id": session_id, "status": "closed"}, (
                    deleted.status, deleted.body)

        # Every client is built before any request: building one loads the CA bundle synchronously
        # (tens of milliseconds), which would block the shared event loop while other requests run.
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        with trio.fail_after(60):
            async with contextlib.AsyncExitStack() as stack:
                pool = [await stack.enter_async_context(httpx.AsyncClient(base_url=base_url, limits=limits, timeout=10))
                        for _ in range(CLIENTS)]
                async with trio.open_nursery() as clients:
                    for index, client in enumerate(pool):
                        clients.start_soon(client_loop, index, client)

        assert not watch.problems, watch.problems[:10]
        statuses = Counter(a.status for a in answers)
        assert set(statuses) <= {200, 202, 429}, statuses
        assert statuses[429] and statuses[202], f"the load never filled the queue: {statuses}"  # the test is real
        assert watch.max_retained == CAPACITY and watch.max_queued == QUEUE, (watch.max_retained, watch.max_queued)
        assert watch.decisions["promoted"], "no queued session was ever promoted"
        creates = [a for a in answers if a.method == "POST"]
        assert len(creates) == CLIENTS * ITERATIONS
        assert Counter(a.status for a in creates) == Counter(
            {200: watch.decisions["assigned"], 202: watch.decisions["queued"], 429: watch.decisions["rejected"]})
        slowest = max(answers, key=lambda a: a.seconds)
        assert slowest.seconds < HANG_BOUND, f"slowest request {slowest}"

        # everything ended: nothing retained or queued, every slot free, every record terminal
        snapshot = runtime.book.snapshot()
        assert (snapshot.retained, snapshot.queued, snapshot.free_slots) == (0, 0, CAPACITY), snapshot
        assert not runtime.runners
        records = list(runtime.registry)
        assert len(records) == len([a for a in creates if a.status in (200, 202)])
        assert all(r.is_terminal and r.status.value == "closed" for r in records), Counter(r.status.value for r in records)
        async with httpx.AsyncClient(base_url=base_url) as client:
            health = (await client.get("/v1/stream/health")).json()
        assert (health["retained_sessions"], health["queued_sessions"], health["free_slots"]) == (0, 0, CAPACITY)

    await leaks.check()
