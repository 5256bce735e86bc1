"""The server's RoomService use under load, against a LiveKit stand-in on loopback (``room_service_only``): its calls
share one client and its connections, and a flood of token requests for some sessions leaves every other session's
token check its fresh look.

The real server's figures (calls a second, connections, a stop with 10,000 queued sessions) are in the report of
the change.
"""

from __future__ import annotations

import functools

import pytest
import trio
from livekit import api

from ..server.runner_fixtures import LIVEKIT_KEY, LIVEKIT_SECRET, CounterService, Served, serve, settings
from .helpers import wait_until
from .test_livekit_rooms import room_service_only

pytestmark = pytest.mark.in_process_only(reason="it serves the in-process app against a stand-in it runs itself")


def livekit_at(port: int, **overrides: object) -> dict[str, object]:
    return {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
            "livekit_api_secret": LIVEKIT_SECRET, **overrides}


def participants(identities: list[str]) -> bytes:
    return api.ListParticipantsResponse(participants=[
        api.ParticipantInfo(identity=identity, state=api.ParticipantInfo.State.ACTIVE) for identity in identities
    ]).SerializeToString()


async def token_status(s: Served, session_id: str, identity: str) -> int:
    response = await s.client.post(f"/v1/stream/sessions/{session_id}/tokens", json={"identity": identity})
    return response.status_code


async def test_the_room_services_calls_share_one_client_and_its_connection() -> None:
    """Thirty token checks (each lists its session's room), the rooms' creations and the poll's lists go over one
    or two kept connections, not one connection a call (a client made for each call opened one each)."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    calls: list[str] = []
    connections: list[int] = []
    handler = functools.partial(room_service_only, calls=calls, hold_joins=True, connections=connections)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, [listener])
        async with serve(settings(**livekit_at(port, queue_size=2)), CounterService()) as s:
            await s.create("ctl-0")  # its worker's join is held: it keeps the slot
            queued = await s.create("ctl-1")
            for index in range(30):
                assert await token_status(s, queued["session_id"], f"viewer-{index}") == 200
            made = len(calls)
            assert made >= 32 and calls.count("ListParticipants") >= 30, calls
            assert len(connections) <= 3, f"{len(connections)} connections for {made} calls"  # the worker's join: one
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("flooded_rooms", [1, 30], ids=["one_room", "many_rooms"])
async def test_a_flood_of_token_requests_leaves_a_quiet_rooms_check_its_fresh_look(flooded_rooms: int) -> None:
    """Three quiet queued sessions each have someone in their room whom the poll has not seen (it is held on another
    room). While token requests for other sessions flood the server (for one session, or for thirty), a token asked
    for each quiet room's participant is refused (409): its check lists the room now. Under one budget, first come
    first served, the flood took every fresh look and the quiet checks were left to the poll's view: granted (200),
    and LiveKit would drop the participant for the new token's holder."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    present: dict[str, list[str]] = {}
    hold: dict[str, trio.Event] = {}  # the room whose lists are held (the poll's, stuck there), and its release
    poll_held = trio.Event()

    async def answer(method: str, body: bytes) -> bytes:
        if method != "ListParticipants":
            return b""
        room = api.ListParticipantsRequest.FromString(body).room
        there = list(present.get(room, []))
        if room not in hold and present.get("flood") is not None:
            present["flood"].append(room)
        if room in hold:
            poll_held.set()
            await hold[room].wait()
        return participants(there)

    quiet_count, flood_requesters = 3, 40
    handler = functools.partial(room_service_only, hold_joins=True, answer=answer)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handler, [listener])
        overrides = livekit_at(port, queue_size=quiet_count + flooded_rooms)
        async with serve(settings(**overrides), CounterService()) as s:
            first = await s.create("ctl-0")  # its worker's join is held: it keeps the slot, and the poll looks first
            quiet = [await s.create(f"quiet-{index}") for index in range(quiet_count)]
            flooded = [await s.create(f"busy-{index}") for index in range(flooded_rooms)]
            release = hold[first["room"]] = trio.Event()  # the poll's next round stops at the first room
            with trio.fail_after(10):
                await poll_held.wait()
            for index, session in enumerate(quiet):  # each quiet room's controller joins: the poll cannot see it
                present[session["room"]] = [f"quiet-{index}"]
            refusals: list[int] = []
            flood_lists = present["flood"] = []  # the lists made since the flood began
            stop_flood = trio.Event()

            async def flood(requester: int) -> None:
                session = flooded[requester % flooded_rooms]
                index = 0
                while not stop_flood.is_set():
                    index += 1
                    await token_status(s, session["session_id"], f"flood-{requester}-{index}")

            async with trio.open_nursery() as flooding:
                for requester in range(flood_requesters):
                    flooding.start_soon(flood, requester)
                await wait_until(lambda: len(flood_lists) >= 20, "the flood to take a second's fresh looks")
                for index, session in enumerate(quiet):
                    refusals.append(await token_status(s, session["session_id"], f"quiet-{index}"))
                stop_flood.set()
            release.set()
            assert refusals == [409] * quiet_count, refusals
        nursery.cancel_scope.cancel()
