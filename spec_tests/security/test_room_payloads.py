"""What a room hub passes on of a client's data message: the payload a client wrote is opaque to the hub,
and whatever it holds, every other participant gets a message it can parse and the server goes on.

A controller's payload given as a JSON *string* passes the envelope's checks (one level deep); the hub
read it again for its fan-out with plain ``json.loads``, so 2 KB of nested brackets raised
``RecursionError`` and ended the whole server, and ``NaN`` or ``1e400`` reached viewers as invalid JSON.
"""

from __future__ import annotations

from typing import Any

import pytest

from spec_tests.server.runner_fixtures import Peer, join

from .test_hostile_rooms import refusals
from .test_tokens_transport import WAIT, pipeline_controls, running_room, wait_for_a_control


def data_from(peer: Peer, sender: str, topic: str) -> list[Any]:
    return [m["payload"] for m in peer.texts() if m["type"] == "data" and m.get("from") == sender and m["topic"] == topic]


@pytest.mark.parametrize("topic", ["tf.control", "chat"])
async def test_a_string_payload_of_deeply_nested_json_is_passed_on_as_text_and_the_server_goes_on(topic: str) -> None:
    nested = "[" * 1000 + "]" * 1000  # 2,000 bytes: far inside the size limit
    async with running_room() as (served, service, created, ctl):
        token = await served.viewer_token(created["session_id"], "watcher")
        async with join(served, created["room"], token) as viewer:
            await viewer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
            await ctl.send(topic, nested)
            got = await viewer.wait_for(lambda p: data_from(p, "ctl", topic), "the payload", timeout=WAIT)
            assert got == [nested]  # as the text it was: the hub never parsed it as JSON
            if topic == "tf.control":
                rejected = await ctl.wait_for(lambda p: p.status("control_rejected"), "a rejection", timeout=WAIT)
                assert rejected[0]["reason"] == "invalid_json"
            assert refusals(ctl) == []
            # the server goes on: the controller still controls, the session runs, the API answers
            await ctl.control({"type": "control_state", "controls": ["a"]})
            await wait_for_a_control(service)
            assert pipeline_controls(service)
            assert (await served.get(created["session_id"]))["status"] == "running"


@pytest.mark.parametrize("text", ["NaN", "-Infinity", "1e400", '{"type": "delivery_ack", "received_frames": 1e999}'])
async def test_a_payload_that_is_not_json_everywhere_reaches_others_as_text(text: str) -> None:
    async with running_room() as (served, service, created, ctl):
        token = await served.viewer_token(created["session_id"], "watcher")
        async with join(served, created["room"], token) as viewer:
            await viewer.wait_for(lambda p: any(m["type"] == "joined" for m in p.texts()), "joined", timeout=WAIT)
            await ctl.send("chat", text)
            got = await viewer.wait_for(lambda p: data_from(p, "ctl", "chat"), "the payload", timeout=WAIT)
            assert got == [text]  # a string (the hub made neither NaN nor Infinity of it)


async def test_a_number_too_large_for_a_float_is_rejected_by_name() -> None:
    async with running_room() as (served, service, created, ctl):
        await ctl.send("tf.control", '{"type": "control_state", "controls": ["w"], "x": 1e400}')
        rejected = await ctl.wait_for(lambda p: p.status("control_rejected"), "a rejection", timeout=WAIT)
        assert rejected[0]["reason"] == "invalid_json"
        assert "1e400" in rejected[0]["detail"] and "too large" in rejected[0]["detail"]
        assert pipeline_controls(service) == []

