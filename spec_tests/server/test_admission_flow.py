"""Admission through the HTTP API: slots, the FIFO queue, promotion on release, rejection, failed workers."""

from __future__ import annotations

import pytest

from .conftest import assert_error_body, failing_loader, make_settings, serve, wait_worker_failed

SESSIONS = "/v1/stream/sessions"
LIVE = {"assigned", "joining_room", "starting_pipeline", "running"}


async def status_of(s, session_id: str) -> dict:
    status, body, _ = await s.json("get", f"{SESSIONS}/{session_id}")
    assert status == 200, body
    return body


async def test_two_slots_two_queue_places_then_queue_full(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=2, queue_size=2), workers=worker_kind) as s:
        results = [await s.create(f"user-{i}") for i in range(5)]
        codes = [r[0] for r in results]
        assert codes == [200, 200, 202, 202, 429], [r[1] for r in results]
        assert [r[1]["status"] for r in results[:4]] == ["assigned", "assigned", "queued", "queued"]
        assert [r[1]["queue_position"] for r in results[:4]] == [None, None, 1, 2]
        assert_error_body(429, results[4][1], "queue_full")
        assert results[4][2].headers["Retry-After"]
        await s.settle()
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert (health["retained_sessions"], health["queued_sessions"], health["free_slots"]) == (2, 2, 0)
        # the runners of the assigned sessions started; the queued ones have none
        assert set(s.runtime.runners) == {results[0][1]["session_id"], results[1][1]["session_id"]}
        listed = (await s.json("get", f"{SESSIONS}?status=queued"))[1]["sessions"]
        assert [(r["session_id"], r["queue_position"]) for r in listed] == [
            (results[2][1]["session_id"], 1), (results[3][1]["session_id"], 2)]


async def test_deleting_the_first_queued_session_renumbers_the_rest(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=2, queue_size=2), workers=worker_kind) as s:
        ids = [(await s.create(f"user-{i}"))[1]["session_id"] for i in range(4)]
        status, body, _ = await s.json("delete", f"{SESSIONS}/{ids[2]}")
        assert (status, body["status"]) == (200, "closed")
        gone = await status_of(s, ids[2])
        assert gone["queue_position"] is None
        assert (gone["drain_cause"], gone["error"]) == ("deleted", None)  # as a deleted live session reads (was null)
        second = await status_of(s, ids[3])
        assert (second["status"], second["queue_position"]) == ("queued", 1)
        # the freed queue place is usable again, behind the remaining one
        status, body, _ = await s.create("user-4")
        assert (status, body["queue_position"]) == (202, 2)
        # the assigned sessions are untouched
        assert {(await status_of(s, i))["status"] for i in ids[:2]} <= LIVE


async def test_deleting_an_assigned_session_admits_the_queue_head(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=2, queue_size=2), workers=worker_kind) as s:
        created = [await s.create(f"user-{i}") for i in range(4)]
        assert [c[0] for c in created] == [200, 200, 202, 202]
        ids = [c[1]["session_id"] for c in created]
        await s.settle()
        status, body, _ = await s.json("delete", f"{SESSIONS}/{ids[0]}")
        assert (status, body["status"]) == (200, "closed")
        await s.settle()
        head = await status_of(s, ids[2])
        assert head["status"] in LIVE and head["worker_id"] == s.worker_id and head["queue_position"] is None
        assert ids[2] in s.runtime.runners  # a runner started for the promoted session
        tail = await status_of(s, ids[3])
        assert (tail["status"], tail["queue_position"]) == ("queued", 1)
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert (health["retained_sessions"], health["queued_sessions"]) == (2, 1)
        # one queue place is free again
        assert (await s.create("user-5"))[0] == 202
        assert (await s.create("user-6"))[0] == 429


async def test_queue_size_zero_rejects_with_no_capacity(worker_kind):
    async with serve(make_settings(max_sessions_per_worker=2, queue_size=0), workers=worker_kind) as s:
        assert [(await s.create(f"u{i}"))[0] for i in range(2)] == [200, 200]
        status, body, response = await s.create("u2")
        assert status == 429
        assert_error_body(status, body, "no_capacity")
        assert int(response.headers["Retry-After"]) > 0
        # a release makes room again
        first = next(iter(s.runtime.runners))
        await s.json("delete", f"{SESSIONS}/{first}")
        await s.settle()
        assert (await s.create("u3"))[0] == 200


@pytest.mark.parametrize("queue_size", [0, 2])
@pytest.mark.in_process_only(reason="the failure comes from an in-process loader object (failing_loader); an agent whose "
                              "pipeline fails to load exits, and its launcher replaces it (spec_tests/cluster)")
async def test_a_failed_worker_takes_nothing(queue_size, worker_kind):
    """No admission without a place to run: with no worker running or starting, a create is
    refused at once (503, the reason, Retry-After), never queued to wait for nothing."""
    async with serve(make_settings(queue_size=queue_size), loader=failing_loader, ready=False) as s:
        await wait_worker_failed(s.runtime)
        status, body, _ = await s.json("get", "/v1/service/health")
        assert status == 200
        assert body["status"] == "unhealthy" and body["workers_failed"] == 1 and body["ready"] is False
        status, body, _ = await s.json("get", "/v1/service/ready")
        assert status == 503 and body["ready"] is False
        metadata = (await s.json("get", "/v1/service/metadata"))[1]
        assert "the model file is missing" in metadata["worker_failures"]["worker-0"]
        status, body, response = await s.create("u0")
        assert status == 503, body
        assert_error_body(status, body, "no_worker")
        assert "the model file is missing" in body["detail"]
        assert int(response.headers["Retry-After"]) > 0
        assert not s.runtime.runners and not list(s.runtime.registry)
        assert s.runtime.book.snapshot().queued == 0
