"""Time in the runtime: session_timeout (the background sweep) and the pruning of terminal records.

The trio clock is a MockClock that only moves when a test jumps it; ``settle()``
then lets the sweep and the runners react. Nothing here sleeps.
"""

from __future__ import annotations

from .conftest import make_settings, serve

SESSIONS = "/v1/stream/sessions"
LIVE = {"assigned", "joining_room", "starting_pipeline", "running"}
SWEEP = 1.0  # server.runtime.SWEEP_PERIOD


async def jump(s, mock_clock, seconds: float) -> None:
    mock_clock.jump(seconds)
    await s.settle()


async def get(s, session_id: str) -> tuple[int, dict]:
    status, body, _ = await s.json("get", f"{SESSIONS}/{session_id}")
    return status, body


async def test_session_timeout_expires_queued_and_live_sessions(mock_clock):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=2, session_timeout=10)) as s:
        _, live, _ = await s.create("a")
        _, queued, _ = await s.create("b")
        await s.settle()
        assert (await get(s, live["session_id"]))[1]["status"] in LIVE
        assert (await get(s, queued["session_id"]))[1]["status"] == "queued"
        await jump(s, mock_clock, 9.5)
        assert (await get(s, live["session_id"]))[1]["status"] in LIVE  # not yet
        await jump(s, mock_clock, 1.0 + SWEEP)
        live_now = (await get(s, live["session_id"]))[1]
        queued_now = (await get(s, queued["session_id"]))[1]
        assert queued_now["status"] == "expired" and queued_now["queue_position"] is None
        assert live_now["status"] == "expired"
        assert queued_now["drain_cause"] == live_now["drain_cause"] == "expired"  # the queued one read null
        assert not s.runtime.runners
        health = (await s.json("get", "/v1/stream/health"))[1]
        assert (health["retained_sessions"], health["queued_sessions"], health["free_slots"]) == (0, 0, 1)
        # the slot and the queue are free again
        assert (await s.create("c"))[0] == 200
        assert (await s.create("d"))[0] == 202


async def test_expiry_of_a_live_session_admits_the_next_queued(mock_clock):
    async with serve(make_settings(max_sessions_per_worker=1, queue_size=2, session_timeout=10)) as s:
        _, first, _ = await s.create("a")
        await jump(s, mock_clock, 5)
        _, second, _ = await s.create("b")
        assert second["status"] == "queued"
        await jump(s, mock_clock, 5 + SWEEP)  # first is past its deadline, second is not
        assert (await get(s, first["session_id"]))[1]["status"] == "expired"
        promoted = (await get(s, second["session_id"]))[1]
        assert promoted["status"] in LIVE and promoted["queue_position"] is None
        assert set(s.runtime.runners) == {second["session_id"]}
        await jump(s, mock_clock, 5 + SWEEP)
        assert (await get(s, second["session_id"]))[1]["status"] == "expired"
        assert not s.runtime.runners


async def test_terminal_records_are_pruned_after_retention_seconds(mock_clock):
    settings = make_settings(terminal_retention_seconds=30, terminal_retention_count=100)
    async with serve(settings) as s:
        _, old, _ = await s.create("a")
        await s.json("delete", f"{SESSIONS}/{old['session_id']}")
        await jump(s, mock_clock, 20)
        _, new, _ = await s.create("b")
        await s.json("delete", f"{SESSIONS}/{new['session_id']}")
        _, live, _ = await s.create("c")
        await jump(s, mock_clock, 10 + SWEEP)
        assert (await get(s, old["session_id"]))[0] == 404
        status, body = await get(s, new["session_id"])
        assert (status, body["status"]) == (200, "closed")
        assert (await s.json("delete", f"{SESSIONS}/{old['session_id']}"))[0] == 404
        await jump(s, mock_clock, 20 + SWEEP)
        assert (await get(s, new["session_id"]))[0] == 404
        # live sessions are never pruned, whatever their age
        assert (await get(s, live["session_id"]))[1]["status"] in LIVE
        listed = (await s.json("get", SESSIONS))[1]["sessions"]
        assert [r["session_id"] for r in listed] == [live["session_id"]]


async def test_terminal_records_beyond_retention_count_are_pruned_oldest_first_as_they_end(mock_clock):
    """At once, not at the next sweep: a burst of ends listed them all (30 with a count of 5) until the sweep."""
    settings = make_settings(terminal_retention_count=2, max_sessions_per_worker=4)
    async with serve(settings) as s:
        ids = []
        for i in range(4):
            _, created, _ = await s.create(f"u{i}")
            await s.json("delete", f"{SESSIONS}/{created['session_id']}")
            ids.append(created["session_id"])
            listed = (await s.json("get", SESSIONS))[1]["sessions"]
            assert [r["session_id"] for r in listed] == ids[-2:]  # no sweep has run: the clock has not moved
        _, live, _ = await s.create("live")
        assert [(await get(s, i))[0] for i in ids] == [404, 404, 200, 200]
        assert (await get(s, live["session_id"]))[0] == 200
        await jump(s, mock_clock, SWEEP)  # the sweep finds nothing more to prune
        assert [(await get(s, i))[0] for i in ids] == [404, 404, 200, 200]


async def test_retention_count_zero_forgets_terminal_records_as_they_end(mock_clock):
    async with serve(make_settings(terminal_retention_count=0)) as s:
        _, created, _ = await s.create("a")
        status, body, _ = await s.json("delete", f"{SESSIONS}/{created['session_id']}")
        assert (status, body["status"]) == (200, "closed")  # the answer still carries the record
        assert (await get(s, created["session_id"]))[0] == 404
