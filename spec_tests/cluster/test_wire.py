"""The authority <-> agent wire: every message round-trips; anything else is refused with its reason."""

from __future__ import annotations

import json
import struct

import pytest
import trio
import trio.testing
from hypothesis import given, strategies as st

from server.cluster import proofs, wire

SAMPLES: list[wire.Message] = [
    wire.Hello("n0nce", "0.1.0"),
    wire.Register(worker_id="w-1", agent_nonce="m0nce", proof="ab", version="0.1.0", pipeline="toy_world", pipeline_digest="d1",
                  node="host-a", devices=(0, 1), launcher="local", pid=42, slot="0"),
    wire.Welcome(worker_id="w-1", heartbeat_interval=1.0, deadline=5.0, transport="local",
                 rooms_url="http://127.0.0.1:8088", livekit_url=None, controller_timeout=60.0,
                 room_empty_timeout=30.0, max_data_message_bytes=12288, proof="cd"),
    wire.Refused("the cluster token does not match"),
    wire.Refused("pipeline 'x' differs", proof="ef"),
    wire.Refused("the authority does not know its rooms URL yet; try again", proof="ef", transient=True),
    wire.Busy("32 registrations pending"),
    wire.Busy("32 registrations pending", proof="ab"),
    wire.Ready(2, "bidirectional", {"computed_capacity": 3, "effective_capacity": 2, "configured_limit": 2,
                                    "limiting_device": "cpu"}),
    wire.Ready(1, "bidirectional", {"computed_capacity": None, "effective_capacity": 1, "configured_limit": 1,
                                    "limiting_device": None}, {"status": "skipped"},
               {"control_idle_timeout": 10.0, "fps": 16.0, "served": True, "assets_dir": None}),
    wire.Failed("RuntimeError: no model"),
    wire.Heartbeat(7, ("s1", "s2")),
    wire.HeartbeatAck(7),
    wire.Start(session_id="s1", room="chunkline-s1", identity="chunkline-w-1", token="jwt", controller_identity="me",
               prompt=None, config={"seed": 1}, image=None),
    wire.Stop("s1", "deleted", now=True),
    wire.Drain(30.0),
    wire.SessionEvent("s1", 3, "run", pipeline_session_id="p1", participants=("me",)),
    wire.SessionFinished("s1", 4, None, "deleted"),
    wire.Participants("s1", 5, ("me", "viewer-1")),
    wire.CheckOptions(5, {"resolution": "abc"}),
    wire.OptionsChecked(5, refused="option 'resolution' must be 'WxH'"),
    wire.OptionsChecked(6, error="no answer in time"),
    wire.CheckOptions(7, {}, (1, 1)),
    wire.OptionsChecked(7, image_refused="the image is 1 x 1 pixels; the toy world takes one of at least 2 x 2"),
    wire.Goodbye("drained"),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.TYPE)
