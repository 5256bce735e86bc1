"""The production path end to end: ``chunkline stream-serve --livekit-url`` and real SDK clients.

One stream server (toy world, 160x96, LiveKit transport) serves the module; each test creates its own
session over HTTP and joins the room with the token it was given, as a user's client does.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio
from livekit import rtc

from spec_tests.frames import near_ground_shift

from server.livekit_clients import Clients as Agent, ClientsError

from .conftest import LiveKit, StreamServer

pytestmark = pytest.mark.livekit

SESSIONS = "/v1/stream/sessions"
WORKER = "chunkline-worker-0"
CONTROLLER_TIMEOUT = 6.0
TERMINAL = {"closed", "failed", "expired", "rejected"}


@pytest.fixture(scope="module")
def stream(stream_servers: Callable[..., StreamServer]) -> StreamServer:
    return stream_servers(controller_timeout=CONTROLLER_TIMEOUT, room_empty_timeout=30, max_sessions_per_worker=1, queue_size=2)


async def create(stream: StreamServer, identity: str) -> dict[str, Any]:
    async with stream.http() as http:
        response = await http.post(SESSIONS, json={"identity": identity})
    assert response.status_code in (200, 202), response.text
    return response.json()


async def session(stream: StreamServer, session_id: str) -> dict[str, Any]:
    async with stream.http() as http:
        response = await http.get(f"{SESSIONS}/{session_id}")
    assert response.status_code == 200, response.text
    return response.json()


async def wait_status(stream: StreamServer, session_id: str, wanted: set[str], timeout: float = 20.0) -> dict[str, Any]:
    """The session's record once its status is one of ``wanted`` (HTTP polls of a real server)."""
    with trio.move_on_after(timeout):
        while (record := await session(stream, session_id))["status"] not in wanted:
            await trio.sleep(0.1)  # bench-cost: the server is another process
        return record
    raise AssertionError(f"session {session_id} still {record['status']!r} after {timeout:g} s, not in {wanted}")


async def settled_frame(agent: Agent, client: str, quiet: float = 0.5) -> tuple[int, np.ndarray]:
    """The picture once it has stopped changing for ``quiet`` s (no key held: no new chunks; the worker
    repeats its last frame while idle, so frames keep coming but show the same picture)."""
    last: np.ndarray | None = None
    with trio.fail_after(20):
        while True:
            reply = await agent.request("frames", client=client, grey=True)
            grey = np.asarray(reply["grey"], dtype=np.float64) if "grey" in reply else None
            if grey is not None and last is not None and float(np.abs(grey - last).mean()) < 1.0:
                return reply["frames"], grey
            last = grey
            await trio.sleep(quiet)  # bench-cost: frames come over a real network from another process


async def test_controller_holds_d_and_the_livekit_video_moves(stream: StreamServer, agent: Agent, livekit_server: LiveKit) -> None:
    created = await create(stream, "alice")
    assert created["transport"] == "livekit" and created["livekit_url"] == livekit_server.config.url
    joined = await agent.join("alice", created["token"])
    assert joined["identity"] == "alice"
    await agent.wait_message("alice", "status", stage="running")
    track = await agent.wait_for(lambda: [e for e in agent.events if e["event"] == "track" and e["client"] == "alice"], "the video track")
    assert track[0]["name"] == "chunkline-output" and track[0]["participant"] == WORKER

    await agent.wait_message("alice", "chunk", index=0)  # the preview chunk
    before_count, before = await settled_frame(agent, "alice")
    assert before.shape == (96, 160)
    chunks_before = len([m for m in agent.messages("alice") if m["type"] == "chunk"])
    await agent.request("hold", client="alice", keys=["d"], period=0.1)
    await agent.wait_for(
        lambda: len([m for m in agent.messages("alice") if m["type"] == "chunk"]) >= chunks_before + 4, "four chunks while D is held"
    )
    await agent.request("hold", client="alice", keys=[])
    after_count, after = await settled_frame(agent, "alice")
    assert after_count >= before_count + 12, (before_count, after_count)
    shift, error, unshifted = near_ground_shift(before, after)
    assert shift >= 5, f"holding D should move the content left; best shift {shift} px (error {error:.1f})"
    assert error < 0.6 * unshifted, (shift, error, unshifted)

    applied = [m["data"]["applied_controls"]["keys"] for m in agent.messages("alice") if m["type"] == "chunk"]
    assert applied[0] == [] and ["d"] in applied, applied
    for stage in ("starting_pipeline", "running"):  # sent once the controller could receive data
        await agent.wait_message("alice", "status", stage=stage, timeout=0)
    await agent.wait_message("alice", "lease_granted", timeout=0)
    await agent.wait_message("alice", "metrics", topic="tf.metrics", timeout=5)

    await agent.request("publish", client="alice", topic="tf.control", payload=json.dumps({"type": "stop"}))
    done = await agent.wait_message("alice", "done")
    assert done["total_chunks"] >= chunks_before + 4
    record = await wait_status(stream, created["session_id"], TERMINAL)
    assert record["status"] == "closed", record
    assert WORKER not in await agent.room_participants(created["room"])


