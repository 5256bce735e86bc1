"""A refusal the client can read: the front's lingering close, through the real served front.

A client that sends its head and body in one go is often refused (413, 503 ``bodies_in_flight``, 400, ...)
while much of its body is still on its way. Closing with those bytes unread makes the kernel answer with a
reset, and the client's kernel then throws away the answer it had not read yet. So the front shuts its write
side after the answer and reads and discards what still comes -- at most ``LINGER_BYTES`` (or the declared
length), within ``Deadlines.linger`` -- before it closes: the answer arrives whole, and a client that keeps
trickling bytes after it is cut off at the deadline all the same.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import trio

from server.front import LINGER_BYTES

from .test_hostile_server import FAST, WAIT, running
from .test_slow_requests import refused_for_the_budget

BODY = 1024 * 1024  # a body far larger than what the front has read when it refuses: most of it is unread then


def _head(length: int, *, expect_continue: bool = False) -> bytes:
    return (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Expect: 100-continue\r\n" if expect_continue else b"")
            + b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=WAIT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _send_and_read(host: str, port: int, request: bytes) -> bytes:
    """Send ``request`` whole in one go (a blocking client, as curl or requests would), then read to the close.

    A reset -- what the client gets when the server closes with its bytes unread -- raises here."""
    with _connect(host, port) as sock:
        sock.sendall(request)  # the server answers once it has the head: this completes only if it reads on
        received = b""
        while data := sock.recv(65536):
            received += data
        return received


def _answer(received: bytes) -> tuple[bytes, dict[str, str]]:
    head, _, body = received.partition(b"\r\n\r\n")
    return head, json.loads(body)


async def test_a_413_sent_with_its_whole_body_in_one_go_is_read_by_the_client() -> None:
    async with running(max_body_bytes=1024) as server:
        for _ in range(3):  # every time, not once by luck
            request = _head(BODY) + b" " * BODY
            received = await trio.to_thread.run_sync(_send_and_read, server.host, server.port, request)
            head, error = _answer(received)
            assert head.startswith(b"HTTP/1.1 413 "), received[:300]
            assert error["error"] == "request_entity_too_large", error
        assert (await server.request("GET", "/v1/stream/sessions"))[1]["sessions"] == []


async def test_a_503_for_the_body_budget_sent_with_its_whole_body_is_read_by_the_client() -> None:
    size = 256 * 1024
    async with running(max_body_bytes=size, max_body_bytes_in_flight=size + size // 2) as server:
        async with await server.raw() as holder:  # holds its room in the budget while the refused one arrives
            await holder.send_all(_head(size, expect_continue=True))
            with trio.fail_after(WAIT):
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await holder.receive_some(65536)
            assert received.startswith(b"HTTP/1.1 100 "), received
            await holder.send_all(b" " * (size - 1024))  # room is held by the bytes that came: most of its body
            await refused_for_the_budget(server, size)  # the front has taken them
            for _ in range(3):  # every time, not once by luck
                request = _head(size) + b" " * size
                received = await trio.to_thread.run_sync(_send_and_read, server.host, server.port, request)
                head, error = _answer(received)
                assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 5" in head, received[:300]
                assert error["error"] == "bodies_in_flight", error
        assert (await server.request("GET", "/v1/stream/sessions"))[1]["sessions"] == []


def _trickle_after_refusal(host: str, port: int, request: bytes) -> tuple[bytes, float]:
    """Send ``request``, read the answer to its end (the server's write side shut), then keep sending a byte
    every 0.1 s until the server is gone; returns the answer and when sending failed."""
    with _connect(host, port) as sock:
        sock.sendall(request)
        received = b""
        while data := sock.recv(65536):
            received += data
        try:
            for _ in range(int(WAIT / 0.1)):
                sock.sendall(b" ")
                time.sleep(0.1)  # bench-cost: the attack is slowness in real time
        except OSError:  # the server closed: the next byte drew a reset
            return received, time.monotonic()
        raise AssertionError("the server kept reading a trickle past its lingering deadline")


@pytest.mark.parametrize(("request_head", "status"), [
    (_head(BODY), b"413"),  # the app's refusal, passed on by the front
    (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"411"),  # the front's
], ids=["413-from-the-app", "411-from-the-front"])
async def test_a_client_trickling_after_its_refusal_is_cut_off_at_the_lingering_deadline(
    request_head: bytes, status: bytes
) -> None:
    async with running(max_body_bytes=1024) as server:
        started = time.monotonic()
        received, cut = await trio.to_thread.run_sync(
            _trickle_after_refusal, server.host, server.port, request_head + b" " * 4096)
        assert received.startswith(b"HTTP/1.1 " + status + b" "), received[:300]
        # read on after the answer (closing at once cuts a client off within a round trip), but only until the
        # lingering deadline, not for the time its declared body would take
        assert FAST.linger <= cut - started < FAST.linger + 5.0, cut - started
        assert (await server.request("GET", "/v1/stream/health"))[0] == 200


def _blast_after_refusal(host: str, port: int, request: bytes) -> tuple[bytes, int]:
    """Send ``request``, read its answer, then send as fast as the server takes it until it is gone; returns
    the answer and how many bytes went after it."""
    with _connect(host, port) as sock:
        sock.sendall(request)
        received = b""
        while data := sock.recv(65536):
            received += data
        sent, block = 0, b" " * 65536
        try:
            while sent < 1024 * LINGER_BYTES:
                sock.sendall(block)
                sent += len(block)
        except OSError:
            return received, sent
        raise AssertionError("the server read without bound after its refusal")


async def test_what_the_front_reads_after_a_refusal_is_bounded_in_bytes_too() -> None:
    """A malformed Content-Length says nothing of how much is coming: at most ``LINGER_BYTES`` are read (plus
    what the sockets' buffers hold), however fast they come -- the deadline alone would let gigabytes in."""
    async with running() as server:
        request = b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n"
        received, sent = await trio.to_thread.run_sync(_blast_after_refusal, server.host, server.port, request)
        assert received.startswith(b"HTTP/1.1 400 "), received[:300]
        assert sent < LINGER_BYTES + 64 * 1024 * 1024, sent
