"""The 32 viewer seats hold on LiveKit too: a viewer that joins a session's room over its seats is removed by the
server, the newest joiner, never the controller (``server/viewer_seats.py``).

On LiveKit, LiveKit is the door: a viewer that left and came back with its still-valid token (tokens live
``--token-ttl``, an hour by default) was let in with 32 other viewers in the room, and nothing sent it away, so a
room could hold many more than 32 viewers (tokens handed out while seats were free, then all used at once). Now the
session's worker asks at each join whether the joiner holds a seat and, if not, removes it through LiveKit's
RoomService. A viewer the worker saw join spends its token's seat at once, too: its token held the seat until it
expired (an hour) when the viewer left before the next token request, and a new viewer was refused ``viewer_limit``
with a seat free. ``chunkline stream-serve`` with in-process workers, a real LiveKit server, real SDK clients inside the
namespace for the controller and 33 viewers (cheap ones: no subscription); the test reads the session over HTTP and
the room through the RoomService, each wait bounded by a deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from server.livekit_clients import Clients as Agent
from server.viewer_seats import MAX_VIEWERS_PER_SESSION

from .conftest import SESSIONS, StreamServer, counted

pytestmark = pytest.mark.livekit

REMOVAL_DEADLINE = 20.0  # wall seconds for the server to send the viewer over the seats away (a hang bound)


async def viewer_token(stream: StreamServer, session_id: str, identity: str) -> str:
    async with stream.http() as http:
        granted = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})
    assert granted.status_code == 200, granted.text
    return granted.json()["token"]


def removed(agent: Agent, client: str) -> bool:
    return any(e["event"] == "disconnected" and e["client"] == client for e in agent.events)


async def test_a_viewer_coming_back_over_the_seats_is_removed_from_the_livekit_room(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    stream = stream_servers(controller_timeout=60, room_empty_timeout=60)
    async with stream.http() as http:
        created = (await http.post(SESSIONS, json={"identity": "ctl"})).json()
    session_id, room = created["session_id"], created["room"]
    assert created["transport"] == "livekit", created
    await agent.join("ctl", created["token"], auto_subscribe=False)
    await agent.wait_message("ctl", "status", stage="running")
    seated = [f"seated-{index}" for index in range(MAX_VIEWERS_PER_SESSION)]
    tokens = {identity: await viewer_token(stream, session_id, identity) for identity in seated}
    for identity in seated:
        await agent.join(identity, tokens[identity], auto_subscribe=False, decode="none")
    await counted(stream, session_id, 1 + MAX_VIEWERS_PER_SESSION)

    returner = seated[0]
    await agent.request("leave", client=returner)
    await counted(stream, session_id, MAX_VIEWERS_PER_SESSION)
    late = await viewer_token(stream, session_id, "late")  # the seat it left is free (its token's was spent as it joined)
    await agent.join("late", late, auto_subscribe=False, decode="none")
    await counted(stream, session_id, 1 + MAX_VIEWERS_PER_SESSION)

    # the returner's token is still valid, and LiveKit lets it in: the room is over its seats
    await agent.join(returner, tokens[returner], auto_subscribe=False, decode="none")
    await agent.wait_for(lambda: removed(agent, returner), f"{returner} to be removed", REMOVAL_DEADLINE)
    with trio.move_on_after(REMOVAL_DEADLINE):
        while returner in (present := await agent.room_participants(room)):
            await trio.sleep(0.1)  # bench-cost: LiveKit lists the room as it saw the removal, over the network
    clients = sorted(identity for identity in present if not identity.startswith("chunkline-"))  # not the worker
    assert clients == sorted(["ctl", "late", *seated[1:]]), present
    record = await counted(stream, session_id, 1 + MAX_VIEWERS_PER_SESSION)  # back to the controller and 32
    assert record["status"] == "running", record
    assert f"session {session_id}: viewer '{returner}' joined over the {MAX_VIEWERS_PER_SESSION} viewer seats" in \
        stream.log.read_text(errors="replace"), stream.log_tail()
    assert not removed(agent, "late") and not removed(agent, "ctl")  # the newest joiner went, nobody else
