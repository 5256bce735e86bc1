"""A viewer that comes back over its session's 32 seats on LiveKit, played through with real SDK clients: the
scenario the viewer-seat tests share (a session run by the server's own worker, and one run by a worker agent).

The controller and 32 viewers join (cheap clients: no subscription); one viewer leaves, a new one takes its free
seat, and the one that left comes back with its still-valid token, which LiveKit lets in. The server must remove it,
the newest joiner, and nobody else. Each wait is bounded by a deadline.
"""

from __future__ import annotations

import trio

from server.livekit_clients import Clients as Agent
from server.viewer_seats import MAX_VIEWERS_PER_SESSION

from .conftest import SESSIONS, StreamServer, counted

__all__ = ["REMOVAL_DEADLINE", "viewer_token", "removed", "a_viewer_comes_back_over_the_seats"]

REMOVAL_DEADLINE = 20.0  # wall seconds for the server to send the viewer over the seats away (a hang bound)


async def viewer_token(stream: StreamServer, session_id: str, identity: str) -> str:
    async with stream.http() as http:
        granted = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})
    assert granted.status_code == 200, granted.text
    return granted.json()["token"]


def removed(agent: Agent, client: str, since: int = 0) -> bool:
    """Whether ``client`` was disconnected after the client event numbered ``since`` (a leave of its own counts too:
    start after it)."""
    return any(e["event"] == "disconnected" and e["client"] == client for e in agent.events[since:])


async def a_viewer_comes_back_over_the_seats(stream: StreamServer, agent: Agent) -> tuple[str, str, str]:
    """Play the scenario on ``stream``: returns the session id, its room, and the identity that was removed (the
    test reads the log for the removal's line)."""
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
    back = len(agent.events)  # its own leave is no removal
    await agent.join(returner, tokens[returner], auto_subscribe=False, decode="none")
    await agent.wait_for(lambda: removed(agent, returner, back), f"{returner} to be removed", REMOVAL_DEADLINE)
    with trio.move_on_after(REMOVAL_DEADLINE):
        while returner in (present := await agent.room_participants(room)):
            await trio.sleep(0.1)  # bench-cost: LiveKit lists the room as it saw the removal, over the network
    clients = sorted(identity for identity in present if not identity.startswith("chunkline-"))  # not the worker
    assert clients == sorted(["ctl", "late", *seated[1:]]), present
    record = await counted(stream, session_id, 1 + MAX_VIEWERS_PER_SESSION)  # back to the controller and 32
    assert record["status"] == "running", record
    assert not removed(agent, "late") and not removed(agent, "ctl")  # the newest joiner went, nobody else
    return session_id, room, returner
