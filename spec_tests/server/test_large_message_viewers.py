"""One legal data message at the largest size allowed reaches every viewer; none is sent away ``too_slow`` for it.

``--max-data-message-bytes`` may be set up to 1 MiB, but a viewer's text backlog was a fixed 1 MiB
(``TEXT_BACKLOG_BYTES``) while the message the room forwards is its payload re-encoded in the room's framing (about 60
characters more, up to three times its bytes for text that is not ASCII): one such message sent every honest viewer
away. The backlog is now derived from the setting (``text_backlog_bytes``) and holds what the largest legal message
makes. Through the app's room sockets, a controller and a viewer that reads everything.
"""

from __future__ import annotations

import json

import pytest
import trio

from server.transport.local_room import TEXT_BACKLOG_BYTES, largest_fanned_out, text_backlog_bytes

from .runner_fixtures import CounterService, join, serve, settings

LIMIT = 1024 * 1024  # the largest --max-data-message-bytes allowed
WITHIN = 20.0  # seconds the wait for the message may take (woken by each arrival)


def payload_of(size: int, character: str) -> dict[str, str]:
    """A payload whose JSON, as the client writes it (UTF-8, not escaped), is exactly ``size`` bytes."""
    prefix = len(json.dumps({"note": ""}).encode())
    count = (size - prefix) // len(character.encode())
    payload = {"note": character * count + "x" * ((size - prefix) - count * len(character.encode()))}
    assert len(json.dumps(payload, ensure_ascii=False).encode()) == size
    return payload


@pytest.mark.parametrize("character", ["x", "\u00e9"], ids=["ascii", "two_byte_characters"])
async def test_one_message_of_the_largest_allowed_size_reaches_the_viewer_who_stays(character: str) -> None:
    service = CounterService(fps=2, frames_per_chunk=1, size=(8, 8))
    async with serve(settings(max_data_message_bytes=LIMIT), service) as served:
        created = await served.create("ctl")
        token = await served.viewer_token(created["session_id"], "viewer")
        async with join(served, created["room"], created["token"]) as ctl, \
                join(served, created["room"], token) as viewer:
            await ctl.wait_for(lambda p: "running" in p.stages(), "the session to run", timeout=WITHIN)
            payload = payload_of(LIMIT, character)
            await ctl.ws.send(json.dumps({"topic": "chat", "payload": payload}, ensure_ascii=False))
            with trio.fail_after(WITHIN):
                got = await viewer.wait_for(
                    lambda p: [m for m in p.texts() if m["type"] in ("refused",) or m.get("topic") == "chat"],
                    "the message or a refusal", timeout=WITHIN)
            assert [m.get("reason") for m in got if m["type"] == "refused"] == [], got[-1].get("reason")
            assert got[0]["payload"] == payload and got[0]["from"] == "ctl"
            assert (await served.get(created["session_id"]))["participant_count"] == 2


def test_the_backlog_holds_the_largest_legal_message_at_every_setting() -> None:
    """The bound follows the setting: whatever it is, twice what one legal message makes fits besides a burst, and
    the default keeps the documented 1 MiB."""
    assert text_backlog_bytes(12288) == TEXT_BACKLOG_BYTES
    for limit in (1024, 12288, 65536, 262144, LIMIT):
        assert text_backlog_bytes(limit) >= 2 * largest_fanned_out(limit) > 6 * limit
