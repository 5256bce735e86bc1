"""LiveKit rooms as the server makes them: a session's room exists before its token is out, a create refused
at once makes none, a burst of creates makes rooms for at most as many sessions as the server would take, and
LiveKit unreachable or mute is a clear failure that holds nothing.

A LiveKit stand-in on loopback answers the RoomService (the server's side, HTTP); the real-server behaviours
(tokens of ended sessions refused, media) are in ``spec_tests/livekit``.
"""

from __future__ import annotations

import functools
import json
import re
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from livekit import api

from ..server.runner_fixtures import LIVEKIT_KEY, LIVEKIT_SECRET, CounterService, Served, serve, settings
from .helpers import Leaks, wait_until

async def room_service_only(
    stream: trio.SocketStream, calls: list[str] | None = None, hold_joins: bool = False, answer_when: trio.Event | None = None,
    listed: list[str] | None = None, answer: Callable[[str, bytes], Awaitable[bytes]] | None = None,
    connections: list[int] | None = None,
) -> None:
    """A LiveKit stand-in's connection: a RoomService call (room made, room deleted, participants listed) is answered
    200 with an empty message (or with ``answer``'s, given the method and the request's body, once it returns), and
    its method goes into ``calls`` (and the room a list asks for into ``listed``); anything else (the signalling a
    worker's join opens) is dropped unanswered, or with ``hold_joins`` held open without a word until the stand-in
    stops. With ``answer_when``, a RoomService call is answered only once that event is set (LiveKit slow to make
    rooms). With ``connections`` (one entry a connection), the connection is kept open for the next call, as
    LiveKit's is; else it is closed after one. A kept connection the client drops (a call cut: the server closes
    its connection) ends its handler, not the stand-in."""
    if connections is not None:
        connections.append(1)
    try:
        await _serve_calls(stream, calls, hold_joins, answer_when, listed, answer, connections)
    except trio.BrokenResourceError:
        if connections is None:
            raise


async def _serve_calls(
    stream: trio.SocketStream, calls: list[str] | None, hold_joins: bool, answer_when: trio.Event | None,
    listed: list[str] | None, answer: Callable[[str, bytes], Awaitable[bytes]] | None, connections: list[int] | None,
) -> None:
    async with stream:
        received = b""
        while True:
            with trio.move_on_after(5 if answer_when is None else 30):
                while b"\r\n\r\n" not in received:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    received += data
            if b"\r\n\r\n" not in received:
                return
            head, _, body = received.partition(b"\r\n\r\n")
            if not head.startswith(b"POST /twirp/livekit.RoomService/"):
                if hold_joins:
                    await trio.sleep_forever()
                return
            method = head.split(b" ")[1].rsplit(b"/", 1)[1].decode()
            if calls is not None:
                calls.append(method)
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
            while len(body) < length:
                data = await stream.receive_some(65536)
                if not data:
                    return
                body += data
            body, received = body[:length], body[length:]
            if listed is not None and method == "ListParticipants":
                listed.append(api.ListParticipantsRequest.FromString(body).room)
            if answer_when is not None:
                await answer_when.wait()
            message = b"" if answer is None else await answer(method, body)
            keep = connections is not None
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/protobuf\r\nContent-Length: "
                                  + str(len(message)).encode() + b"\r\nConnection: "
                                  + (b"keep-alive" if keep else b"close") + b"\r\n\r\n" + message)
            if not keep:
                return


