"""Viewer tokens for a session that is ending: a draining session, or any session while the server shuts down,
takes no new viewers (a token was handed out, for a room about to close). The service's close outlasts the wait
of a DELETE (virtual time, autojump), so the drain is seen while it lasts."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from server.runner import CLOSE_PIPELINE_TIMEOUT
from server.runtime import DELETE_WAIT

from .runner_fixtures import CounterService, Served, join, no_threads, serve, settings  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("no_threads")

SESSIONS = "/v1/stream/sessions"
CLOSE_DELAY = DELETE_WAIT + 5  # a DELETE answers "draining" before the close ends, and the close ends in time
assert CLOSE_DELAY < CLOSE_PIPELINE_TIMEOUT


async def ask_for_a_viewer_token(s: Served, session_id: str) -> tuple[int, Any]:
    return await s.json("post", f"{SESSIONS}/{session_id}/tokens", json={"identity": "late-viewer"})


async def test_a_draining_session_hands_out_no_viewer_token(autojump_clock: Any) -> None:
    async with serve(settings(), CounterService(close_delay=CLOSE_DELAY)) as s:
        created = await s.create("ctl")
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            status, body = await s.json("delete", f"{SESSIONS}/{created['session_id']}")
            assert status == 200 and body["status"] == "draining"
            status, body = await ask_for_a_viewer_token(s, created["session_id"])
        assert status == 409, body
        assert body["error"] == "conflict"
        assert body["detail"] == f"session {created['session_id']} is draining: it takes no new viewers"


async def test_no_viewer_token_is_handed_out_while_the_server_shuts_down(autojump_clock: Any) -> None:
    async with serve(settings(), CounterService(close_delay=CLOSE_DELAY)) as s:
        created = await s.create("ctl")
        session_id = created["session_id"]
        async with join(s, created["room"], created["token"]) as ctl:
            await ctl.wait_for(lambda p: p.status("chunk"), "a chunk")
            status, before = await ask_for_a_viewer_token(s, session_id)
            assert status == 200, before  # running: a viewer is welcome
            async with trio.open_nursery() as nursery:
                nursery.start_soon(s.runtime.shutdown, 30.0)
                await trio.testing.wait_all_tasks_blocked()
                assert (await s.get(session_id))["status"] == "draining"
                status, body = await ask_for_a_viewer_token(s, session_id)
        assert status == 409, body
        assert body["detail"] == f"session {session_id} takes no new viewers: the server is shutting down"
