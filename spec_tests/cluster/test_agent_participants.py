"""Who is in an agent-hosted session's room, as the authority shows it, changes with the room at once: on its own
local rooms the authority is told of each join and leave as it happens (it read the room every 0.25 s, so a
viewer that left and asked for a token again at once was refused as still in the room, and a viewer that had
joined was not counted yet).

A real ``--workers local`` authority and its agent, a controller and a viewer in the session's room over the
room WebSocket, and the HTTP API. No timing: the room counts a join before the one joining is told it joined, and
a leave before anyone else is told of it, so whoever hears of a move and asks the API at once finds it counted.
Then the local rooms' side in-process: a room's listener is told each move, and nothing after it is removed.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

from server.tokens import TokenIssuer, TokenRejected
from server.transport.base import TransportError
from server.transport.client import RoomClient
from server.transport.local import LocalRooms

from .conftest import Cluster, Controller, until

MOVE_DEADLINE = 30.0  # wall seconds for a room message to arrive on a loaded host (a hang bound, not a timing)



async def heard(member: Controller, kind: str, identity: str) -> None:
    """Read ``member``'s room messages until it is told ``kind`` (joined, participant_left...) of ``identity``."""
    with trio.fail_after(MOVE_DEADLINE):
        while True:
            message = await member.next()
            assert message is not None, f"the room closed before {kind} of {identity}: {member.inbox[-3:]}"
            if isinstance(message, dict) and message.get("type") == kind and message.get("identity") == identity:
                return


async def counted(client: httpx.AsyncClient, session_id: str) -> tuple[int, int]:
    """The session's participant count in its own view and in the list."""
    record = (await client.get(f"/v1/stream/sessions/{session_id}")).json()
    listed = (await client.get("/v1/stream/sessions")).json()["sessions"]
    return record["participant_count"], next(s for s in listed if s["session_id"] == session_id)["participant_count"]


async def viewer_joins(client: httpx.AsyncClient, cluster: Cluster, controller: Controller) -> Controller:
    """Ask for the viewer's token and join with it; returns once the room told the viewer it joined."""
    asked = await client.post(f"/v1/stream/sessions/{controller.session_id}/tokens", json={"identity": "v1"})
    assert asked.status_code == 200, asked.text  # refused while the authority still counted a viewer that had left
    path = f"{controller.session['websocket_path']}?token={asked.json()['token']}"
    viewer = Controller(controller.session, await RoomClient.connect("127.0.0.1", cluster.port, path))
    await heard(viewer, "joined", "v1")
    return viewer