@pytest.mark.in_process_only(reason=(
    "it reads the in-process service (no pipeline session was made) and checks this process's threads; an"
    " agent's LiveKit connection is its own"
))
async def test_a_worker_that_cannot_join_its_livekit_room_fails_the_session_within_the_connect_timeout() -> None:
    """LiveKit makes the rooms but no worker gets in (its signalling goes unanswered): each session fails within
    the connect timeout, naming LiveKit, and its slot goes to the queue head."""
    from server.runner import CONNECT_TIMEOUT

    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    overrides = {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
                 "livekit_api_secret": LIVEKIT_SECRET}

    async def one_round(s: Served) -> tuple[Any, Any, float]:
        started = time.monotonic()
        created = await s.create("ctl")
        queued = await s.create("ctl-next")
        await wait_until(lambda: s.runtime.get(created["session_id"]).is_terminal, "the session to fail",
                         deadline=CONNECT_TIMEOUT + 5)
        return created, queued, time.monotonic() - started

    async with trio.open_nursery() as stand_in:
        stand_in.start_soon(trio.serve_listeners, room_service_only, [listener])
        # the first LiveKit connect in a process starts the SDK's native runtime, which stays: warm it up first
        async with serve(settings(**overrides), CounterService()) as s:
            assert s.runtime.transport.name == "livekit" and s.runtime.transport.running  # started by the app
            await one_round(s)
        leaks = Leaks(foreign_threads_ok=True)  # native SDK threads may register late (see helpers.Leaks)
        service = CounterService()
        async with serve(settings(**overrides), service) as s:
            assert s.runtime.transport.running, "the app did not start the LiveKit transport"
            created, queued, took = await one_round(s)
            record = s.runtime.get(created["session_id"])
            assert record.status.value == "failed"
            assert took < CONNECT_TIMEOUT
            assert "LiveKit" in record.error and f"127.0.0.1:{port}" in record.error, record.error
            assert not service.sessions  # no pipeline session was created
            # the queue head got the slot (its own connect then fails the same way)
            assert s.runtime.get(queued["session_id"]).worker_id == "worker-0"
            assert not s.runtime.book.holds(created["session_id"])
            await wait_until(lambda: s.runtime.get(queued["session_id"]).is_terminal, "the queue head to end",
                             deadline=CONNECT_TIMEOUT + 5)
            assert "LiveKit" in s.runtime.get(queued["session_id"]).error
            snapshot = s.runtime.book.snapshot()
            assert (snapshot.retained, snapshot.queued, snapshot.free_slots) == (0, 0, 1)
        stand_in.cancel_scope.cancel()
    await leaks.check()


def rooms_made(calls: list[str]) -> list[str]:
    """The RoomService calls that made or deleted a room (the server also lists who is in a room none of its workers
    is in yet: ``ListParticipants``)."""
    return [call for call in calls if call != "ListParticipants"]


