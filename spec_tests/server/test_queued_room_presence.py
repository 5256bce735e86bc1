"""A queued session's room is followed too: its record counts who joined it, and a token for an identity already
in it is refused (409), from the session's creation, not from its worker's start.

A queued session's local room takes joins (the controller's controls are held for its worker), but only the
session's runner counted who was there: a queued session showed ``participant_count`` 0 with its controller and a
viewer in the room, and ``POST .../tokens`` granted a second token to the viewer's identity (200, where the API
promises 409), which the room then refused at the door. Through the app's HTTP routes and room sockets
(in-process, trio's autojump clock): one slot, a running session, a second one queued behind it; the queued
room's count follows each join and leave; once the first ends and the second is promoted, the count stays right;
once it ends, the runtime follows no room.
"""

from __future__ import annotations

from typing import Any

import pytest
from trio.testing import wait_all_tasks_blocked

from .runner_fixtures import CounterService, Peer, Served, join, serve, settings
from .runner_fixtures import no_threads  # noqa: F401  (fixture)


async def joined(peer: Peer) -> None:
    """The room counts a join before it tells the one joining: once told, the API sees it."""
    await peer.wait_for(lambda p: any(m.get("type") == "joined" for m in p.texts()), "the join")


async def counted(served: Served, session_id: str) -> int:
    count = (await served.get(session_id))["participant_count"]
    status, listed = await served.json("get", "/v1/stream/sessions")
    assert status == 200
    assert next(s for s in listed["sessions"] if s["session_id"] == session_id)["participant_count"] == count
    return count


async def token_status(served: Served, session_id: str, identity: str) -> int:
    status, _ = await served.json("post", f"/v1/stream/sessions/{session_id}/tokens", json={"identity": identity})
    return status


@pytest.mark.usefixtures("no_threads")
async def test_a_queued_sessions_room_is_counted_and_a_viewer_in_it_gets_no_second_token(autojump_clock: Any) -> None:
    service = CounterService(fps=4, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_sessions_per_worker=1, queue_size=3), service) as served:
        first = await served.create("alice")
        queued = await served.create("bob")
        session_id, room = queued["session_id"], queued["room"]
        assert (await served.get(session_id))["status"] == "queued"
        async with join(served, room, queued["token"]) as bob:
            await joined(bob)
            assert await counted(served, session_id) == 1
            token = await served.viewer_token(session_id, "v")
            async with join(served, room, token) as viewer:
                await joined(viewer)
                assert await counted(served, session_id) == 2
                assert await token_status(served, session_id, "v") == 409  # "v" is in the room
            await wait_all_tasks_blocked()
            assert await counted(served, session_id) == 1
            assert await token_status(served, session_id, "v") == 200  # gone: it may come back

            status, _ = await served.json("delete", f"/v1/stream/sessions/{first['session_id']}")
            assert status in (200, 202)
            await bob.wait_for(lambda p: "running" in p.stages(), "the promoted session to run")
            assert await counted(served, session_id) == 1  # the worker is not counted
            async with join(served, room, await served.viewer_token(session_id, "v")) as viewer:
                await joined(viewer)
                assert await counted(served, session_id) == 2
                assert await token_status(served, session_id, "v") == 409
            await wait_all_tasks_blocked()
            assert await counted(served, session_id) == 1
            status, _ = await served.json("delete", f"/v1/stream/sessions/{session_id}")
            assert status in (200, 202)
            await wait_all_tasks_blocked()
        ended = await served.get(session_id)
        assert ended["status"] == "closed" and ended["participant_count"] == 0, ended
        assert served.runtime.room_follow.followed == set()  # no room is followed past its session


@pytest.mark.usefixtures("no_threads")
async def test_a_session_that_ends_queued_leaves_no_room_followed(autojump_clock: Any) -> None:
    service = CounterService(fps=4, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_sessions_per_worker=1, queue_size=3), service) as served:
        await served.create("alice")
        queued = await served.create("bob")
        async with join(served, queued["room"], queued["token"]) as bob:
            await joined(bob)
            assert await counted(served, queued["session_id"]) == 1
            status, _ = await served.json("delete", f"/v1/stream/sessions/{queued['session_id']}")
            assert status in (200, 202)
            await wait_all_tasks_blocked()
            ended = await served.get(queued["session_id"])
            assert ended["status"] == "closed" and ended["participant_count"] == 0, ended
        assert queued["session_id"] not in served.runtime.room_follow.followed
