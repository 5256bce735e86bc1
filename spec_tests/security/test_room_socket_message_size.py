"""A room socket's size cut counts a message as its client may legally send it: with JSON's escapes.

The front closed a room socket (1009) at ``--max-data-message-bytes`` plus the envelope, counted as the bytes sent,
while the room counts the message as compact UTF-8 JSON: a prompt of 1,500 emoji, as Python's ``json.dumps`` writes
it by default (18 KB with its ``\\uXXXX`` escapes, 6 KB as compact UTF-8, so within the limit), cost the controller
its socket. A real server, real sockets.
"""

from __future__ import annotations

from typing import Any

import trio

from .test_hostile_server import WAIT, running


async def test_a_message_sent_with_jsons_escapes_passes_the_room_socket() -> None:
    async with running(pipeline="pipelines/toy_world") as server:  # a pipeline that takes prompts
        created = await server.session()
        controller = await server.room(created)  # it writes JSON as json.dumps does by default
        try:
            prompt = "\U0001f600" * 1500
            await controller.send_json({"topic": "tf.control", "payload": {"type": "prompt", "prompt": prompt}})
            await controller.send_json({"topic": "tf.control", "payload": {"type": "no_such_control"}})
            with trio.fail_after(WAIT):
                while (rejected := status(await controller.receive(), "control_rejected")) is None:
                    pass
        finally:
            await controller.aclose()
    # the prompt was taken (nothing was said of it), and the socket read on to the next message
    assert rejected["reason"] == "unknown_type", rejected


def status(message: Any, kind: str) -> dict[str, Any] | None:
    """``message``'s status payload when it is a ``kind`` status; fails the test once the server closed the socket."""
    assert message is not None, "the server closed the controller's socket"
    if isinstance(message, dict) and message.get("topic") == "tf.status" and message["payload"].get("type") == kind:
        return message["payload"]
    return None