@pytest.mark.in_process_only(reason="it reads the in-process admission book")
async def test_a_session_refused_at_once_makes_no_livekit_room() -> None:
    """A create refused as it is asked for (no slot, no place in the queue) costs LiveKit nothing: no room is made
    for it, and none deleted; an admitted one's room is made before its answer."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    calls: list[str] = []
    overrides = {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
                 "livekit_api_secret": LIVEKIT_SECRET, "max_sessions_per_worker": 1, "queue_size": 0}
    stand_in = trio.CancelScope()

    async def run_stand_in() -> None:
        with stand_in:
            await trio.serve_listeners(functools.partial(room_service_only, calls=calls, hold_joins=True), [listener])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_stand_in)
        async with serve(settings(**overrides), CounterService()) as s:
            first = await s.client.post("/v1/stream/sessions", json={"identity": "ctl"})
            assert first.status_code == 200, await first.get_data()
            assert rooms_made(calls) == ["CreateRoom"]  # before the answer: the token is good only once the room exists
            for _ in range(20):  # the worker's join is held: the slot stays taken
                refused = await s.client.post("/v1/stream/sessions", json={"identity": "ctl-2"})
                assert refused.status_code == 429, await refused.get_data()
            assert rooms_made(calls) == ["CreateRoom"]
            stand_in.cancel(reason="the test is over")  # the held join fails now, and the session with it


@pytest.mark.in_process_only(reason="it reads the in-process service and the admission book")
async def test_livekit_unreachable_refuses_a_new_session_and_holds_nothing() -> None:
    """No LiveKit server answers: the session's room cannot be made, so the create is refused (503, naming the
    LiveKit server) at once, before anything is admitted; it was admitted, then failed in its runner."""
    # bound and never listened on, for the whole test: a dial to it is refused, and no other process can take it
    # meanwhile (a port merely free when it is picked can be, under xdist)
    with socket.socket() as unserved:
        unserved.bind(("127.0.0.1", 0))
        port = unserved.getsockname()[1]
        overrides = {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
                     "livekit_api_secret": LIVEKIT_SECRET}
        service = CounterService()
        async with serve(settings(**overrides), service) as s:
            started = time.monotonic()
            response = await s.client.post("/v1/stream/sessions", json={"identity": "ctl"})
            body, headers = json.loads(await response.get_data()), response.headers
            assert response.status_code == 503 and body["error"] == "transport_unavailable", body
            assert "could not create the LiveKit room" in body["detail"] and f"127.0.0.1:{port}" in body["detail"], body
            assert headers["Retry-After"].isdigit()
            assert time.monotonic() - started < s.runtime.transport.disconnect_timeout + 1
            assert list(s.runtime.registry) == [] and not service.sessions
            snapshot = s.runtime.book.snapshot()
            assert (snapshot.retained, snapshot.queued, snapshot.free_slots) == (0, 0, 1)


@pytest.mark.in_process_only(reason="it reads the in-process admission book")
async def test_a_burst_of_creates_makes_rooms_only_for_the_places_the_server_has() -> None:
    """Twenty creates at once while LiveKit is slow to make rooms, with one slot and one place in the queue: the
    server asks LiveKit for two rooms and refuses the other eighteen creates at once (429, no room made), since
    the two whose rooms are being made were promised the two places; once LiveKit answers, one is admitted and one
    queued."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    calls: list[str] = []
    rooms_answered = trio.Event()
    overrides = {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
                 "livekit_api_secret": LIVEKIT_SECRET, "max_sessions_per_worker": 1, "queue_size": 1}
    stand_in = trio.CancelScope()
    answered: list[tuple[int, str]] = []

    async def run_stand_in() -> None:
        with stand_in:
            handler = functools.partial(room_service_only, calls=calls, hold_joins=True, answer_when=rooms_answered)
            await trio.serve_listeners(handler, [listener])

    async def create(s: Served, index: int) -> None:
        response = await s.client.post("/v1/stream/sessions", json={"identity": f"ctl-{index}"})
        answered.append((response.status_code, json.loads(await response.get_data()).get("error", "")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_stand_in)
        async with serve(settings(**overrides), CounterService()) as s:
            async with trio.open_nursery() as burst:
                for index in range(20):
                    burst.start_soon(create, s, index)
                await wait_until(lambda: len(answered) == 18 and len(rooms_made(calls)) == 2, "18 refusals and 2 rooms asked for")
                assert answered == [(429, "queue_full")] * 18, answered
                assert s.runtime.rooms_opening == 2 and list(s.runtime.registry) == []
                rooms_answered.set()
            assert sorted(status for status, _ in answered) == [200, 202] + [429] * 18, answered
            assert rooms_made(calls) == ["CreateRoom", "CreateRoom"] and s.runtime.rooms_opening == 0
            snapshot = s.runtime.book.snapshot()
            assert (snapshot.retained, snapshot.queued) == (1, 1)
            stand_in.cancel(reason="the test is over")  # the held join fails now, and its session with it


@pytest.mark.in_process_only(reason="it reads the in-process runtime's followed rooms")
async def test_the_rooms_of_many_queued_sessions_are_looked_into_at_a_bounded_pace() -> None:
    """Who is in a room no worker of the server is in yet (its session queued, or its worker still joining) is
    listed through the RoomService: every such room in turn, each again once the others had their turn, never more
    than ``LOOKS_PER_SECOND`` lists a second over all of them, however many sessions wait (here 30 queued behind a
    session whose worker's join is held: 31 rooms, more than one second's looks)."""
    from server.room_follow import LOOKS_PER_SECOND

    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    listed: list[str] = []
    queued = 30
    overrides = {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
                 "livekit_api_secret": LIVEKIT_SECRET, "max_sessions_per_worker": 1, "queue_size": queued}
    stand_in = trio.CancelScope()

    async def run_stand_in() -> None:
        with stand_in:
            await trio.serve_listeners(functools.partial(room_service_only, hold_joins=True, listed=listed), [listener])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_stand_in)
        async with serve(settings(**overrides), CounterService()) as s:
            rooms, started = [], time.monotonic()
            for index in range(queued + 1):
                response = await s.client.post("/v1/stream/sessions", json={"identity": f"ctl-{index}"})
                assert response.status_code == (200 if index == 0 else 202), await response.get_data()
                rooms.append(json.loads(await response.get_data())["room"])
            await wait_until(lambda: all(listed.count(room) >= 2 for room in rooms), "every room listed twice")
            took = time.monotonic() - started
            assert len(listed) <= LOOKS_PER_SECOND * took + 2, (len(listed), took)  # the pace, over all the rooms
            assert set(listed) == set(rooms) and len(s.runtime.room_follow.followed) == queued + 1
            stand_in.cancel(reason="the test is over")  # the held join fails now, and its session with it


