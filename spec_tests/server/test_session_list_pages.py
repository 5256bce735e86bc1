"""``GET /v1/stream/sessions`` a page at a time: every session once, in creation order, at a cost of the page.

The list was one pass making every session's view (70 ms of the event loop with 10,000 queued); now it gives
``limit`` sessions (100 unless asked) oldest first and ``next``, the cursor of the page after, while more follow.
"""

from __future__ import annotations

from typing import Any

import pytest

from .runner_fixtures import Served
from .runner_fixtures import no_threads  # noqa: F401  (fixture)
from .test_queue_scale import Visits, queued_behind_one, visits  # noqa: F401  (fixture)

SESSIONS = "/v1/stream/sessions"


async def walk(s: Served, query: str = "", after: str | None = None) -> list[list[dict[str, Any]]]:
    """Every page of the list (from the cursor ``after``, if given), following ``next`` to the end."""
    pages: list[list[dict[str, Any]]] = []
    while True:
        params = query + ("" if after is None else f"&after={after}")
        status, body = await s.json("get", f"{SESSIONS}?{params.lstrip('&')}")
        assert status == 200, body
        pages.append(body["sessions"])
        after = body["next"]
        if after is None:
            return pages


@pytest.mark.usefixtures("no_threads")
async def test_pages_give_every_session_once_in_creation_order(autojump_clock: Any) -> None:
    async with queued_behind_one(249) as (s, live, ids):
        status, first = await s.json("get", SESSIONS)
        assert status == 200 and len(first["sessions"]) == 100 and first["next"] is not None
        pages = await walk(s, "limit=40")
        assert [len(page) for page in pages] == [40] * 6 + [10]
        listed = [view["session_id"] for page in pages for view in page]
        assert listed == [live["session_id"], *ids]
        places = [view["queue_position"] for page in pages for view in page]
        assert places == [None, *range(1, 250)]
        status, whole = await s.json("get", f"{SESSIONS}?limit=1000")
        assert status == 200 and whole["next"] is None and len(whole["sessions"]) == 250


@pytest.mark.usefixtures("no_threads")
async def test_a_session_that_ends_or_comes_between_two_pages_moves_no_other(autojump_clock: Any) -> None:
    """The cursor is a place in creation order, not an index: a page after a delete skips nothing."""
    async with queued_behind_one(30) as (s, live, ids):
        status, first = await s.json("get", f"{SESSIONS}?limit=10")
        assert [v["session_id"] for v in first["sessions"]] == [live["session_id"], *ids[:9]]
        for gone in (ids[3], ids[12]):  # one on the page read, one on the next
            status, _ = await s.json("delete", f"{SESSIONS}/{gone}")
            assert status == 200
        s.runtime.registry.remove(ids[3])  # pruned, as a terminal record is once its retention passes
        late = await s.create("late")
        rest = [v["session_id"] for page in await walk(s, "limit=10", first["next"]) for v in page]
        assert rest == [*ids[9:], late["session_id"]]  # ids[12] ended but is still kept (closed): listed


@pytest.mark.usefixtures("no_threads")
async def test_a_status_and_pages_go_together(autojump_clock: Any) -> None:
    async with queued_behind_one(25) as (s, _, ids):
        pages = await walk(s, "status=queued&limit=10")
        assert [len(page) for page in pages] == [10, 10, 5]
        assert [v["session_id"] for page in pages for v in page] == ids


@pytest.mark.usefixtures("no_threads")
async def test_a_page_costs_its_own_length_not_the_lists(visits: Visits, autojump_clock: Any) -> None:
    """Each page made every session's view: a page of 10 visited 10 records with 10 queued and 1,000 with 1,000."""
    work = []
    for queued in (20, 1_000):
        async with queued_behind_one(queued) as (s, _, _ids):
            visits.reset()
            status, body = await s.json("get", f"{SESSIONS}?limit=10")
            assert status == 200 and len(body["sessions"]) == 10
            work.append(visits.total)
    assert work[0] == work[1], work


@pytest.mark.parametrize(("query", "named"), [
    ("limit=0", "limit must be an integer in 1..1000, got '0'"),
    ("limit=1001", "limit must be an integer in 1..1000, got '1001'"),
    ("limit=ten", "limit must be an integer in 1..1000, got 'ten'"),
    ("limit=%2B5", "limit must be an integer in 1..1000, got '+5'"),
    ("limit=5_0", "limit must be an integer in 1..1000, got '5_0'"),
    ("limit=1&limit=2", "limit is given 2 times"),
    ("after=-1", "after must be a cursor (the 'next' of the page before), got '-1'"),
    ("after=12", "after must be a cursor (the 'next' of the page before), got '12'"),
    ("after=" + "9" * 70, "after must be a cursor (the 'next' of the page before)"),
    ("after=0123abcd-1", "after is a cursor of another server run (they end with it)"),
    ("page=2", "unknown query parameter(s) 'page'; allowed"),
])
@pytest.mark.usefixtures("no_threads")
async def test_a_bad_page_query_is_a_400_naming_it(query: str, named: str, autojump_clock: Any) -> None:
    async with queued_behind_one(2) as (s, _, _ids):
        status, body = await s.json("get", f"{SESSIONS}?{query}")
        assert status == 400 and body["error"] == "invalid_query" and named in body["detail"], body


@pytest.mark.usefixtures("no_threads")
async def test_a_cursor_no_page_gave_is_refused_not_taken_as_a_place(autojump_clock: Any) -> None:
    """A cursor was a bare creation number: one past the last session listed an empty page as if it were the end,
    and one kept across a restart skipped as many of the new run's sessions."""
    async with queued_behind_one(5) as (s, _, _ids):
        status, first = await s.json("get", f"{SESSIONS}?limit=2")
        run, _, serial = first["next"].partition("-")
        status, body = await s.json("get", f"{SESSIONS}?after={run}-{int(serial) + 100}")
        assert status == 400 and "names no session of this run" in body["detail"], body
        for written in (f"{run}-0{serial}", f"{run}-0"):  # not as a page writes a cursor
            status, body = await s.json("get", f"{SESSIONS}?after={written}")
            assert status == 400 and "after must be a cursor" in body["detail"], body
        async with queued_behind_one(5) as (other, _, _):  # another server run: its cursors are its own
            status, body = await other.json("get", f"{SESSIONS}?after={first['next']}")
            assert status == 400 and "another server run" in body["detail"], body