async def test_a_viewer_that_leaves_may_come_back_at_once_and_the_count_follows_each_move(one_agent_cluster: Cluster) -> None:
    cluster = one_agent_cluster
    await until(lambda: any(w["state"] == "idle" for w in cluster.workers()), "an idle agent", cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        controller = await Controller.open(client, cluster, "alice")
        try:
            await controller.stream(2)  # the session runs on the agent, whose worker is in the room
            assert (await client.get(f"/v1/stream/sessions/{controller.session_id}")).json()["worker_id"]
            for _ in range(3):  # each round fails on a clock's read but for a lucky tick: three make it no luck
                viewer = await viewer_joins(client, cluster, controller)
                assert await counted(client, controller.session_id) == (2, 2)  # the join, counted as it was told
                await viewer.ws.aclose()
                await heard(controller, "participant_left", "v1")
                assert await counted(client, controller.session_id) == (1, 1)  # the leave, counted as it was told
            viewer = await viewer_joins(client, cluster, controller)  # the token asked at once after the leave
            assert await counted(client, controller.session_id) == (2, 2)
            await viewer.ws.aclose()
        finally:
            await client.delete(f"/v1/stream/sessions/{controller.session_id}")
            await controller.ws.aclose()
        ended: dict[str, Any] = (await client.get(f"/v1/stream/sessions/{controller.session_id}")).json()
        assert ended["status"] == "closed" and ended["participant_count"] == 0, ended


async def test_a_queued_sessions_room_is_counted_before_an_agent_runs_it(cluster: Cluster) -> None:
    """A session queued behind running ones (one a slot): its controller and a viewer in its room are counted, and
    the viewer's identity gets no second token (409), before any agent runs it (it counted nobody and granted the
    token); once promoted onto an agent, the count stays right (the agent's worker left out)."""
    await until(lambda: any(w["state"] == "idle" for w in cluster.workers()), "an idle agent", cluster)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as client:
        holders: list[Controller] = []  # one session a slot, however many agents there are: the next one queues
        while (queued := await Controller.open(client, cluster, f"c{len(holders)}")).session["status"] != "queued":
            holders.append(queued)
            assert len(holders) <= 4, "no session queued"
        try:
            await heard(queued, "joined", f"c{len(holders)}")
            assert await counted(client, queued.session_id) == (1, 1)
            viewer = await viewer_joins(client, cluster, queued)
            assert await counted(client, queued.session_id) == (2, 2)
            again = await client.post(f"/v1/stream/sessions/{queued.session_id}/tokens", json={"identity": "v1"})
            assert again.status_code == 409, again.text
            await viewer.ws.aclose()
            await heard(queued, "participant_left", "v1")
            assert await counted(client, queued.session_id) == (1, 1)
            await client.delete(f"/v1/stream/sessions/{holders[0].session_id}")
            await queued.stream(1)  # promoted: the session runs on an agent, whose worker is in the room
            assert await counted(client, queued.session_id) == (1, 1)
            viewer = await viewer_joins(client, cluster, queued)
            assert await counted(client, queued.session_id) == (2, 2)
            await viewer.ws.aclose()
            await heard(queued, "participant_left", "v1")
            assert await counted(client, queued.session_id) == (1, 1)
        finally:
            for member in (*holders, queued):
                await client.delete(f"/v1/stream/sessions/{member.session_id}")
                await member.ws.aclose()
        ended: dict[str, Any] = (await client.get(f"/v1/stream/sessions/{queued.session_id}")).json()
        assert ended["status"] == "closed" and ended["participant_count"] == 0, ended


async def test_a_watched_local_room_tells_its_one_listener_each_move_until_it_is_removed() -> None:
    """The listener hears who is in the room at once and at each join and leave (the worker too); a client refused
    at the door moves nothing; a second listener replaces the first; once removed, the room tells nobody."""
    issuer = TokenIssuer("chunkline-test", "s" * 48, ttl_seconds=600)
    rooms = LocalRooms(issuer)
    told: list[frozenset[str]] = []
    rooms.watch_participants("r", told.append)
    assert told == [frozenset()]

    async def nothing(message: str | bytes) -> None:
        pass

    async def client(identity: str, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        _, silent = trio.open_memory_channel[str](0)  # the client says nothing until it is sent away
        with trio.CancelScope() as presence:
            task_status.started(presence)
            await rooms.serve_client("r", rooms.admit_client("r", issuer.viewer_token("r", identity)), nothing,
                                     silent.receive)

    async with trio.open_nursery() as nursery:
        v1 = await nursery.start(client, "v1")
        await trio.testing.wait_all_tasks_blocked()
        assert told[-1] == {"v1"}
        worker = await rooms.connect("r", "chunkline-w", issuer.worker_token("r", "chunkline-w"), timeout=5)
        assert told[-1] == {"v1", "chunkline-w"}
        with pytest.raises(TokenRejected):
            rooms.admit_client("r", issuer.viewer_token("r", "v1"))  # the identity is in the room
        with pytest.raises(TransportError):
            await rooms.connect("r", "chunkline-w", issuer.worker_token("r", "chunkline-w"), timeout=5)
        moves = len(told)
        v1.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert told[moves:] == [{"chunkline-w"}]
        again: list[frozenset[str]] = []
        rooms.watch_participants("r", again.append)  # one listener a room: this one replaces the first
        await worker.disconnect()
        assert again == [{"chunkline-w"}, frozenset()] and told[moves:] == [{"chunkline-w"}]
        rooms.unwatch_participants("r")
        v2 = await nursery.start(client, "v2")
        await trio.testing.wait_all_tasks_blocked()
        v2.cancel()
    assert again == [{"chunkline-w"}, frozenset()] and told[moves:] == [{"chunkline-w"}]
    assert rooms.room_names() == ()  # the room went with its last participant