async def health(stream: StreamServer) -> dict[str, Any]:
    async with stream.http() as http:
        return (await http.get("/v1/stream/health")).json()


async def viewer_token(stream: StreamServer, session_id: str, identity: str) -> dict[str, Any]:
    async with stream.http() as http:
        response = await http.post(f"{SESSIONS}/{session_id}/tokens", json={"identity": identity})
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_viewer_sees_the_same_frames_takes_no_slot_and_may_not_send(stream: StreamServer, agent: Agent) -> None:
    created = await create(stream, "carol")
    await agent.join("carol", created["token"])
    await agent.wait_message("carol", "status", stage="running")
    granted = await viewer_token(stream, created["session_id"], "viewer-1")
    assert granted["role"] == "viewer" and granted["livekit_url"] == agent.config.url
    await agent.join("viewer-1", granted["token"])
    assert (await health(stream))["free_slots"] == 0  # carol's slot only: the viewer consumed none

    await agent.request("hold", client="carol", keys=["d"], period=0.1)
    await agent.wait_frames("viewer-1", 8)
    await agent.request("hold", client="carol", keys=[])
    _, on_controller = await settled_frame(agent, "carol")
    _, on_viewer = await settled_frame(agent, "viewer-1")
    difference = float(np.abs(on_controller - on_viewer).mean())
    assert difference < 3.0, f"the viewer shows another picture (mean grey difference {difference:.1f})"
    assert [m for m in agent.messages("viewer-1") if m["type"] == "chunk"], "the viewer hears the chunk status too"

    # The viewer's grant has no data publishing, so LiveKit itself drops what it sends: the worker never
    # sees it (else it would answer not_controller). The controller's bad control, sent after, is answered
    # to the controller alone (destination_identities): the worker read its data past the moment the
    # viewer's would have arrived.
    await agent.request("publish", client="viewer-1", topic="tf.control", payload=json.dumps({"type": "stop"}))
    await agent.request("publish", client="carol", topic="tf.control", payload=json.dumps({"type": "control_state", "controls": ["q"]}))
    await agent.wait_message("carol", "control_rejected", reason="unknown_control")
    rejections = [m["reason"] for m in agent.messages("carol") if m["type"] == "control_rejected"]
    assert rejections == ["unknown_control"], rejections
    assert (await session(stream, created["session_id"]))["status"] == "running"

    async with stream.http() as http:
        assert (await http.delete(f"{SESSIONS}/{created['session_id']}")).status_code == 200
    await agent.wait_message("carol", "done")  # DELETE mid-stream drains the session: done, then closed
    # the room's news reaches the viewer, in the worker's order: had the answer gone to the room, it came first
    await agent.wait_message("viewer-1", "done")
    assert not [m for m in agent.messages("viewer-1") if m["type"] == "control_rejected"], agent.messages("viewer-1")
    await agent.request("leave", client="viewer-1")
    assert (await wait_status(stream, created["session_id"], TERMINAL))["status"] == "closed"
    assert WORKER not in await agent.room_participants(created["room"])



async def test_the_controllers_first_messages_are_taken_though_the_worker_has_not_heard_of_it_yet(
    stream: StreamServer, agent: Agent
) -> None:
    """LiveKit forwards a participant's data at once and tells the others of its join a moment later: a controller's
    first messages, sent as it joins a room the worker is already in, came with no sender. They were refused as not
    the controller's and answered to nobody (its first key state lost, `not_controller` counted), up to a second or
    two after its join."""
    created = await create(stream, "pia")
    with trio.fail_after(20):
        while WORKER not in await agent.room_participants(created["room"]):
            await trio.sleep(0.1)  # bench-cost: the worker joins from another process
    not_controller = 'chunkline_control_rejections_total{reason="not_controller"}'
    refused_before = await metric(stream, not_controller)
    await agent.join("pia", created["token"])
    for control in ({"type": "control_state", "controls": ["d"]}, {"type": "control", "control": "zz"}):
        await agent.request("publish", client="pia", topic="tf.control", payload=json.dumps(control))
    rejected = await agent.wait_message("pia", "control_rejected")
    assert rejected["reason"] == "unknown_control", rejected
    await agent.wait_for(
        lambda: ["d"] in [m["data"]["applied_controls"]["keys"] for m in agent.messages("pia") if m["type"] == "chunk"],
        "a chunk made holding d, the first state sent")
    assert await metric(stream, not_controller) == refused_before
    await agent.request("publish", client="pia", topic="tf.control", payload=json.dumps({"type": "stop"}))
    assert (await wait_status(stream, created["session_id"], TERMINAL))["status"] == "closed"


