"""A queued session's LiveKit room is followed too: its record counts who joined it, and a token for an identity
already in it is refused (409), from the session's creation, not from its worker's join; it stays right once the
session leaves the queue and its worker is in the room, and a token asked for the moment a viewer's join returns,
before the worker's word on it came, is refused as well.

On LiveKit only a session's worker saw its room: a queued session showed ``participant_count`` 0 with its
controller and a viewer in the room, and ``POST .../tokens`` granted a second token to the viewer's identity (200),
with which LiveKit would drop the viewer from the room. Now the server looks into the rooms no worker of its own
is in yet through the RoomService. ``chunkline stream-serve`` (one slot, a queue) with in-process workers and with
an agent (``--workers local``), real SDK clients for the controllers and a viewer inside the namespace; the test
reads the sessions over HTTP, polling the count within a deadline (the room is seen over a real network).

Once a worker is in the room its word is the count, and it comes a moment after a join returns (its room events,
an agent's reports at one a session every 0.5 s): a token asked for in that moment, for the identity that just
joined, was granted (and LiveKit dropped the viewer). Now the server lists the room for each token's check.
The moment is made certain by holding the agent (SIGSTOP) while the viewer joins: it cannot report the join.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

import pytest

from server.livekit_clients import Clients as Agent

from .conftest import SESSIONS, StreamServer, counted

pytestmark = pytest.mark.livekit

SLOT_AND_QUEUE = {"max_sessions_per_worker": 1, "queue_size": 1, "controller_timeout": 30, "room_empty_timeout": 30}


async def token_status(stream: StreamServer, session_id: str, identity: str) -> int:
    async with stream.http() as http:
        return (await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})).status_code


async def a_viewer_in_the_room_holds_its_identity(stream: StreamServer, agent: Agent, session_id: str, room: str,
                                                  present: int, *, queued: bool) -> None:
    """A viewer joins (``present`` were there before): counted, and its identity gets no second token while it is
    in the room (one would drop it from the room); once it left it may come back. The server lists the room as the
    token is asked for: refused at once, not once the next look came round (queued) or the worker's word came."""
    viewer = f"viewer-of-{session_id}"
    async with stream.http() as http:
        granted = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": viewer})
    assert granted.status_code == 200, granted.text
    await agent.join(viewer, granted.json()["token"])
    assert await token_status(stream, session_id, viewer) == 409  # the viewer is in the room
    await counted(stream, session_id, present + 1)
    assert await token_status(stream, session_id, viewer) == 409
    assert viewer in await agent.room_participants(room)  # ... and stays there
    await agent.request("leave", client=viewer)
    await counted(stream, session_id, present)
    assert await token_status(stream, session_id, viewer) == 200  # gone: it may come back


async def a_queued_sessions_room_is_followed(stream: StreamServer, agent: Agent, first: str, second: str) -> None:
    async with stream.http() as http:
        running = (await http.post(SESSIONS, json={"identity": first})).json()
        await agent.join(first, running["token"])
        await agent.wait_message(first, "status", stage="running")
        response = await http.post(SESSIONS, json={"identity": second})
    assert response.status_code == 202 and response.json()["status"] == "queued", response.text
    queued = response.json()
    session_id, room = queued["session_id"], queued["room"]
    await agent.join(second, queued["token"])  # no worker is in a queued session's room
    await counted(stream, session_id, 1)
    await a_viewer_in_the_room_holds_its_identity(stream, agent, session_id, room, present=1, queued=True)

    await agent.request("publish", client=first, topic="tf.control", payload=json.dumps({"type": "stop"}))
    await agent.wait_message(second, "status", stage="running")  # promoted: its controller was there already
    record = await counted(stream, session_id, 1)  # the worker is not counted
    assert record["status"] == "running", record
    await a_viewer_in_the_room_holds_its_identity(stream, agent, session_id, room, present=1, queued=False)
    await agent.request("publish", client=second, topic="tf.control", payload=json.dumps({"type": "stop"}))
    await agent.wait_message(second, "done")
    ended = await counted(stream, session_id, 0)
    assert ended["status"] == "closed", ended


async def test_a_queued_livekit_sessions_room_is_counted_and_its_viewer_gets_no_second_token(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    await a_queued_sessions_room_is_followed(stream_servers(**SLOT_AND_QUEUE), agent, "alice", "bob")


async def test_an_agent_hosted_queued_livekit_sessions_room_is_followed_too(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    stream = stream_servers(workers="local", num_workers=1, cluster_port=0, **SLOT_AND_QUEUE)
    await a_queued_sessions_room_is_followed(stream, agent, "carol", "dave")


async def test_a_token_asked_for_as_a_viewer_joins_a_running_session_is_refused_before_the_worker_says_so(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    """The agent hosting a running session is held (SIGSTOP) while a viewer joins its room, so its word on the join
    cannot come: the record still counts the controller only. A token asked for the viewer's identity then is
    refused all the same (a list of the room made for the request sees the viewer; a second token would drop it),
    and the count stays the agent's word until the agent, let go, reports the viewer."""
    stream = stream_servers(workers="local", num_workers=1, cluster_port=0, heartbeat_deadline=60, **SLOT_AND_QUEUE)
    async with stream.http() as http:
        created = (await http.post(SESSIONS, json={"identity": "erin"})).json()
        session_id, room = created["session_id"], created["room"]
        await agent.join("erin", created["token"])
        await agent.wait_message("erin", "status", stage="running")
        record = await counted(stream, session_id, 1)
        workers = (await http.get("/v1/stream/health")).json()["workers"]
        (pid,) = [w["pid"] for w in workers if w["worker_id"] == record["worker_id"]]
        granted = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": "frank"})
        assert granted.status_code == 200, granted.text
        os.kill(pid, signal.SIGSTOP)  # within the heartbeat deadline: the agent is not given up
        try:
            await agent.join("frank", granted.json()["token"])
            again = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": "frank"})
            held = (await http.get(f"{SESSIONS}/{session_id}")).json()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert held["participant_count"] == 1, held  # the agent's word on the viewer had not come
        assert again.status_code == 409, again.text
    await counted(stream, session_id, 2)  # the agent, let go, reports the viewer
    assert "frank" in await agent.room_participants(room)  # ... still in the room: no second token dropped it