def test_every_message_round_trips(message: wire.Message) -> None:
    frame = wire.encode(message)
    (size,) = struct.unpack(">I", frame[:4])
    assert size == len(frame) - 4
    assert wire.decode(frame[4:]) == message


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not valid JSON"),
        (b"[1]", "JSON object"),
        (json.dumps({"v": 99, "type": "hello", "nonce": "n", "authority_version": "x"}).encode(), "protocol version 99"),
        (json.dumps({"v": wire.PROTOCOL, "type": "teleport"}).encode(), "unknown message type 'teleport'"),
        (json.dumps({"v": wire.PROTOCOL, "type": "heartbeat_ack", "seq": 1, "extra": 2}).encode(), "unknown field(s) 'extra'"),
        (json.dumps({"v": wire.PROTOCOL, "type": "heartbeat_ack", "seq": "one"}).encode(),
         "heartbeat_ack.seq: expected int, got str"),
        (json.dumps({"v": wire.PROTOCOL, "type": "heartbeat_ack"}).encode(), "heartbeat_ack: missing field(s) seq"),
        (json.dumps({"v": wire.PROTOCOL, "type": "drain", "deadline": -1}).encode(),
         "drain.deadline: must be a number of seconds > 0, got -1.0"),
        (json.dumps({"v": wire.PROTOCOL, "type": "drain", "deadline": 3601}).encode(),
         "drain.deadline: must be at most 3600 seconds, got 3601.0"),  # what a drain through the API takes at most
        (b'{"v": %d, "type": "drain", "deadline": 1e999}' % wire.PROTOCOL,
         "the number '1e999' is too large for a float"),  # refused as it is parsed, before it is infinity
        (json.dumps({"v": wire.PROTOCOL, "type": "ready", "capacity": 0, "kind": "x", "plan": {}}).encode(),
         "ready.capacity: must be 1-4096, got 0"),
        (json.dumps({"v": wire.PROTOCOL, "type": "ready", "capacity": 1, "kind": "x", "plan": {}}).encode(),
         "ready.plan: lacks computed_capacity"),
        (json.dumps({"v": wire.PROTOCOL, "type": "ready", "capacity": 1, "kind": "x",
                     "plan": {"computed_capacity": 1, "effective_capacity": "one", "configured_limit": None,
                              "limiting_device": None}}).encode(),
         "ready.plan.effective_capacity: must be an integer >= 0, got 'one'"),
        (json.dumps({"v": wire.PROTOCOL, "type": "ready", "capacity": 1, "kind": "x",
                     "settings_taken": {"fps": 8, "control_idle_timeout": "five"},
                     "plan": {"computed_capacity": 1, "effective_capacity": 1, "configured_limit": None,
                              "limiting_device": None}}).encode(),
         "ready.settings_taken.control_idle_timeout: expected a number, got str"),
        (json.dumps({"v": wire.PROTOCOL, "type": "ready", "capacity": 1, "kind": "x", "settings_taken": {"fps": 0},
                     "plan": {"computed_capacity": 1, "effective_capacity": 1, "configured_limit": None,
                              "limiting_device": None}}).encode(),
         "ready.settings_taken.fps: must be a finite number > 0, got 0.0"),
        (json.dumps({"v": wire.PROTOCOL, "type": "start", "session_id": 7, "room": "r", "identity": "i", "token": "t",
                     "controller_identity": "me", "prompt": None, "config": {}, "image": None}).encode(),
         "start.session_id: expected str, got int"),
        (json.dumps({"v": wire.PROTOCOL, "type": "register", "worker_id": "w", "agent_nonce": "n", "proof": "p",
                     "version": "v", "pipeline": "p", "pipeline_digest": "d", "node": "n", "devices": [0, "1"],
                     "launcher": "l", "pid": 1}).encode(),
         "register.devices[1]: expected int, got str"),
        (json.dumps({"v": wire.PROTOCOL, "type": "refused", "reason": "r", "transient": 1}).encode(),
         "refused.transient: expected bool, got int"),
        (json.dumps({"v": wire.PROTOCOL, "type": "busy", "reason": "r", "proof": 7}).encode(),
         "busy.proof: expected str, got int"),
        (json.dumps({"v": wire.PROTOCOL, "type": "stop", "session_id": "s", "cause": "c", "now": "yes"}).encode(),
         "stop.now: expected bool, got str"),
        (json.dumps({"v": wire.PROTOCOL, "type": "heartbeat", "seq": 1, "sessions": ["a", None]}).encode(),
         "heartbeat.sessions[1]: expected str, got null"),
        (json.dumps({"v": wire.PROTOCOL, "type": "heartbeat", "seq": 1, "sessions": "a"}).encode(),
         "heartbeat.sessions: expected a list of str, got str"),
        (json.dumps({"v": wire.PROTOCOL, "type": "check_options", "check_id": 1, "options": {},
                     "image_size": [0, 4]}).encode(),
         "check_options.image_size: must be [width, height], each 1-2147483647, got [0, 4]"),
        (json.dumps({"v": wire.PROTOCOL, "type": "check_options", "check_id": 1, "options": {},
                     "image_size": [1, 2, 3]}).encode(),
         "check_options.image_size: 3 items; at most 2"),
        (b"[" * 100 + b"]" * 100, "nested 100 levels deep"),
    ],
)
def test_bad_frames_are_refused_naming_what_is_wrong(body: bytes, reason: str) -> None:
    with pytest.raises(wire.WireError, match=None) as caught:
        wire.decode(body)
    assert reason in str(caught.value)


@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_escape_as_another_error(data: bytes) -> None:
    try:
        wire.decode(data)
    except wire.WireError:
        pass


def test_the_proof_binds_token_nonce_and_worker_id() -> None:
    proof = proofs.proof_for("t" * 16, "nonce", "w-1")
    assert proofs.proof_matches("t" * 16, "nonce", "w-1", proof)
    assert not proofs.proof_matches("u" * 16, "nonce", "w-1", proof)
    assert not proofs.proof_matches("t" * 16, "other", "w-1", proof)
    assert not proofs.proof_matches("t" * 16, "nonce", "w-2", proof)
    assert not proofs.proof_matches("t" * 16, "non", "cew-1", proof)  # the parts cannot run into each other