async def test_the_controller_leaving_ends_the_session_and_admits_the_queue_head(stream: StreamServer, agent: Agent) -> None:
    first = await create(stream, "dave")
    await agent.join("dave", first["token"])
    await agent.wait_message("dave", "status", stage="running")
    queued = await create(stream, "erin")
    assert queued["status"] == "queued" and queued["queue_position"] == 1, queued

    await agent.request("leave", client="dave")
    left_at = trio.current_time()
    ended = await wait_status(stream, first["session_id"], TERMINAL, timeout=CONTROLLER_TIMEOUT + 15)
    waited = trio.current_time() - left_at
    # a controller that leaves for good fails its session, naming it (issue 12: the two timeouts)
    assert ended["status"] == "failed" and ended["drain_cause"] == "controller_left", ended
    assert "'dave'" in ended["error"], ended
    assert CONTROLLER_TIMEOUT - 0.5 <= waited <= CONTROLLER_TIMEOUT + 10, waited
    assert await agent.room_participants(first["room"]) == []  # the worker left too: no ghost

    # the slot went to the queue head, which now streams
    await wait_status(stream, queued["session_id"], {"assigned", "joining_room", "starting_pipeline", "running"})
    await agent.join("erin", queued["token"])
    await agent.wait_message("erin", "status", stage="running")
    await agent.request("publish", client="erin", topic="tf.control", payload=json.dumps({"type": "stop"}))
    assert (await wait_status(stream, queued["session_id"], TERMINAL))["status"] == "closed"
    assert (await health(stream))["free_slots"] == 1


async def test_a_queued_session_deleted_tells_its_livekit_room_done(stream: StreamServer, agent: Agent) -> None:
    live = await create(stream, "gina")
    await agent.join("gina", live["token"])
    await agent.wait_message("gina", "status", stage="running")
    queued = await create(stream, "hank")
    assert queued["status"] == "queued", queued
    await agent.join("hank", queued["token"])  # no worker ever joins a queued session's room
    async with stream.http() as http:
        response = await http.delete(f"{SESSIONS}/{queued['session_id']}")
    assert response.status_code == 200 and response.json()["status"] == "closed", response.text
    done = await agent.wait_message("hank", "done")
    assert done["session_id"] == queued["session_id"] and done["reason"] == "deleted" and done["total_chunks"] == 0
    # sent through the RoomService: LiveKit names no participant (browsers take that as the server's word)
    (sent,) = [e for e in agent.events if e["event"] == "data" and e["client"] == "hank" and e["topic"] == "tf.status"]
    assert sent["sender"] is None
    # then the room goes, and its clients with it, as a local room sends them away
    await agent.wait_for(lambda: disconnected(agent, "hank"), "hank to be sent away")
    assert await agent.room_participants(queued["room"]) == []
    await agent.request("publish", client="gina", topic="tf.control", payload=json.dumps({"type": "stop"}))
    await agent.wait_message("gina", "done")
    assert (await wait_status(stream, live["session_id"], TERMINAL))["status"] == "closed"
    reason = await agent.wait_for(lambda: disconnected(agent, "gina"), "gina to be sent away")
    assert reason == str(int(rtc.DisconnectReason.ROOM_DELETED)), reason  # the clients report the enum's number
    # both sessions' tokens are good for token_ttl still, but their rooms are gone, and LiveKit (room.auto_create:
    # false) makes none on a join: they made an empty room again, for as long as their holders liked
    for client, token in (("gina-again", live["token"]), ("hank-again", queued["token"])):
        with pytest.raises(ClientsError, match="requested room does not exist"):
            await agent.join(client, token)


