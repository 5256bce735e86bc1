"""A session's viewer seats bound what is held now: viewers in its room and viewer tokens handed out that can still
be used (not expired, not yet used to join), 32 together (``server/viewer_seats.py``).

They were counted per identity a token was ever made for: a long public session turned away its 33rd distinct
viewer for good (409 ``viewer_limit``, "already has 32 viewer identities, the most one room holds"), its room empty.
Through the app's HTTP routes and room sockets (in-process, local rooms, trio's autojump clock): viewers that came
and went free their seats; unused tokens hold theirs until they expire; a viewer coming back with its token takes a
free seat at the door or is refused there, so an unused token always finds its seat; the 409 says what is full.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from server.transport import ParticipantLeft, TransportError
from server.viewer_seats import MAX_VIEWERS_PER_SESSION, SEND_AWAY_WAITS, send_away_over_seats
from spec_tests import virtual_time

from .runner_fixtures import CounterService, Peer, Served, join, join_at, serve, settings
from .runner_fixtures import no_threads  # noqa: F401  (fixture)

TTL = 60.0  # --token-ttl of these servers: seconds a viewer token, and its seat while unused, lasts


def seated_server() -> Any:
    return serve(settings(max_sessions_per_worker=1, token_ttl=TTL), CounterService(fps=4, frames_per_chunk=1, size=(8, 8)))


async def ask(served: Served, session_id: str, identity: str) -> tuple[int, Any]:
    return await served.json("post", f"/v1/stream/sessions/{session_id}/tokens", json={"identity": identity})


async def joined(peer: Peer) -> None:
    await peer.wait_for(lambda p: any(m.get("type") == "joined" for m in p.texts()), "the join")


async def refused(peer: Peer) -> dict[str, Any]:
    return await peer.wait_for(
        lambda p: next((m for m in p.texts() if m.get("type") == "refused"), None), "the refusal")


async def come_and_go(served: Served, created: dict[str, Any], identity: str) -> None:
    """A viewer gets a token, joins the room and leaves it."""
    async with join(served, created["room"], await served.viewer_token(created["session_id"], identity)) as viewer:
        await joined(viewer)
    await wait_all_tasks_blocked()


@pytest.mark.usefixtures("no_threads")
async def test_viewers_that_came_and_went_free_their_seats(autojump_clock: Any) -> None:
    async with seated_server() as served:
        created = await served.create("ctl")
        for index in range(3 * MAX_VIEWERS_PER_SESSION):  # three times the seats, one after another
            await come_and_go(served, created, f"passer-{index}")
        record = served.runtime.get(created["session_id"])
        assert record.viewer_passes.until == {}  # every token was used: nothing of them is remembered
        for index in range(MAX_VIEWERS_PER_SESSION):  # and every seat is free again
            status, body = await ask(served, created["session_id"], f"new-{index}")
            assert status == 200, body
        assert len(record.viewer_passes.until) == MAX_VIEWERS_PER_SESSION


@pytest.mark.usefixtures("no_threads")
async def test_unused_tokens_hold_their_seats_until_they_expire_and_the_409_says_what_is_full(autojump_clock: Any) -> None:
    async with seated_server() as served:
        created = await served.create("ctl")
        session_id = created["session_id"]
        async with join(served, created["room"], await served.viewer_token(session_id, "watcher")) as watcher:
            await joined(watcher)
            for index in range(MAX_VIEWERS_PER_SESSION - 1):
                assert (await ask(served, session_id, f"unused-{index}"))[0] == 200
            status, body = await ask(served, session_id, "one-too-many")
            assert (status, body["error"]) == (409, "viewer_limit"), body
            assert re.search(f"all {MAX_VIEWERS_PER_SESSION} viewer seats are taken: 1 viewer\\(s\\) in the room and 31 "
                             r"viewer token\(s\) handed out and not used yet \(the first expires in (59|60) s\)",
                             body["detail"]), body
            await virtual_time.elapse(TTL / 2)
            status, body = await ask(served, session_id, "one-too-many")
            assert status == 409 and re.search(r"the first expires in (29|30) s", body["detail"]), body
            assert (await ask(served, session_id, "unused-0"))[0] == 200  # a fresh token for the seat it holds
            await virtual_time.elapse(TTL / 2)  # the other unused tokens expire
            status, body = await ask(served, session_id, "one-too-many")
            assert status == 200, body
        await wait_all_tasks_blocked()
        # the watcher left: its seat is free with the expired tokens'; unused-0 and one-too-many hold theirs
        for index in range(MAX_VIEWERS_PER_SESSION - 2):
            assert (await ask(served, session_id, f"later-{index}"))[0] == 200
        status, body = await ask(served, session_id, "later-too-many")
        assert status == 409 and "0 viewer(s) in the room and 32 viewer token(s)" in body["detail"], body
        await virtual_time.elapse(TTL / 2)  # unused-0's fresh token expires
        assert (await ask(served, session_id, "later-too-many"))[0] == 200


@pytest.mark.usefixtures("no_threads")
async def test_a_viewer_coming_back_takes_a_free_seat_or_is_refused_at_the_door(autojump_clock: Any) -> None:
    async with seated_server() as served:
        created = await served.create("ctl")
        session_id, room = created["session_id"], created["room"]
        status, body = await ask(served, session_id, "ctl")  # the controller's identity is no viewer's
        assert (status, body["error"]) == (409, "conflict") and "already used in this room" in body["detail"], body
        kept = await served.viewer_token(session_id, "returner")
        async with join(served, room, kept) as returner:
            await joined(returner)
        await wait_all_tasks_blocked()
        promised = [await served.viewer_token(session_id, f"promised-{index}")
                    for index in range(MAX_VIEWERS_PER_SESSION - 1)]
        async with join(served, room, kept) as returner:  # a seat is free: its old token opens the room again
            await joined(returner)
            status, body = await ask(served, session_id, "one-too-many")
            assert status == 409 and "1 viewer(s) in the room and 31 viewer token(s)" in body["detail"], body
        await wait_all_tasks_blocked()
        assert (await ask(served, session_id, "last-seat"))[0] == 200  # the returner's seat, free again
        async with join(served, room, kept) as returner:  # every seat is promised: the door refuses it
            refusal = await refused(returner)
            assert refusal["reason"] == "viewer_limit", refusal
            assert f"all {MAX_VIEWERS_PER_SESSION} viewer seats are taken: 0 viewer(s) in the room and 32" in \
                   refusal["detail"], refusal
        # ... and every token handed out unused finds its seat
        async with join(served, room, promised[0]) as first:
            await joined(first)
            status, body = await served.json("get", f"/v1/stream/sessions/{session_id}")
            assert status == 200 and body["participant_count"] == 1, body  # the worker is not counted


@pytest.mark.usefixtures("no_threads")
async def test_a_local_rooms_worker_sends_a_viewer_away_with_viewer_limit_on_its_socket(autojump_clock: Any) -> None:
    """A room's worker sends a participant away (``RoomConnection.send_away``: the runner removes a viewer over its
    seats so where LiveKit is the door; a local room's door keeps such a viewer out): the viewer's room socket is told
    ``viewer_limit`` with the reason and closed, the controller stays and hears it leave, the worker hears it leave,
    and one not in the room is no failure. The worker joins a queued session's room (no runner is in it) through the
    transport, as a runner does."""
    async with serve(settings(max_sessions_per_worker=1, queue_size=1), CounterService()) as served:
        await served.create("ctl")
        queued = await served.create("ctl2")
        assert queued["status"] == "queued", queued
        room, why = queued["room"], "all 32 viewer seats are taken: the test says so"
        token = await served.viewer_token(queued["session_id"], "v1")
        async with join(served, room, queued["token"]) as controller, join(served, room, token) as viewer:
            await joined(controller)
            await joined(viewer)
            rooms, issuer = served.runtime.transport, served.runtime.issuer
            worker = await rooms.connect(room, "chunkline-probe", issuer.worker_token(room, "chunkline-probe"), timeout=5)
            try:
                await worker.send_away("v1", "viewer_limit", why)
                assert await refused(viewer) == {"type": "refused", "reason": "viewer_limit", "detail": why}
                await viewer.wait_for(lambda p: p.reader_done.is_set(), "the viewer's socket to close")
                await controller.wait_for(lambda p: {"type": "participant_left", "identity": "v1"} in p.texts(),
                                          "the controller to hear the viewer leave")
                with trio.fail_after(5):
                    assert await worker.next_event() == ParticipantLeft("v1")
                await worker.send_away("nobody", "viewer_limit", why)  # not in the room: nothing to do
                await wait_all_tasks_blocked()
                assert not controller.reader_done.is_set()
                assert not [m for m in controller.texts() if m.get("type") == "refused"], controller.texts()
            finally:
                await worker.disconnect()


class RefusingRoom:
    """A room whose first ``refusals`` removals fail as LiveKit's do when it refuses or does not answer in time."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.tries: list[float] = []  # trio clock

    async def send_away(self, identity: str, reason: str, detail: str) -> None:
        self.tries.append(trio.current_time())
        if len(self.tries) <= self.refusals:
            raise TransportError(f"LiveKit: removing {identity!r} failed: no answer within 5 s")


