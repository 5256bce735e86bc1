"""Every spelling of a room's WebSocket path is served by the front's room socket (with its bounds), never by
hypercorn's WebSocket behind it (no write or pong deadline): the app's router merges repeated slashes, so
``//v1/rooms/{room}/ws`` reached a room through hypercorn. Any other WebSocket upgrade is a 404, and a
handshake that is not one is answered with the reason (it was closed with no answer at all)."""

from __future__ import annotations

import json

import pytest
import trio

from .test_hostile_server import WAIT, closed_by_server, handshake, running, send_endless_message


@pytest.mark.parametrize("spelling", ["//v1/rooms/{room}/ws", "/v1//rooms/{room}/ws", "/v1/rooms/{room}//ws"])
async def test_an_endless_message_on_any_spelling_of_the_room_path_is_cut_at_the_limit(spelling: str) -> None:
    async with running() as server:
        created = await server.session()
        async with await server.raw() as stream:
            with trio.fail_after(WAIT):
                await handshake(stream, spelling.format(room=created["room"]) + f"?token={created['token']}")
            sent = await send_endless_message(stream)
        assert sent < 4 * 1024 * 1024, f"the server kept reading {sent} bytes of one message"


async def test_a_websocket_upgrade_anywhere_else_is_a_404_from_the_front() -> None:
    async with running() as server:
        async with await server.raw() as stream:
            await stream.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                                  b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                  b"Sec-WebSocket-Version: 13\r\n\r\n")
            answer = await closed_by_server(stream)
        assert answer.startswith(b"HTTP/1.1 404"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == "not_found", answer
        assert b"hypercorn" not in answer.lower(), answer
        assert (await server.request("GET", "/v1/stream/health"))[0] == 200
        await trio.lowlevel.checkpoint()


UPGRADE = (b"Host: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Sec-WebSocket-Version: 13\r\n")


@pytest.mark.parametrize(("request_head", "status", "named"), [
    (b"GET /v1/rooms/r/ws HTTP/1.1\r\n" + UPGRADE.replace(b"Version: 13", b"Version: 8") + b"\r\n", 426, b"Version"),
    (b"GET /v1/rooms/r/ws HTTP/1.1\r\n" + UPGRADE.replace(b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", b"")
     + b"\r\n", 400, b"Sec-WebSocket-Key"),
    (b"POST /v1/rooms/r/ws HTTP/1.1\r\n" + UPGRADE + b"Content-Length: 0\r\n\r\n", 400, b"GET"),
], ids=["version-8", "no-key", "post"])
async def test_a_handshake_that_is_not_one_is_answered_with_the_reason(request_head: bytes, status: int, named: bytes) -> None:
    async with running() as server:
        async with await server.raw() as stream:
            await stream.send_all(request_head)
            answer = await closed_by_server(stream)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert json.loads(body)["error"] == "bad_websocket_handshake" and named in body, answer
    if status == 426:
        assert b"\r\nSec-WebSocket-Version: 13" in head, answer  # the version this server speaks
        # the version asked for is named (wsproto's own words called the field missing)
        assert b"asked for version '8'" in body and b"Missing" not in body, answer
