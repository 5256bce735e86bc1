"""Under plain ``hypercorn server:app`` a request body is due at the front's minimum rate for its declared length.

Without the front, the only deadline on a body was Quart's ``BODY_TIMEOUT``, set for the largest body the app takes:
522 s for any body, whatever its length. A create declaring 100,000 bytes and sent a byte every 5 s held its
connection for those 522 s, and 200 such connections all stayed open. Now the app gives a body with a declared length
the rule the front keeps (``longest_body_seconds``: the head's 10 s of grace, then the minimum rate), and answers 408
past it.
"""

from __future__ import annotations

import socket
import time

import pytest

from server.http_framing import longest_body_seconds
from server.room_socket import Deadlines

from .plain_hypercorn import plain_hypercorn

DECLARED = 1000  # bytes the request says its body has
TRICKLE = 2.0  # seconds between the client's bytes: a byte every 2 s is far below the minimum rate


def whole(answer: bytes) -> bool:
    """Whether ``answer`` holds a whole response: its head and as much body as it says."""
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    lines = head.lower().split(b"\r\n")
    lengths = [int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:")]
    length = lengths[0] if lengths else 0
    return len(body) >= length


@pytest.mark.parametrize("worker_class", ["trio", "asyncio"])
def test_a_body_far_below_the_minimum_rate_is_cut_within_its_own_deadline(worker_class: str) -> None:
    due = longest_body_seconds(DECLARED, Deadlines().head)
    with plain_hypercorn(worker_class) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {DECLARED}\r\n\r\n{{".encode())
        started = time.monotonic()
        sock.settimeout(TRICKLE)
        answer = b""
        while not whole(answer):
            waited = time.monotonic() - started
            assert waited < due + 20.0, f"no answer {waited:.0f} s into the body:\n{server.text()}"
            try:
                data = sock.recv(65536)
            except socket.timeout:
                sock.sendall(b" ")  # bench-cost: the attack is slowness in real time (one byte per TRICKLE)
                continue
            assert data, f"closed without an answer:\n{server.text()}"
            answer += data
        took = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"request_timeout" in answer, answer
    assert due - 1.0 < took < due + 10.0, f"408 after {took:.1f} s; due after {due:.1f} s"
