"""POST /v1/service/workers/{id}/drain on an in-process worker (the agents' drain has its own tests).

A drain takes the worker out of admission at once, lets its live sessions run until the deadline, then
drains them at a chunk boundary (they end as completed work, not failures) and stops the worker.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from trio.testing import wait_all_tasks_blocked

from .conftest import GatedLoader, make_settings, serve, wait_until
from .runner_fixtures import CounterService, join
from .runner_fixtures import no_threads  # noqa: F401  (fixture)
from .runner_fixtures import serve as counter_serve
from .runner_fixtures import settings as counter_settings

DRAIN = "/v1/service/workers/{}/drain"


async def test_a_drained_worker_takes_no_new_session_and_its_live_one_ends_closed_at_the_deadline(
    caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "chunkline")
    async with serve(make_settings(max_sessions_per_worker=2, queue_size=2)) as s:
        status, created, _ = await s.create("a")
        assert status == 200, created
        status, body, _ = await s.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 0.2})
        assert status == 202, body
        assert body == {"worker_id": "worker-0", "state": "draining", "deadline_seconds": 0.2}
        # the log says so: capacity went, health turned degraded, and no line said why
        assert "worker worker-0 drains, as asked through the API: its live sessions end within 0.2 s; it is not " \
               "restarted" in caplog.messages

        status, refused, _ = await s.create("b")  # the only worker is draining: no place to run
        assert status in (429, 503), refused
        assert s.runtime.get(created["session_id"]).status.value != "closed"  # live until the deadline

        await wait_until(lambda: s.runtime.get(created["session_id"]).is_terminal, "the drained session to end")
        record = s.runtime.get(created["session_id"])
        assert (record.status.value, record.error) == ("closed", None)
        await wait_until(lambda: s.runtime.book.worker_state("worker-0").value == "stopped", "the worker to stop")
        status, health, _ = await s.json("get", "/v1/stream/health")
        assert health["worker_slots"]["worker-0"] == {  # the slot says what happened, not "running"
            "worker_id": "worker-0", "restarts": 0, "state": "stopped",
            "reason": "stopped on purpose (drained, or the server is stopping); not restarted", "replaced": None}, health

        # nothing left to drain: a conflict that says so (it was a 202 echoing a deadline that nothing applied, and
        # an agent that had drained but not yet left was sent a drain again each time)
        status, again, _ = await s.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 0.2})
        assert (status, again["error"]) == (409, "conflict"), again
        assert again["detail"] == "worker worker-0 has stopped: there is nothing left to drain", again
        assert s.runtime.book.worker_state("worker-0").value == "stopped"


async def test_draining_a_worker_that_is_still_loading_is_a_conflict_and_unknown_is_404():
    loader = GatedLoader()
    async with serve(make_settings(), loader=loader, ready=False) as s:
        try:
            status, body, _ = await s.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 1})
            assert (status, body["error"]) == (409, "conflict") and "still starting" in body["detail"], body
            assert s.runtime.book.worker_state("worker-0").value == "starting"
            status, body, _ = await s.json("post", DRAIN.format("nobody"), json={"deadline_seconds": 1})
            assert status == 404, body
        finally:
            loader.release()


async def test_a_drain_body_with_an_unknown_field_is_refused_and_drains_nothing():
    async with serve(make_settings()) as s:
        for body, code in [({"deadline": 5}, "unknown_field"), ({"deadline_seconds": 1, "x": 2}, "unknown_field"),
                           ([], "invalid_body"), ({"deadline_seconds": 0}, "invalid_field")]:
            status, refused, _ = await s.json("post", DRAIN.format("worker-0"), json=body)
            assert (status, refused["error"]) == (400, code), (body, refused)
        assert s.runtime.book.worker_state("worker-0").value == "idle"



@pytest.mark.usefixtures("no_threads")
async def test_draining_the_last_worker_fails_the_queued_sessions_with_the_reason(autojump_clock: Any) -> None:
    """Once the last worker drains, nothing will ever run the queue (a create is a 503 with no Retry-After): the
    queued sessions fail as ``worker_drain`` naming why, and their rooms hear it. They stayed queued, their clients
    waiting, until each one's own session timeout. While another worker serves, they wait for it."""
    async with counter_serve(counter_settings(num_workers=2, max_sessions_per_worker=1, queue_size=2),
                             CounterService()) as served:
        await served.create("a")
        await served.create("b")
        queued = [await served.create(name) for name in ("c", "d")]
        assert [body["status"] for body in queued] == ["queued", "queued"], queued
        async with join(served, queued[0]["room"], queued[0]["token"]) as waiting:
            status, body = await served.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 600})
            assert status == 202, body
            await wait_all_tasks_blocked()
            assert [(await served.get(body["session_id"]))["status"] for body in queued] == ["queued", "queued"]
            status, body = await served.json("post", DRAIN.format("worker-1"), json={"deadline_seconds": 600})
            assert status == 202, body
            error = await waiting.wait_for(lambda p: next(iter(p.status("error")), None), "the queued room's error")
        why = "no worker can take the session: worker worker-1 was drained and no other worker runs or starts"
        assert (error["reason"], error["detail"]) == ("worker_drain", why), error
        for body in queued:
            record = await served.get(body["session_id"])
            assert (record["status"], record["drain_cause"], record["error"]) == ("failed", "worker_drain", why), record
        status, refused = await served.json("post", "/v1/stream/sessions", json={"identity": "e"})
        assert (status, refused["error"]) == (503, "no_worker"), refused


