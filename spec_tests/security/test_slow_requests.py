"""Slowloris past the first request head: a keep-alive connection's later heads and every request body are
bounded in time too (a head within ``Deadlines.head`` of its first byte, a body at a minimum rate), so a
client that trickles bytes cannot hold a connection -- and with 1024 of them the whole port -- for ever; and
the bodies still arriving on all connections together are bounded (``--max-body-bytes-in-flight``)."""

from __future__ import annotations

import json
import re

import pytest
import trio

from server.http_framing import MIN_UPLOAD_RATE, BodyBudget, FramingRefused, RequestFraming

from .test_hostile_server import FAST, WAIT, closed_by_server, json_answer, running

TRICKLE = 0.25  # seconds between the attacker's bytes: well inside the idle deadline, so it never goes idle


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
            assert (await json_answer(stream)).startswith(b"HTTP/1.1 200")
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


async def _response(stream: trio.SocketStream, received: bytes = b"") -> tuple[bytes, bytes]:
    """The head and body of the next final (non-1xx) response on ``stream`` (bounded), after ``received``."""
    with trio.fail_after(WAIT):
        while True:
            while b"\r\n\r\n" not in received:
                received += await stream.receive_some(65536)
            head, _, rest = received.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 1"):
                break
            received = rest  # an interim response (100 Continue)
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(rest) < length:
            rest += await stream.receive_some(65536)
    return head, rest[:length]


