"""Slowloris past the first request head: a keep-alive connection's later heads and every request body are
bounded in time too (a head within ``Deadlines.head`` of its first byte, a body at a minimum rate), so a
client that trickles bytes cannot hold a connection -- and with 1024 of them the whole port -- for ever."""

from __future__ import annotations

import re

import trio

from .test_hostile_server import FAST, WAIT, closed_by_server, running

TRICKLE = 0.25  # seconds between the attacker's bytes: well inside the idle deadline, so it never goes idle


async def _answer(stream: trio.SocketStream) -> bytes:
    """One whole response to a health request (its JSON body ends the read)."""
    received = b""
    with trio.fail_after(WAIT):
        while not received.endswith(b"}\n"):
            received += await stream.receive_some(65536)
    return received


async def _trickle(stream: trio.SocketStream, data: bytes) -> float:
    """Send ``data`` a byte at a time until the server closes; returns how long the server took."""
    started = trio.current_time()
    with trio.fail_after(WAIT):
        try:
            for byte in data:
                await stream.send_all(bytes([byte]))
                await trio.sleep(TRICKLE)  # bench-cost: the attack is slowness in real time
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    return trio.current_time() - started


async def test_a_later_head_on_a_keep_alive_connection_is_timed_out_too() -> None:
    async with running() as server:
        async with await server.raw() as stream:
            await stream.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _answer(stream)).startswith(b"HTTP/1.1 200")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_trickle, stream, b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n" + b"X" * 200)
                answer = await closed_by_server(stream)
                nursery.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert (await server.request("GET", "/v1/stream/health"))[0] == 200


async def test_a_body_trickled_slower_than_the_minimum_rate_is_cut() -> None:
    async with running() as server:
        body = b'{"identity": "slow", "prompt": "' + b"p" * 400 + b'"}'
        async with await server.raw() as stream:
            await stream.send_all(b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_trickle, stream, body)
                answer = await closed_by_server(stream)
                nursery.cancel_scope.cancel()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert trio.current_time() - started < FAST.head + 5.0
        status, listed = await server.request("GET", "/v1/stream/sessions")
        assert status == 200 and listed["sessions"] == []  # nothing was created from the cut request


async def test_what_the_front_cannot_bound_is_refused_and_an_honest_keep_alive_client_is_served() -> None:
    async with running() as server:
        for request, status in [
            (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n", b"411"),
            (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", b"400"),
            (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", b"400"),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"505"),
        ]:
            async with await server.raw() as stream:
                await stream.send_all(request)
                answer = await closed_by_server(stream)
            assert answer.startswith(b"HTTP/1.1 " + status), (request, answer)
        # three requests on one connection, two of them pipelined with bodies: all answered in order
        body = b'{"identity": "keep"}'
        post = (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        async with await server.raw() as stream:
            await stream.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n" + post + post)
            received = b""
            with trio.fail_after(WAIT):
                while len(re.findall(rb"HTTP/1\.1 \d{3} ", received)) < 3 or not received.endswith(b"}"):
                    received += await stream.receive_some(65536)
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200", b"200", b"429"], received  # one slot
