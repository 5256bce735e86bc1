"""Hostile room participants (local transport, the room WebSocket): topics belong to their roles,
deep or unencodable JSON is refused without dropping the socket, and a room holds a bounded
number of sockets (principles 1 and 7 of the hostile-clients issue).
"""

from __future__ import annotations

import json

import trio

from server.json_limits import MAX_JSON_DEPTH
from server.transport.local import MAX_CLIENTS_PER_ROOM
from spec_tests.server.runner_fixtures import join

from .test_tokens_transport import WAIT, pipeline_controls, running_room, wait_for_a_control


def refusals(peer: object) -> list[str]:
    return [m["reason"] for m in peer.texts() if m["type"] == "refused"]  # type: ignore[attr-defined]


def refusal_details(peer: object) -> list[str]:
    """What each refusal said beyond its code (every refusal names what was wrong: it once said only the code)."""
    return [m["detail"] for m in peer.texts() if m["type"] == "refused"]  # type: ignore[attr-defined]


async def test_a_controller_cannot_speak_as_the_worker_on_its_topics() -> None:
    async with running_room() as (served, service, created, ctl):
        token = await served.viewer_token(created["session_id"], "watcher")
        async with join(served, created["room"], token) as viewer:
            await viewer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
            await ctl.send("tf.status", {"type": "done", "session_id": created["session_id"]})
            await ctl.send("tf.metrics", {"type": "metrics", "data": {"real_time_factor": 0.0}})
            await ctl.wait_for(lambda p: len(refusals(p)) >= 2, "two refusals", timeout=WAIT)
            assert refusals(ctl) == ["server_topic", "server_topic"]
            assert all("tf.metrics, tf.status are the server's" in detail for detail in refusal_details(ctl))
            # and counted for the operator, by reason (they were told and logged only)
            assert 'chunkline_room_refusals_total{reason="server_topic"} 2.0' in await served.metrics_text()
            # the viewer still sees the stream, and only the worker's status
            frames = len(viewer.frames())
            await viewer.wait_for(lambda p: len(p.frames()) > frames, "more frames", timeout=WAIT)
            spoofed = [m for m in viewer.texts() if m["type"] == "data" and m.get("from") != "chunkline-worker-0"
                       and m.get("topic") in ("tf.status", "tf.metrics")]
            assert spoofed == []
            assert (await served.get(created["session_id"]))["status"] == "running"


async def test_deep_json_on_the_room_socket_is_refused_and_the_controller_keeps_control() -> None:
    async with running_room() as (served, service, created, ctl):
        deep = "[" * 5000 + "]" * 5000  # within the size limit: refused for its depth
        await ctl.ws.send(deep)
        buried: object = 0
        for _ in range(MAX_JSON_DEPTH):  # inside the payload's own object: the payload is one level too deep
            buried = [buried]
        await ctl.ws.send(json.dumps({"topic": "tf.control", "payload": {"type": "control_state", "controls": ["w"], "x": buried}}))
        await ctl.ws.send('{"topic": "tf.control", "payload": "\\ud800"}')
        await ctl.ws.send('{"topic": "tf.control", "payload": ')
        await ctl.ws.send('{"payload": {"type": "stop"}}')
        await ctl.wait_for(lambda p: len(refusals(p)) >= 5, "five refusals", timeout=WAIT)
        assert refusals(ctl) == ["too_deep", "too_deep", "unencodable_text", "malformed_envelope", "malformed_envelope"]
        details = refusal_details(ctl)
        assert "levels deep" in details[0] and "lone surrogate" in details[2]
        # counted as the client wrote the payload, not with the envelope around it (it said "34 ...; at most 33")
        assert details[1] == f"JSON nested {MAX_JSON_DEPTH + 1} levels deep; at most {MAX_JSON_DEPTH} allowed", details[1]
        assert details[3].startswith("not valid JSON") and '{"topic": "<string>", "payload": <any JSON>}' in details[4]
        assert pipeline_controls(service) == []
        await ctl.control({"type": "control_state", "controls": ["a"]})  # the socket is still up and in control
        await wait_for_a_control(service)
        (session,) = service.sessions.values()
        assert session.held == {"a"}
        assert (await served.get(created["session_id"]))["status"] == "running"


async def test_an_envelope_that_tries_to_address_a_participant_is_refused_not_broadcast() -> None:
    """A client's ``to`` or ``destination_identities`` (LiveKit's way to send to one participant) was taken and
    ignored: the message meant for one went to the whole room, and the sender was told nothing."""
    async with running_room() as (served, service, created, ctl):
        token = await served.viewer_token(created["session_id"], "watcher")
        async with join(served, created["room"], token) as viewer:
            await viewer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
            control = {"type": "control_state", "controls": ["w"]}
            await ctl.ws.send(json.dumps({"topic": "tf.control", "payload": control, "destination_identities": ["x"]}))
            await ctl.ws.send(json.dumps({"topic": "chat", "payload": "psst", "to": "watcher", "reliable": True}))
            await ctl.wait_for(lambda p: len(refusals(p)) >= 2, "two refusals", timeout=WAIT)
            assert refusals(ctl) == ["malformed_envelope", "malformed_envelope"]
            first, second = refusal_details(ctl)
            assert "'destination_identities'" in first and "'reliable', 'to'" in second, (first, second)
            await ctl.control({"type": "control_state", "controls": ["a"]})  # a proper one passes, after them
            await wait_for_a_control(service)
            (session,) = service.sessions.values()
            assert len(pipeline_controls(service)) == 1 and session.held == {"a"}  # the refused "w" never came
            passed_on = [m["payload"] for m in viewer.texts() if m["type"] == "data" and m.get("from") == "ctl"]
            assert "psst" not in passed_on and all(p.get("controls") != ["w"] for p in passed_on if isinstance(p, dict))

async def test_a_room_holds_a_bounded_number_of_sockets() -> None:
    async with running_room() as (served, service, created, ctl):
        rooms = served.runtime.transport
        room = rooms._rooms[created["room"]]
        # fill the room to its bound with token-holding participants, then one more is refused; past a session's 32
        # viewer seats only tokens of another role fill it, which a holder of the key mints (the API makes none)
        issuer = served.runtime.issuer
        viewers = MAX_CLIENTS_PER_ROOM - 1  # the controller holds the first socket
        async with trio.open_nursery() as nursery:
            joined: list[object] = []
            all_joined = trio.Event()

            async def viewer(index: int, done: trio.Event) -> None:
                async with join(served, created["room"], issuer.controller_token(created["room"], f"v{index}")) as peer:
                    # "joined" is sent once the room holds the socket: the handshake has landed
                    await peer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
                    joined.append(peer)
                    if len(joined) == viewers:
                        all_joined.set()
                    await done.wait()

            done = trio.Event()
            for index in range(viewers):
                nursery.start_soon(viewer, index, done)
            with trio.fail_after(WAIT):
                await all_joined.wait()
            assert len(room.subscribers) == MAX_CLIENTS_PER_ROOM
            async with join(served, created["room"], issuer.controller_token(created["room"], "extra")) as extra:
                with trio.fail_after(WAIT):
                    await extra.reader_done.wait()
                assert [m for m in extra.texts()] == [{"type": "refused", "reason": "room_full",
                                                     "detail": "the room has as many participants as it takes"}]
            assert len(room.subscribers) == MAX_CLIENTS_PER_ROOM
            done.set()