def _create_head(length: int, *, expect_continue: bool = False) -> bytes:
    return (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Expect: 100-continue\r\n" if expect_continue else b"")
            + b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


def _create_body(identity: str, length: int) -> bytes:
    body = json.dumps({"identity": identity}).encode()
    return body + b" " * (length - len(body))  # padded to the declared length with JSON whitespace


async def refused_for_the_budget(server: object, size: int) -> bytes:
    """A create of ``size`` bytes sent until the front answers its head with a 503 (the bytes another body sent
    have reached the front's budget by then: a bounded real-time poll); returns that answer."""
    with trio.fail_after(WAIT):
        while True:
            async with await server.raw() as probe:  # type: ignore[attr-defined]
                await probe.send_all(_create_head(size))
                with trio.move_on_after(0.2):  # a head that fits waits for its body: not refused, try again
                    answer = await closed_by_server(probe)
                    if answer.startswith(b"HTTP/1.1 503 "):
                        return answer
            await trio.sleep(0.05)  # bench-cost: real-time poll of the front's reading of another socket


async def test_bodies_past_the_fronts_budget_get_503_with_retry_after_and_change_nothing() -> None:
    """The bodies still arriving on all connections together are bounded: one that would take the total past
    ``--max-body-bytes-in-flight`` is refused before any of it reaches the app, and its room comes back as
    soon as the body holding it has arrived. Room is held by the bytes that came, not by a declared length."""
    size = 256 * 1024  # at the minimum rate the front waits 16 s for such a body: time for the rest of the test
    async with running(max_body_bytes=size, max_body_bytes_in_flight=size + size // 2) as server:
        async with await server.raw() as holder:
            await holder.send_all(_create_head(size, expect_continue=True))
            with trio.fail_after(WAIT):  # hypercorn's 100 Continue: the front passed the head
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await holder.receive_some(65536)
            assert received.startswith(b"HTTP/1.1 100 "), received
            async with await server.raw() as declared:  # a head alone holds no room: this one is not refused
                await declared.send_all(_create_head(size))
                with trio.move_on_after(0.5):
                    assert await closed_by_server(declared) == b"", "a declared length held room"
            body = _create_body("holder", size)
            await holder.send_all(body[: size - 1024])  # most of it: now it holds that much of the budget
            answer = await refused_for_the_budget(server, size)
            head, _, error_body = answer.partition(b"\r\n\r\n")
            assert b"\r\nRetry-After: 5" in head, head
            error = json.loads(error_body)
            assert error["error"] == "bodies_in_flight"
            assert "too many request bodies at once" in error["detail"], error
            status, listed = await server.request("GET", "/v1/stream/sessions")
            assert status == 200 and listed["sessions"] == []  # the refused request changed nothing
            await holder.send_all(body[size - 1024 :])
            head, body = await _response(holder, received.partition(b"\r\n\r\n")[2])
            assert head.startswith(b"HTTP/1.1 200 "), (head, body)
            assert (await server.request("DELETE", f"/v1/stream/sessions/{json.loads(body)['session_id']}"))[0] == 200
        async with await server.raw() as after:  # the holder's body arrived: its room is free again
            await after.send_all(_create_head(size) + _create_body("after", size))
            head, body = await _response(after)
        assert head.startswith(b"HTTP/1.1 200 "), (head, body)


def test_a_body_takes_room_as_it_arrives_and_gives_it_back_when_it_has_passed_or_its_connection_ends() -> None:
    budget = BodyBudget(3000, max_body=2000)
    first = RequestFraming(head_seconds=1.0, max_head=16384, budget=budget)
    first.feed(_create_head(5000), 0.0)
    assert budget.in_flight == 0  # a declared length holds nothing: idle declarations filled the budget
    first.feed(b"x" * 2500, 0.0)
    assert budget.in_flight == 2000  # no more than the app reads: a longer body is refused (413) unread
    second = RequestFraming(head_seconds=1.0, max_head=16384, budget=budget)
    second.feed(_create_head(1000) + b"y" * 400, 0.0)
    assert budget.in_flight == 2400
    with pytest.raises(FramingRefused) as refused:  # would not fit in what is left now
        RequestFraming(head_seconds=1.0, max_head=16384, budget=budget).feed(_create_head(601), 0.0)
    assert (refused.value.status, refused.value.retry_after, budget.in_flight) == (503, 5, 2400)
    third = RequestFraming(head_seconds=1.0, max_head=16384, budget=budget)
    third.feed(_create_head(600) + b"z" * 500, 0.0)  # fits as it starts
    second.feed(b"y" * 100, 0.0)  # meanwhile the second one took room too: the third outgrows what is left
    with pytest.raises(FramingRefused) as outgrown:
        third.feed(b"z" * 100, 0.0)
    assert outgrown.value.status == 503 and "outgrew the room left" in outgrown.value.detail
    third.release()
    second.feed(b"y" * 500 + _create_head(10), 0.0)  # its body passed; the next request's is under way
    assert budget.in_flight == 2000
    first.release()  # its connection ended mid-body
    second.release()
    assert budget.in_flight == 0


def test_a_body_must_keep_up_the_minimum_rate_not_only_arrive_whole_in_time() -> None:
    framing = RequestFraming(head_seconds=10.0, max_head=16384)
    framing.feed(_create_head(8 * 1024 * 1024), 0.0)
    assert framing.due == 10.0  # nothing of it yet: its first bytes are due within the head's deadline
    framing.feed(b" ", 9.0)
    assert framing.due == pytest.approx(10.0 + 1 / MIN_UPLOAD_RATE)  # one byte buys 1/16384 s, not minutes
    framing.feed(b" " * MIN_UPLOAD_RATE * 4, 12.0)
    assert framing.due == pytest.approx(14.0 + 1 / MIN_UPLOAD_RATE)


def test_quarts_own_body_timeout_never_cuts_a_body_that_keeps_the_minimum_rate() -> None:
    """Quart cut every body at 60 s (a 408): a 1.25 MB create at 20 KiB/s, above the front's minimum rate, lost
    it at 98 %. The app's timeout is now the time the largest body it takes may take at that rate."""
    from server.app import create_app
    from server.settings import ServerSettings

    app = create_app(ServerSettings(pipeline="pipelines/replay", max_body_bytes=8 * 1024 * 1024))
    assert app.config["BODY_TIMEOUT"] == 10.0 + 8 * 1024 * 1024 / MIN_UPLOAD_RATE  # 522 s
