"""What a client may ask of HTTP/1.1 beyond plain requests, through a real server (front, hypercorn, sockets).

- ``Connection: close`` (and HTTP/1.0) is honoured at once: hypercorn closed such a connection from inside
  the app's last send, which quart-trio had just cancelled, so the connection stayed open until hypercorn's
  30 s read timeout (a client reading to the end waited that long, and the server held it as long);
- ``Upgrade: h2c`` is ignored (the answer is HTTP/1.1): hypercorn switched the connection to HTTP/2, whose
  streams the front cannot frame, so one connection carried any number of requests and bodies past the
  connection cap and the body budget;
- a WebSocket upgrade after a connection's first request is served by the front as the room's socket once the
  requests before it are answered (it reached hypercorn's WebSocket, which bounds neither messages nor writes nor
  pongs; then it was refused ``websocket_not_first``, which a client keeping its connections met on every join);
- every refusal of the front says what was wrong, not only its status line.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from .test_hostile_server import FAST, WAIT, closed_by_server, json_answer, running

#: a connection never idles out during these tests: what closes it is the request itself
NO_IDLE = attrs.evolve(FAST, idle=600.0)
assert WAIT < 30  # hypercorn's read timeout, which closed a Connection: close request before the fix


def _json_body(answer: bytes) -> dict[str, str]:
    return json.loads(answer.partition(b"\r\n\r\n")[2])  # type: ignore[no-any-return]


@pytest.mark.parametrize("request_head", [
    b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v1/stream/health HTTP/1.0\r\n\r\n",
    b"GET /v1/stream/no-such-route HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\n\r\n{}",
], ids=["close", "http-1.0", "close-404", "close-400-with-body"])
async def test_a_request_asking_for_close_is_answered_and_its_connection_closed(request_head: bytes) -> None:
    async with running(deadlines=NO_IDLE) as server:
        async with await server.raw() as stream:
            await stream.send_all(request_head)
            answer = await closed_by_server(stream)  # within WAIT, far inside the idle deadline
        assert re.match(rb"HTTP/1\.1 (200|404|400) ", answer), answer
        assert _json_body(answer)


async def test_an_h2c_upgrade_is_answered_in_http_1_1_on_every_request_of_a_connection() -> None:
    upgrade = (b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
               b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    async with running() as server:
        async with await server.raw() as stream:
            await stream.send_all(upgrade + upgrade.replace(b"Connection: Upgrade", b"Connection: close, Upgrade"))
            answer = await closed_by_server(stream)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"200", b"200"], answer  # no 101, no HTTP/2 frames


async def joined(stream: trio.SocketStream, ws: WSConnection) -> dict[str, Any]:
    """The room's first message to a socket that was let in: ``joined``."""
    with trio.fail_after(WAIT):
        while True:
            ws.receive_data(await stream.receive_some(65536))
            for event in ws.events():
                if isinstance(event, TextMessage):
                    return json.loads(event.data)  # type: ignore[no-any-return]


@pytest.mark.parametrize("pipelined", [False, True], ids=["after-its-answer", "pipelined"])
async def test_a_websocket_upgrade_after_other_requests_opens_the_room_once_they_are_answered(pipelined: bool) -> None:
    """A client library that keeps its connections (aiohttp's session) opens a room's socket on the connection its
    create went over: it was refused ``websocket_not_first``, and the session it had just made held its slot. The
    front now answers the requests before it, then serves the upgrade as the room's socket (never hypercorn's
    WebSocket, which bounds neither messages nor writes nor pongs)."""
    async with running() as server:
        created = await server.session()
        target = f"{created['websocket_path']}?token={created['token']}"
        health = b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n"
        async with await server.raw() as stream:
            ws = WSConnection(ConnectionType.CLIENT)
            upgrade = ws.send(Request(host="x", target=target))
            if pipelined:
                await stream.send_all(health + upgrade)
            else:
                await stream.send_all(health)
                assert (await json_answer(stream)).startswith(b"HTTP/1.1 200 ")
                await stream.send_all(upgrade)
            received = b""
            with trio.fail_after(WAIT):
                while b"HTTP/1.1 101 " not in received:
                    received += await stream.receive_some(65536)
            answer, _, switched = received.partition(b"HTTP/1.1 101 ")
            if pipelined:
                assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"}\n"), answer  # its answer first
            ws.receive_data(b"HTTP/1.1 101 " + switched)
            assert any(isinstance(event, AcceptConnection) for event in ws.events())
            assert (await joined(stream, ws))["type"] == "joined"
            status, record = await server.request("GET", f"/v1/stream/sessions/{created['session_id']}")
            assert status == 200 and record["participant_count"] == 1, record


@pytest.mark.parametrize(("request_head", "status", "named"), [
    (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"411", "Content-Length"),
    (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n", b"400", "Content-Length"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"505", "HTTP/1.1"),
], ids=["transfer-encoding", "two-lengths", "http2-prior-knowledge"])
async def test_a_front_refusal_says_what_was_wrong(request_head: bytes, status: bytes, named: str) -> None:
    async with running() as server:
        async with await server.raw() as stream:
            await stream.send_all(request_head)
            answer = await closed_by_server(stream)
    assert answer.startswith(b"HTTP/1.1 " + status), answer
    assert named in _json_body(answer)["detail"], answer