async def test_a_control_flood_over_livekit_is_taken_at_the_pace_and_the_last_state_wins(
    stream: StreamServer, agent: Agent
) -> None:
    """LiveKit hands the worker every packet and nothing pushes back on the sender: the worker takes each sender's
    data at the local rooms' pace (500 a second past a burst of 500), its newest message waiting its turn, so the
    last state sent is the one the pipeline ends with, and the server keeps answering meanwhile. Every message the
    newest replaced is told to the sender (``control_rejected`` ``dropped``, with how many) and counted: each one
    sent was taken or told; they were counted only in the connection and the sender heard nothing."""
    created = await create(stream, "ola")
    await agent.join("ola", created["token"])
    await agent.wait_message("ola", "status", stage="running")
    taken_before = await metric(stream, "chunkline_controls_total")
    dropped_before = await metric(stream, 'chunkline_control_rejections_total{reason="dropped"}')
    flood = 3_000
    sent = await agent.request("flood", client="ola", key_sets=[["w"], ["a"], ["s"], ["w", "a"], []], count=flood,
                               last=["d"], timeout=60)
    async with stream.http() as http:
        assert (await http.get("/v1/service/health")).status_code == 200
    # a chunk made under the last state: each chunk's status names the keys it applied
    applied = await agent.wait_for(
        lambda: next((m for m in reversed(agent.messages("ola", "tf.status")) if m.get("type") == "chunk"
                      and m.get("data", {}).get("applied_controls", {}).get("keys") == ["d"]), None),
        "a chunk made holding the last state, d", timeout=flood / 500 + 20)
    assert applied["data"]["applied_controls"]["keys"] == ["d"], (applied, sent)
    taken = await metric(stream, "chunkline_controls_total") - taken_before
    dropped = await metric(stream, 'chunkline_control_rejections_total{reason="dropped"}') - dropped_before
    # every one taken or told (on a loaded host the SDK may send no faster than the pace, and none is dropped)
    assert taken + dropped == flood + 1, (taken, dropped)

    def told_dropped() -> int:
        return sum(m["count"] for m in agent.messages("ola") if m.get("type") == "control_rejected"
                   and m.get("reason") == "dropped")

    await agent.wait_for(lambda: told_dropped() == dropped, f"ola to be told of the {dropped:g} dropped", timeout=20)
    await agent.request("publish", client="ola", topic="tf.control", payload=json.dumps({"type": "stop"}))
    assert (await wait_status(stream, created["session_id"], TERMINAL))["status"] == "closed"


async def metric(stream: StreamServer, sample: str) -> float:
    """One sample of the server's ``/metrics`` (its name and labels as written there), 0 while it has none."""
    async with stream.http() as http:
        text = (await http.get("/metrics")).text
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")), 0.0)


def disconnected(agent: Agent, client: str) -> str | None:
    """Why ``client``'s room went away, once it did."""
    return next((e["reason"] for e in agent.events if e["event"] == "disconnected" and e["client"] == client), None)


async def test_a_worker_removed_from_its_room_fails_the_session_with_the_transport_reason(stream: StreamServer, agent: Agent) -> None:
    created = await create(stream, "frank")
    await agent.join("frank", created["token"])
    await agent.wait_message("frank", "status", stage="running")
    await agent.remove_participant(created["room"], WORKER)
    removed_at = trio.current_time()
    ended = await wait_status(stream, created["session_id"], TERMINAL, timeout=15)
    assert ended["status"] == "failed", ended
    assert "disconnected" in ended["error"] and "PARTICIPANT_REMOVED" in ended["error"], ended
    assert trio.current_time() - removed_at < 5  # not after controller_timeout: the room is gone
    assert (await health(stream))["free_slots"] == 1
    await agent.request("leave", client="frank")


SESSION_TIMEOUT = 4.0


async def test_the_session_timeout_expires_a_live_livekit_session(stream_servers: Callable[..., StreamServer], agent: Agent) -> None:
    short = stream_servers(session_timeout=SESSION_TIMEOUT, controller_timeout=30, max_sessions_per_worker=1)
    created = await create(short, "gina")
    await agent.join("gina", created["token"])
    await agent.wait_message("gina", "status", stage="running")
    await agent.request("hold", client="gina", keys=["w"], period=0.1)  # streaming when the time is up
    ended = await wait_status(short, created["session_id"], TERMINAL, timeout=SESSION_TIMEOUT + 15)
    assert ended["status"] == "expired", ended
    await agent.wait_message("gina", "done")  # drained: the stream ends cleanly for the controller
    assert (await health(short))["free_slots"] == 1
    assert WORKER not in await agent.room_participants(created["room"])


async def test_a_server_stopped_by_sigterm_deletes_its_sessions_livekit_rooms(
    stream_servers: Callable[..., StreamServer], agent: Agent
) -> None:
    """A shutdown ends every session, and each room is deleted once its grace has passed; the shutdown cancelled
    those graces, so the rooms stayed, with their clients in them, for as long as anyone was there."""
    stopping = stream_servers(controller_timeout=CONTROLLER_TIMEOUT, room_empty_timeout=30, max_sessions_per_worker=1)
    live = await create(stopping, "ivan")
    await agent.join("ivan", live["token"])
    await agent.wait_message("ivan", "status", stage="running")
    stopping.process.send_signal(signal.SIGTERM)
    with trio.fail_after(60):
        while stopping.process.poll() is None:
            await trio.sleep(0.1)  # bench-cost: the server is another process
    assert stopping.process.returncode == 0, stopping.log_tail()
    reason = await agent.wait_for(lambda: disconnected(agent, "ivan"), "ivan to be sent away")
    assert reason == str(int(rtc.DisconnectReason.ROOM_DELETED)), reason
    assert await agent.room_participants(live["room"]) == []