def test_the_authoritys_proofs_bind_both_nonces_and_never_stand_in_for_the_agents() -> None:
    token = "t" * 16
    proof = proofs.authority_proof(token, "nonce", "agent-nonce", "w-1")
    assert proofs.authority_proof_matches(token, "nonce", "agent-nonce", "w-1", proof)
    for args in (("u" * 16, "nonce", "agent-nonce", "w-1"), (token, "nonce", "other", "w-1"),
                 (token, "other", "agent-nonce", "w-1"), (token, "nonce", "agent-nonce", "w-2")):
        assert not proofs.authority_proof_matches(*args, proof)
    refusal = proofs.refusal_proof(token, "nonce", "agent-nonce", "w-1", "pipeline differs", False)
    assert proofs.refusal_proof_matches(token, "nonce", "agent-nonce", "w-1", "pipeline differs", False, refusal)
    assert not proofs.refusal_proof_matches(token, "nonce", "agent-nonce", "w-1", "another reason", False, refusal)
    assert not proofs.refusal_proof_matches(token, "nonce", "agent-nonce", "w-1", "pipeline differs", False, None)
    # whether a refusal is transient is proven with it: nobody between can turn "for good" into "try again"
    assert not proofs.refusal_proof_matches(token, "nonce", "agent-nonce", "w-1", "pipeline differs", True, refusal)
    busy = proofs.busy_proof(token, "nonce", "agent-nonce", "w-1", "32 pending")
    assert proofs.busy_proof_matches(token, "nonce", "agent-nonce", "w-1", "32 pending", busy)
    for args in (("u" * 16, "nonce", "agent-nonce", "w-1"), (token, "nonce", "other", "w-1"),
                 (token, "other", "agent-nonce", "w-1"), (token, "nonce", "agent-nonce", "w-2")):
        assert not proofs.busy_proof_matches(*args, "32 pending", busy)
    assert not proofs.busy_proof_matches(token, "nonce", "agent-nonce", "w-1", "32 pending", None)
    # an agent answers any nonce a peer sends it: no nonce makes its answer the authority's proof or the frame key
    key = proofs.frame_key(token, "nonce", "agent-nonce", "w-1")
    assert len({proof, refusal, busy, key.hex(), proofs.proof_for(token, "nonce", "w-1"),
                proofs.refusal_proof(token, "nonce", "agent-nonce", "w-1", "pipeline differs", True)}) == 6


async def authenticated_pair(token: str = "t" * 16) -> tuple[wire.Channel, wire.Channel]:
    left, right = trio.testing.memory_stream_pair()
    authority, agent = wire.Channel(left), wire.Channel(right)
    key = proofs.frame_key(token, "nonce", "agent-nonce", "w-1")
    authority.authenticate(key, authority=True)
    agent.authenticate(key, authority=False)
    return authority, agent


async def test_authenticated_frames_pass_both_ways_and_carry_their_tag() -> None:
    authority, agent = await authenticated_pair()
    for message in SAMPLES:
        await authority.send(message)
        assert await agent.receive() == message
        await agent.send(message)
        assert await authority.receive() == message


@pytest.mark.parametrize("tamper", ["untagged", "changed", "replayed", "reflected", "other key"])
async def test_a_frame_without_its_tag_is_refused(tamper: str) -> None:
    authority, agent = await authenticated_pair()
    drain = wire.Drain(1.0)
    if tamper == "untagged":  # injected by someone between the peers, who has no key
        await authority.stream.send_all(wire.encode(drain))
    elif tamper == "changed":
        left, right = trio.testing.memory_stream_pair()
        sender = wire.Channel(left)
        sender.authenticate(proofs.frame_key("t" * 16, "nonce", "agent-nonce", "w-1"), authority=True)
        await sender.send(drain)
        frame = bytearray(await right.receive_some(65536))
        frame[frame.index(b"1.0")] = ord("9")
        await authority.stream.send_all(bytes(frame))
    elif tamper == "replayed":
        left, right = trio.testing.memory_stream_pair()
        sender = wire.Channel(left)
        sender.authenticate(proofs.frame_key("t" * 16, "nonce", "agent-nonce", "w-1"), authority=True)
        await sender.send(drain)
        frame = await right.receive_some(65536)
        await authority.stream.send_all(frame)
        assert await agent.receive() == drain  # the first time it is the next frame
        await authority.stream.send_all(frame)
    elif tamper == "reflected":  # the agent's own frame sent back to it
        await agent.send(drain)
        frame = await authority.stream.receive_some(65536)
        await authority.stream.send_all(frame)
    else:
        impostor, _ = await authenticated_pair("u" * 16)
        impostor.stream = authority.stream
        await impostor.send(drain)
    with pytest.raises(wire.WireError, match="does not carry its authentication tag|too short"):
        await agent.receive()


async def test_a_channel_carries_messages_in_order_and_reports_a_close() -> None:
    left, right = trio.testing.memory_stream_pair()
    a, b = wire.Channel(left), wire.Channel(right)
    for message in SAMPLES:
        await a.send(message)
    for message in SAMPLES:
        assert await b.receive() == message
    await a.aclose()
    with pytest.raises(wire.ConnectionClosed):
        await b.receive()


async def test_an_oversized_frame_header_is_refused_before_reading_it() -> None:
    left, right = trio.testing.memory_stream_pair()
    await left.send_all(struct.pack(">I", wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(wire.WireError, match="exceeds"):
        await wire.Channel(right).receive()