def worker_gauges(text: str) -> dict[str, float]:
    """``chunkline_workers{state=...}`` from the Prometheus text, by state."""
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith('chunkline_workers{state="')}


@pytest.mark.usefixtures("no_threads")
async def test_the_worker_gauge_counts_a_draining_and_a_stopped_worker_as_health_does(autojump_clock: Any) -> None:
    """``chunkline_workers{state}`` has every state health counts, so its sum is health's ``workers_total``: it had
    idle, busy, failed and starting only, and a drained worker read as no worker at all."""
    async with counter_serve(counter_settings(max_sessions_per_worker=1), CounterService()) as served:
        created = await served.create("a")
        status, body = await served.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 600})
        assert status == 202, body
        gauges = worker_gauges(await served.metrics_text())
        assert (gauges.get("draining"), sum(gauges.values())) == (1, 1), gauges
        status, body = await served.json("delete", f"/v1/stream/sessions/{created['session_id']}")
        assert status == 200, body
        await wait_until(lambda: served.runtime.book.worker_state("worker-0").value == "stopped", "the worker to stop")
        gauges = worker_gauges(await served.metrics_text())
        status, health = await served.json("get", "/v1/stream/health")
        assert (gauges.get("stopped"), sum(gauges.values())) == (1, health["workers_total"]), (gauges, health)


async def test_draining_a_worker_already_draining_is_a_conflict_and_keeps_the_first_deadline():
    """A second drain changes nothing: the drain under way keeps its deadline (an agent's, too, ignores another). It
    was a 202 echoing the second deadline as if in force: 2 s answered, the session still ran to the first's 60 s."""
    async with serve(make_settings(max_sessions_per_worker=2)) as s:
        status, created, _ = await s.create("a")
        assert status == 200, created
        status, body, _ = await s.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 60})
        assert (status, body["deadline_seconds"]) == (202, 60), body
        status, body, _ = await s.json("post", DRAIN.format("worker-0"), json={"deadline_seconds": 0.1})
        assert (status, body["error"]) == (409, "conflict"), body
        assert body["detail"] == ("worker worker-0 is already draining: the drain under way keeps its deadline "
                                  "(a second drain changes nothing)"), body
        await wait_all_tasks_blocked()
        assert not s.runtime.get(created["session_id"]).is_terminal  # the first drain's 60 s still run
