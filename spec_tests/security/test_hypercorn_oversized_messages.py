"""Under plain ``hypercorn server:app``, a room client's WebSocket message past the size limit ends its connection.

hypercorn refused such a message with a 1009 close and went on reading the connection, keeping every later piece of
the message: one room client (any room token) that opened a text message and sent continuation pieces without end
grew the worker by about a byte for each byte it sent (2.3 GB in 8 s), and the connection stayed open for as long as
it sent. Now the pieces are dropped and the connection ends once the 1009 went out; the session goes on, and its
controller may join again.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import time

import httpx
import pytest

from .plain_hypercorn import plain_hypercorn

SENDING = 10.0  # seconds the client goes on sending pieces of its message, at most
PIECE = 65_000  # bytes of each continuation piece


def frame(data: bytes, opcode: int, fin: bool) -> bytes:
    """A client's frame (masked with a zero key, so the payload goes as is)."""
    first = (0x80 if fin else 0) | opcode
    size = len(data)
    if size < 126:
        head = struct.pack("!BB", first, 0x80 | size)
    elif size < 65536:
        head = struct.pack("!BBH", first, 0xFE, size)
    else:
        head = struct.pack("!BBQ", first, 0xFF, size)
    return head + b"\0\0\0\0" + data


def join(port: int, path: str, token: str) -> socket.socket:
    """A room connection by hand (the test sends frames no client library would), past its joined message."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET {path}?token={token} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    seen = b""
    while b'"joined"' not in seen:
        data = sock.recv(65536)
        assert data, f"the server closed the connection before the join: {seen!r}"
        seen += data
    return sock


def sends_until_closed(sock: socket.socket) -> tuple[bool, int]:
    """Open a text message and send pieces of it for up to SENDING seconds: (whether the server ended the connection,
    bytes sent)."""
    sock.sendall(frame(b'{"topic":"tf.control","payload":"', 1, False))
    piece = frame(b"a" * PIECE, 0, False)
    sent, give_up = 0, time.monotonic() + SENDING
    try:
        while time.monotonic() < give_up:
            sock.sendall(piece)
            sent += len(piece)
    except OSError:  # a broken pipe, or a reset: the server closed its end
        return True, sent
    return False, sent


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_message_past_the_limit_ends_the_connection_and_is_not_kept(worker_class: str) -> None:
    with plain_hypercorn(worker_class) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        created = client.post("/v1/stream/sessions", json={"identity": "ctl"}).json()
        with join(server.port, created["websocket_path"], created["token"]) as sock:
            closed, sent = sends_until_closed(sock)
        assert closed, f"the connection stayed open through {sent >> 20} MiB of one message:\n{server.text()}"
        assert sent < 256 << 20, f"{sent >> 20} MiB were read of the message before its connection ended"
        # the session goes on, and its controller joins again
        with join(server.port, created["websocket_path"], created["token"]):
            pass
        assert client.get(f"/v1/stream/sessions/{created['session_id']}").json()["status"] == "running"