@pytest.mark.in_process_only(reason="it reads the in-process runtime's record while it waits for the poll")
async def test_a_look_into_a_queued_room_that_answers_late_does_not_undo_a_newer_one() -> None:
    """A token asked for a queued session looks into its room, and LiveKit is slow to answer that look (with who was
    in the room when it asked: nobody). Meanwhile the session's controller joins, and the poll's next look sees it:
    the session counts one. When the older look's answer comes at last, it is older than what the record holds, and
    is dropped: the session still counts its controller (the last answer to come used to win, and an empty room
    counted nobody until the poll came round again; a token asked for then was granted on that view)."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    present: dict[str, list[str]] = {}  # who is in each room now, as the stand-in lists it
    listed: list[str] = []
    hold: dict[str, str] = {}  # the room whose next list is held, and answered with who was in it when it came
    held, release = trio.Event(), trio.Event()
    overrides = {"transport": "livekit", "livekit_url": f"ws://127.0.0.1:{port}", "livekit_api_key": LIVEKIT_KEY,
                 "livekit_api_secret": LIVEKIT_SECRET, "max_sessions_per_worker": 1, "queue_size": 1}

    async def answer(method: str, body: bytes) -> bytes:
        if method != "ListParticipants":
            return b""
        room = api.ListParticipantsRequest.FromString(body).room
        there = list(present.get(room, []))  # as the call came
        if hold.get("room") == room:
            del hold["room"]
            held.set()
            await release.wait()
        return api.ListParticipantsResponse(participants=[
            api.ParticipantInfo(identity=identity, state=api.ParticipantInfo.State.ACTIVE) for identity in there
        ]).SerializeToString()

    stand_in = trio.CancelScope()

    async def run_stand_in() -> None:
        with stand_in:
            handler = functools.partial(room_service_only, hold_joins=True, listed=listed, answer=answer)
            await trio.serve_listeners(handler, [listener])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_stand_in)
        async with serve(settings(**overrides), CounterService()) as s:
            await s.create("ctl-0")  # its worker's join is held: it keeps the slot
            queued = await s.create("ctl-1")
            assert queued["status"] == "queued", queued
            session, room = queued["session_id"], queued["room"]
            seen = len(listed)
            await wait_until(lambda: listed.count(room) > seen, "the poll to look into the queued room")
            hold["room"] = room  # the poll looked just now: the next look is the token's
            async with trio.open_nursery() as asking:
                asking.start_soon(s.viewer_token, session, "bob")
                with trio.fail_after(5):
                    await held.wait()
                present[room] = ["ctl-1"]  # the controller joins while that look waits for its answer
                # bench-cost: the poll looks into each room once a second (real time: the stand-in is a socket)
                await wait_until(lambda: s.runtime.get(session).participant_count == 1, "the poll to see ctl-1",
                                 deadline=4)
                release.set()  # the token's look answers now: nobody, as the room was when it asked
            assert (await s.get(session))["participant_count"] == 1, "an older look's answer undid a newer one's"
            stand_in.cancel(reason="the test is over")  # the held join fails now, and its session with it