@pytest.mark.parametrize("refusals", [1, len(SEND_AWAY_WAITS), len(SEND_AWAY_WAITS) + 1])
async def test_a_removal_over_the_seats_that_livekit_refuses_is_tried_again(
    autojump_clock: Any, refusals: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A viewer over the seats whose removal failed once stayed in the room for good (nothing looks at it again):
    the removal is tried again after each of ``SEND_AWAY_WAITS``; past them the viewer stays, logged once."""
    room = RefusingRoom(refusals)
    caplog.set_level("INFO", logger="chunkline.rooms")
    start = trio.current_time()
    await send_away_over_seats(room, "s-1", "v33", "all 32 viewer seats are taken")
    tries = min(refusals + 1, len(SEND_AWAY_WAITS) + 1)
    waited = [0.0, *itertools.accumulate(SEND_AWAY_WAITS)][:tries]
    assert [round(at - start, 6) for at in room.tries] == waited
    stayed = [r.getMessage() for r in caplog.records if "stays in the room" in r.getMessage()]
    if refusals > len(SEND_AWAY_WAITS):
        assert stayed == [f"session s-1: viewer 'v33' over the seats stays in the room ({tries} tries): "
                          f"LiveKit: removing 'v33' failed: no answer within 5 s"], stayed
    else:
        assert stayed == []


@pytest.mark.usefixtures("no_threads")
async def test_a_viewer_token_says_where_to_join_and_a_viewer_joins_there(autojump_clock: Any) -> None:
    """A viewer token's answer names the room socket as a create's does (``websocket_path``, ``transport``): a
    viewer's client had to build the path itself from the room's name."""
    async with seated_server() as served:
        created = await served.create("ctl")
        status, body = await ask(served, created["session_id"], "v1")
        assert status == 200, body
        assert (body["transport"], body["websocket_path"]) == ("local", created["websocket_path"]), body
        async with join_at(served, body["websocket_path"], body["token"]) as viewer:
            await joined(viewer)
            assert viewer.texts()[0]["role"] == "viewer", viewer.texts()
