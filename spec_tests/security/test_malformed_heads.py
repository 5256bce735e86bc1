"""Request heads the front and hypercorn must read alike, through a real server (front, hypercorn, sockets).

hypercorn reads HTTP/1.1 with h11, which takes bare ``\\n`` line endings: the front waited for ``\\r\\n\\r\\n``,
so a head ending in ``\\n\\n`` got a 408 after the head's deadline instead of its answer. Now the front reads
every head with h11 too: such a head is answered at once (first on its connection or later, with a body or
not, a room's upgrade included), and a head h11 refuses is refused by the front with a 400
``malformed_request`` naming the fault; hypercorn answered those with an empty 400. A first byte that cannot
begin a request line (a TLS handshake on the plain port) is refused at once instead of at the deadline.
"""

from __future__ import annotations

import json
import re

import attrs
import pytest
import trio

from .test_hostile_server import FAST, WAIT, closed_by_server, json_answer, running

#: the head deadline is far longer than any answer here takes: an answer within it was not the 408
SLOW_HEAD = attrs.evolve(FAST, head=60.0, idle=120.0)


def _bodies(answer: bytes) -> list[bytes]:
    return re.findall(rb"\r\n\r\n(\{.*?\}\n?)(?=HTTP/1\.1 |$)", answer, re.DOTALL)


async def _exchange(request: bytes) -> bytes:
    """Send ``request`` on one connection and read until the server closes it, well within the head deadline."""
    async with running(deadlines=SLOW_HEAD) as server:
        async with await server.raw() as stream:
            await stream.send_all(request)
            with trio.fail_after(WAIT):  # the head deadline (60 s) would be the old 408
                return await closed_by_server(stream)


@pytest.mark.parametrize("request_bytes", [
    b"GET /v1/stream/health HTTP/1.1\nHost: x\nConnection: close\n\n",
    b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\nConnection: close\n\r\n",
    b"GET /v1/stream/health HTTP/1.1\nHost: x\n\nGET /v1/stream/health HTTP/1.1\nHost: x\nConnection: close\n\n",
    b"POST /v1/stream/sessions HTTP/1.1\nHost: x\nContent-Type: application/json\nContent-Length: 2\n"
    b"Connection: close\n\n{}",
], ids=["lf-only", "mixed-endings", "lf-keep-alive", "lf-with-body"])
async def test_a_head_with_bare_lf_line_endings_is_answered_at_once_as_hypercorn_reads_it(request_bytes: bytes) -> None:
    answer = await _exchange(request_bytes)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    expected = [b"400"] if b"POST" in request_bytes else [b"200"] * request_bytes.count(b"GET ")
    assert statuses == expected, answer
    if b"POST" in request_bytes:  # the body reached the app, framed by the length the front read
        assert json.loads(_bodies(answer)[0])["error"] == "invalid_field", answer


async def test_a_rooms_upgrade_with_bare_lf_line_endings_is_accepted() -> None:
    async with running(deadlines=SLOW_HEAD) as server:
        created = await server.session()
        target = f"{created['websocket_path']}?token={created['token']}".encode()
        upgrade = (b"GET " + target + b" HTTP/1.1\nHost: x\nUpgrade: websocket\nConnection: Upgrade\n"
                   b"Sec-WebSocket-Version: 13\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\n\n")
        async with await server.raw() as stream:
            await stream.send_all(upgrade)
            answer = b""
            with trio.fail_after(WAIT):
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(65536)
    assert answer.startswith(b"HTTP/1.1 101 "), answer


MALFORMED = [
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "multiple Host"),
    (b"GET / HTTP/1.1\r\n\r\n", "Missing mandatory Host"),
    (b"GET /\r\n\r\n", "illegal request line"),  # HTTP/0.9
    (b"GET /v1/stream/health\x00x HTTP/1.1\r\nHost: x\r\n\r\n", "illegal request line"),
    (b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n", "illegal request line"),
    (b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", "illegal request line"),
    (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", "illegal header line"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", "illegal header line"),
    (b"GET / HTTP/1.1\r\n folded\r\nHost: x\r\n\r\n", "continuation line"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n", "illegal header line"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n", "Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
    (b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n", "illegal request line"),
    (b" GET / HTTP/1.1\r\nHost: x\r\n\r\n", "illegal request line"),
]
IDS = ["two-hosts", "no-host", "http-0.9", "nul-in-path", "space-in-path", "bad-method", "space-before-colon",
       "no-colon", "continuation-first", "nul-in-value", "two-lengths", "negative-length", "blank-line-first",
       "space-first"]


@pytest.mark.parametrize(("request_head", "named"), MALFORMED, ids=IDS)
async def test_a_head_hypercorn_would_refuse_is_refused_by_the_front_saying_what_was_wrong(
    request_head: bytes, named: str
) -> None:
    answer = await _exchange(request_head)
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"] == "malformed_request" and named in body["detail"], body


@pytest.mark.parametrize(("request_head", "named"), MALFORMED[:4], ids=IDS[:4])
async def test_a_malformed_head_later_on_a_keep_alive_connection_is_refused_the_same_way(
    request_head: bytes, named: str
) -> None:
    async with running(deadlines=SLOW_HEAD) as server:
        async with await server.raw() as stream:
            await stream.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = await json_answer(stream)
            await stream.send_all(request_head)
            with trio.fail_after(WAIT):
                answer = await closed_by_server(stream)
    assert first.startswith(b"HTTP/1.1 200 "), first
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"] == "malformed_request" and named in body["detail"], body


async def test_a_tls_handshake_on_the_plain_port_is_refused_at_once() -> None:
    answer = await _exchange(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's first bytes
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == "malformed_request", answer


async def test_a_malformed_head_is_named_cut_short() -> None:
    answer = await _exchange(b"GET /" + b"a" * 12000 + b" \x00 HTTP/1.1\r\nHost: x\r\n\r\n")
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"] == "malformed_request" and "characters in all)" in body["detail"], body
    assert len(answer) < 1024, len(answer)
