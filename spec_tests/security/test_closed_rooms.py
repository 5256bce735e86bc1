"""A session's room lives as long as the session, through a real server (the front's room sockets).

The check that a closed session's tokens no longer open its room was the app route's own, which ``chunkline
stream-serve`` never reaches (the front serves every room socket), so a deleted session's controller and
viewer tokens opened its room again; and nothing sent a room's sockets away when its session ended, so they
stayed (answering pings) for as long as they liked, each one of the front's 1024 connections: a client could
pile them up session after session. Now the room's clients get their last messages (``done``) and are sent
away when the session ends, whatever ended it, and its tokens are refused with ``session_closed``.
"""

from __future__ import annotations

from typing import Any

import trio

from server.transport.client import RoomClient

from .test_hostile_server import WAIT, Server, running


async def until_sent_away(client: RoomClient) -> list[Any]:
    """What the client receives until the server closes its socket (bounded)."""
    received = []
    with trio.fail_after(WAIT):
        while (message := await client.receive()) is not None:
            received.append(message)
    return received


def statuses(received: list[Any]) -> list[str]:
    return [m["payload"]["type"] for m in received if isinstance(m, dict) and m.get("topic") == "tf.status"]


async def viewer_token(server: Server, created: dict[str, Any], identity: str) -> str:
    status, body = await server.request("POST", f"/v1/stream/sessions/{created['session_id']}/tokens",
                                        {"identity": identity})
    assert status == 200, body
    return body["token"]  # type: ignore[no-any-return]


async def test_a_sessions_clients_get_done_and_are_sent_away_when_it_ends() -> None:
    async with running(controller_timeout=3600) as server:
        created = await server.session()
        controller = await server.room(created)
        viewer = await server.room(created, await viewer_token(server, created, "watcher"))
        async with trio.open_nursery() as nursery:
            seen: dict[str, list[Any]] = {}

            async def watch(name: str, client: RoomClient) -> None:
                seen[name] = await until_sent_away(client)

            nursery.start_soon(watch, "controller", controller)
            nursery.start_soon(watch, "viewer", viewer)
            status, _ = await server.request("DELETE", f"/v1/stream/sessions/{created['session_id']}")
            assert status == 200
        await controller.aclose()
        await viewer.aclose()
        assert "done" in statuses(seen["controller"]) and "done" in statuses(seen["viewer"]), seen


async def test_a_closed_sessions_tokens_no_longer_open_its_room() -> None:
    async with running() as server:
        created = await server.session()
        token = await viewer_token(server, created, "late")
        assert (await server.request("DELETE", f"/v1/stream/sessions/{created['session_id']}"))[0] == 200
        for client in (await server.room(created), await server.room(created, token)):
            with trio.fail_after(WAIT):
                assert await client.receive() == {"type": "refused", "reason": "session_closed",
                                                  "detail": "the session has ended: its room is closed"}
            await client.aclose()


async def test_a_queued_sessions_room_is_closed_when_it_is_withdrawn() -> None:
    async with running(queue_size=1, controller_timeout=3600) as server:
        first = await server.session("first")
        status, queued = await server.request("POST", "/v1/stream/sessions", {"identity": "second"})
        assert status == 202, queued
        waiting = await server.room(queued)  # its room opens while it waits (no worker in it yet)
        with trio.fail_after(WAIT):
            assert (await waiting.receive())["type"] == "joined"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(until_sent_away, waiting)
            assert (await server.request("DELETE", f"/v1/stream/sessions/{queued['session_id']}"))[0] == 200
        await waiting.aclose()
        await server.request("DELETE", f"/v1/stream/sessions/{first['session_id']}")
