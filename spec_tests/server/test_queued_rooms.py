"""A queued session's room: a client that joined it hears how the session ended before it is sent away.

No worker ever joins a queued session's room, so no room runner is there to send ``done`` or ``error``;
the server sends it itself, as ``chunkline-server``, with the same fields a runner's end carries.
Everything goes through the public interfaces: HTTP to create and delete, the room WebSocket to listen.
"""

from __future__ import annotations

from typing import Any

import pytest
from trio.testing import wait_all_tasks_blocked

from pipelines.contract import Control, ControlType
from server.tokens import SERVER_STATUS_IDENTITY
from server.transport.local_room import HELD_FOR_WORKER

from .runner_fixtures import CounterService, Peer, join, serve, settings
from .runner_fixtures import no_threads  # noqa: F401  (fixture)

SHUTDOWN_GRACE = 5.0


def last_words(peer: Peer) -> list[dict[str, Any]]:
    """The ``tf.status`` messages the server sent itself (the data envelope's ``from``)."""
    return [
        m["payload"] for m in peer.texts()
        if m.get("type") == "data" and m.get("topic") == "tf.status" and m.get("from") == SERVER_STATUS_IDENTITY
    ]


async def sent_away(peer: Peer) -> None:
    """The server closes the client's socket once the last word was sent."""
    await peer.wait_for(lambda p: p.reader_done.is_set(), "the socket to close")


@pytest.mark.usefixtures("no_threads")
@pytest.mark.parametrize("how", ["deleted", "expired"])
async def test_a_queued_session_that_ends_tells_its_room_done_with_the_cause(how: str, autojump_clock: Any) -> None:
    timeout = {"session_timeout": 60} if how == "expired" else {}
    async with serve(settings(max_sessions_per_worker=1, queue_size=1, **timeout), CounterService()) as s:
        first = await s.create("ctl")
        queued = await s.create("ctl2")
        assert queued["status"] == "queued"
        async with join(s, first["room"], first["token"]), join(s, queued["room"], queued["token"]) as waiting:
            if how == "deleted":
                status, body = await s.json("delete", f"/v1/stream/sessions/{queued['session_id']}")
                assert status == 200 and body["status"] == "closed"
            (done,) = await waiting.wait_for(last_words, "the server's done", timeout=120)
            await sent_away(waiting)
        assert done["type"] == "done" and done["session_id"] == queued["session_id"]
        assert done["reason"] == how and done["total_chunks"] == 0 and done["published_frames"] == 0
        assert waiting.status() == [done]  # nothing else was said in the room: no worker ever joined it
        assert (await s.get(queued["session_id"]))["drain_cause"] == how


@pytest.mark.usefixtures("no_threads")
async def test_a_queued_session_ended_by_the_shutdown_tells_its_room_the_error(autojump_clock: Any) -> None:
    async with serve(settings(max_sessions_per_worker=1, queue_size=1), CounterService()) as s:
        first = await s.create("ctl")
        queued = await s.create("ctl2")
        async with join(s, first["room"], first["token"]) as live, join(s, queued["room"], queued["token"]) as waiting:
            await live.wait_for(lambda p: p.status("chunk"), "the live session's first chunk")
            await s.runtime.shutdown(SHUTDOWN_GRACE)
            (error,) = await waiting.wait_for(last_words, "the server's error")
            await sent_away(waiting)
            (done,) = await live.wait_for(lambda p: p.status("done"), "the live session's done")
        assert error["type"] == "error" and error["session_id"] == queued["session_id"]
        assert error["reason"] == "shutdown" and "shut" in error["detail"]
        assert done["reason"] == "shutdown" and not last_words(live)  # its worker said it: the server did not
        record = await s.get(queued["session_id"])
        assert record["status"] == "failed" and record["error"] == error["detail"]


@pytest.mark.usefixtures("no_threads")
async def test_controls_sent_before_the_worker_joins_reach_it_when_it_does(autojump_clock: Any) -> None:
    """A queued session's controller may press keys before any worker is in its room (so may an agent's, a
    moment before the agent joins): they are held for the worker and delivered when it comes, not dropped."""
    service = CounterService()
    async with serve(settings(max_sessions_per_worker=1, queue_size=1), service) as s:
        first = await s.create("ctl")
        queued = await s.create("ctl2")
        async with join(s, first["room"], first["token"]) as live, join(s, queued["room"], queued["token"]) as early:
            await live.wait_for(lambda p: p.status("chunk"), "the first session's chunk")
            await early.control({"type": "control_state", "controls": ["d"]})
            for _ in range(40):  # past what a room holds for a worker that has not come: the rest are refused
                await early.control({"type": "control_state", "controls": ["w"]})
            beyond = 41 - HELD_FOR_WORKER
            refused = await early.wait_for(
                lambda p: len(found := [m for m in p.texts() if m.get("reason") == "no_worker_yet"]) >= beyond and found,
                "the refusals")
            await live.control({"type": "stop"})
            await early.wait_for(lambda p: p.status("chunk"), "the promoted session's first chunk")
        controls = service.sessions[(await s.get(queued["session_id"]))["pipeline_session_id"]].controls
        assert controls[0] == Control(ControlType.CONTROL_STATE, keys={"d"})  # the first, in order
        assert len(controls) == HELD_FOR_WORKER and len(refused) == beyond


@pytest.mark.usefixtures("no_threads")
async def test_controls_held_for_the_worker_survive_the_sender_reconnecting(autojump_clock: Any) -> None:
    """The room emptied (its only client reconnecting) dropped what it held for the worker, without a word."""
    service = CounterService()
    async with serve(settings(max_sessions_per_worker=1, queue_size=1), service) as s:
        first = await s.create("ctl")
        queued = await s.create("ctl2")
        async with join(s, first["room"], first["token"]) as live:
            await live.wait_for(lambda p: p.status("chunk"), "the first session's chunk")
            async with join(s, queued["room"], queued["token"]) as early:
                await early.control({"type": "control_state", "controls": ["d"]})
                await wait_all_tasks_blocked()  # the room took it (and holds it: no worker yet)
            await wait_all_tasks_blocked()  # it left: the room is empty
            async with join(s, queued["room"], queued["token"]) as back:
                await live.control({"type": "stop"})
                await back.wait_for(lambda p: p.status("chunk"), "the promoted session's first chunk")
        controls = service.sessions[(await s.get(queued["session_id"]))["pipeline_session_id"]].controls
        assert controls == [Control(ControlType.CONTROL_STATE, keys={"d"})]
