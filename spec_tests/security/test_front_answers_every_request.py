"""Every request the front accepts is answered: a burst larger than hypercorn's listen queue, a request hypercorn
can no longer take, and a body cut short each get an HTTP answer with the API's error body, never a connection
closed in silence (a real server in-process, real sockets)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from server.front import Front

from .test_hostile_server import FAST, WAIT, closed_by_server, json_answer, running

HEALTH = b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def test_a_burst_past_hypercorns_old_listen_queue_is_answered_in_full() -> None:
    """300 requests at once, each on its own connection: every one is answered 200. Behind hypercorn's default
    listen queue of 100 connects, about a third of such a burst was closed unanswered. (The head and idle deadlines
    are long here: on a loaded host the last of the burst waits seconds for its answer.)"""
    async with running(attrs.evolve(FAST, head=WAIT, idle=WAIT)) as server:
        streams = [await server.raw() for _ in range(300)]
        answers: list[bytes] = []

        async def ask(stream: trio.SocketStream) -> None:
            await stream.send_all(HEALTH)
            answers.append(await closed_by_server(stream))
            await stream.aclose()

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                for stream in streams:
                    nursery.start_soon(ask, stream)
        lines = sorted({answer.split(b"\r\n", 1)[0] for answer in answers})
        assert lines == [b"HTTP/1.1 200 "], f"status lines: {lines}"
        assert len(answers) == 300


async def test_a_body_cut_short_is_answered_400_naming_what_is_missing() -> None:
    """A client that declares 100 bytes of body, sends 20 and stops sending: the front's 400 with the API's error
    body (hypercorn's own 400 had an empty body)."""
    async with running() as server:
        stream = await server.raw()
        body = b'{"identity": "short"}'
        await stream.send_all(b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n" + body)
        await stream.send_eof()
        head, _, answer = (await closed_by_server(stream)).partition(b"\r\n\r\n")
        await stream.aclose()
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert json.loads(answer) == {"error": "incomplete_body", "detail": f"the request body ended {100 - len(body)} "
                                      "byte(s) short of its Content-Length"}


async def test_a_bug_met_serving_one_connection_ends_that_connection_not_the_server(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error in the front's handling of one connection (here its head's parsing fails, as a bug would
    make it) closed every client's server with it: that connection ends, logged with its traceback, and the others
    are served on."""
    import server.front

    parse_head = server.front.parse_head

    def failing_for_one_path(raw: bytes) -> object:
        if raw.startswith(b"GET /meets-the-bug "):
            raise RuntimeError("a bug in the front")
        return parse_head(raw)

    monkeypatch.setattr(server.front, "parse_head", failing_for_one_path)
    async with running() as server_:
        stream = await server_.raw()
        await stream.send_all(b"GET /meets-the-bug HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await closed_by_server(stream) == b""
        await stream.aclose()
        assert (await server_.request("GET", "/v1/stream/health"))[0] == 200
    (line,) = [record for record in caplog.records if "unexpected error" in record.getMessage()]
    assert line.exc_info is not None and "a bug in the front" in str(line.exc_info[1])


MUTE_CHECK_PIPELINE = '''
import trio

from pipelines.replay import ReplayService


class MuteCheck(ReplayService):
    """Its option check never answers: a create with options waits for the server's own 10 s deadline."""

    async def check_options(self, options):
        await trio.sleep_forever()


def get_service(gpu_num=0, **offered):
    return MuteCheck(gpu_num=gpu_num)
'''


async def test_a_request_owed_its_answer_past_the_idle_deadline_is_answered_504_not_closed(tmp_path: Path) -> None:
    """The connection's idle deadline (3 s here) passes while the app still works on a whole request (a create whose
    options check takes up to 10 s): the client is answered 504 ``answer_timeout``; it got a connection closed with
    no answer at all. A connection idle after its answer is still closed in silence."""
    pipeline = tmp_path / "mute_check.py"
    pipeline.write_text(MUTE_CHECK_PIPELINE)
    async with running(pipeline=str(pipeline)) as server:
        stream = await server.raw()
        body = b'{"identity": "ctl", "config": {"fps": 24}}'
        await stream.send_all(b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head, _, answer = (await closed_by_server(stream)).partition(b"\r\n\r\n")
        await stream.aclose()
        assert head.startswith(b"HTTP/1.1 504 "), head
        assert json.loads(answer) == {"error": "answer_timeout", "detail": f"the server did not answer within "
                                      f"{FAST.idle:g} s"}
        idle = await server.raw()  # answered, then silent: the client's turn, and it says nothing
        await idle.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await closed_by_server(idle)  # its answer, then the close at the idle deadline
        assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1 ") == 1, got
        await idle.aclose()


async def test_pipelined_requests_owed_their_answers_past_the_idle_deadline_are_each_answered_504(tmp_path: Path) -> None:
    """Two creates sent at once on one connection, neither answered within the idle deadline (the options check
    never answers): each is answered 504, the last closing the connection; only one was, and the other's client
    waited on a closed connection for an answer that never came."""
    pipeline = tmp_path / "mute_check.py"
    pipeline.write_text(MUTE_CHECK_PIPELINE)
    async with running(pipeline=str(pipeline)) as server:
        stream = await server.raw()
        body = b'{"identity": "ctl", "config": {"fps": 24}}'
        create = (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await stream.send_all(create * 2)
        got = answers(await closed_by_server(stream))
        await stream.aclose()
    assert [status for status, _ in got] == [504, 504], got
    assert all(json.loads(answer)["error"] == "answer_timeout" for _, answer in got), got


def answers(raw: bytes) -> list[tuple[int, bytes]]:
    """The responses in ``raw``, in order, as (status, body): each whole by its Content-Length, or the test fails."""
    found = []
    while raw:
        head, separator, rest = raw.partition(b"\r\n\r\n")
        assert separator, f"a response head cut short: {raw[:200]!r}"
        lines = head.split(b"\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:"))
        assert len(rest) >= length, f"a body cut short: {length} bytes declared, {len(rest)} came: {raw[:300]!r}"
        found.append((int(lines[0].split()[1]), rest[:length]))
        raw = rest[length:]
    return found


HEALTH_11 = b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n"


def create_request(identity: str, *, close: bool = False) -> bytes:
    body = json.dumps({"identity": identity}).encode()
    return (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"") + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize(("sent", "statuses"), [
    (b"GET /v1/stream/health HTTP/1.0\r\n\r\n", [200]),
    (b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", [200]),
    (HEALTH_11, [200]),
    (HEALTH_11 * 3, [200, 200, 200]),
    (create_request("half-closed"), [200]),
], ids=["http-1.0", "connection-close", "keep-alive", "three-pipelined", "create"])
async def test_a_client_that_half_closes_after_its_requests_gets_every_answer_whole(
    sent: bytes, statuses: list[int]
) -> None:
    """A client that shuts its write side once its requests are sent (``nc -N``, ``printf ... | nc -q``) is done
    sending, not gone: each request is answered in full, then the connection closes. The front passed the EOF on to
    hypercorn, which took it for a client gone: a 503 ``busy`` for every HTTP/1.0 or ``Connection: close`` request
    (a create never made), a 200 without its body, or answers missing."""
    async with running() as server:
        stream = await server.raw()
        await stream.send_all(sent)
        await stream.send_eof()
        got = answers(await closed_by_server(stream))
        await stream.aclose()
        assert [status for status, _ in got] == statuses, got
        if b"POST" in sent:
            assert json.loads(got[0][1])["status"] == "assigned", got


@pytest.mark.parametrize("first", [create_request("closing", close=True),
                                   b"GET /v1/stream/health HTTP/1.0\r\n\r\n"], ids=["connection-close", "http-1.0"])
async def test_bytes_after_a_connections_last_request_do_not_cost_it_its_answer(first: bytes) -> None:
    """A request that ends its connection (``Connection: close``, HTTP/1.0) followed at once by more bytes: its own
    answer, then the close. Those bytes reached hypercorn, which answered an empty 400 instead, and a create was
    made all the same, its id and token never told."""
    async with running() as server:
        stream = await server.raw()
        await stream.send_all(first + HEALTH_11 + b"GET /more HTTP/1.1\r\n")
        got = answers(await closed_by_server(stream))
        await stream.aclose()
        assert len(got) == 1 and got[0][0] == 200, got
        if first.startswith(b"POST"):
            assert json.loads(got[0][1])["session_id"], got


async def test_a_one_shot_client_that_closes_after_its_answer_frees_its_place_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends one keep-alive request, reads its answer and closes (curl, ``httpx.get``, a health
    probe) owes the front nothing more: its connection ends then. The front kept it until hypercorn's keep-alive
    timeout (5 s), counted towards its cap: about 200 such requests a second turned every other client away with
    503 ``too_many_connections`` (4 here: the fifth client)."""
    monkeypatch.setattr("server.serve.MAX_CONNECTIONS", 4)
    async with running(attrs.evolve(FAST, head=WAIT, idle=WAIT)) as server:
        statuses = []
        for _ in range(12):
            stream = await server.raw()
            await stream.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await json_answer(stream)
            statuses.append(int(answer.split(b" ", 2)[1]))
            await stream.aclose()
        assert statuses == [200] * 12, statuses
        # one that shuts its sending side after its request and waits is answered in full, then closed
        stream = await server.raw()
        await stream.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
        await stream.send_eof()
        got = answers(await closed_by_server(stream))
        await stream.aclose()
        assert [status for status, _ in got] == [200], got


async def test_a_request_begun_after_the_stop_behind_one_still_answered_is_told_so_after_that_answer(
    tmp_path: Path,
) -> None:
    """The server stops while a kept-alive connection's request is still being answered, and the client sends its
    next one: that answer goes out whole, then a 503 ``shutting_down`` for the next, which never reaches the HTTP
    server (a stand-in for hypercorn here, on the front's Unix socket; hypercorn closed such a connection after its
    answer, unannounced, and dropped the request)."""
    release = trio.Event()
    backend_got = bytearray()

    async def backend(listener: trio.socket.SocketType) -> None:
        connection, _ = await listener.accept()
        with connection:
            while b"\r\n\r\n" not in backend_got:
                backend_got.extend(await connection.recv(65536))
            await release.wait()
            await connection.send(b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\nok")
            with trio.move_on_after(WAIT):
                while data := await connection.recv(65536):
                    backend_got.extend(data)

    async with front_before(backend, tmp_path, FAST) as (front, client):
        await client.send_all(HEALTH_11)
        with trio.fail_after(WAIT):
            while b"\r\n\r\n" not in backend_got:
                await trio.sleep(0.01)  # bench-cost: the front's backend is a real Unix socket
        front.stopping = True
        await client.send_all(HEALTH_11)
        release.set()
        with trio.fail_after(WAIT):
            received = await read_to_end(client)
    got = answers(received)
    assert [status for status, _ in got] == [200, 503], got
    assert json.loads(got[1][1])["error"] == "shutting_down", got
    assert backend_got.count(b"GET ") == 1, backend_got


@contextlib.asynccontextmanager
async def front_before(backend: Callable[[trio.socket.SocketType], Awaitable[None]], tmp_path: Path,
                       deadlines: Any) -> AsyncIterator[tuple[Front, trio.testing.MemoryStream]]:
    """A front, and a client's connection to it, before ``backend`` (a stand-in for hypercorn, given the listener of
    the front's Unix socket); both are cancelled when the block ends."""
    path = str(tmp_path / "backend.sock")
    listener = trio.socket.socket(trio.socket.AF_UNIX)
    await listener.bind(path)
    listener.listen()
    front = Front(None, path, max_message_bytes=1024, deadlines=deadlines)
    client, server_side = trio.testing.memory_stream_pair()
    with listener:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend, listener)
            nursery.start_soon(front.handle, server_side)
            yield front, client
            nursery.cancel_scope.cancel()


async def test_a_first_request_head_still_arriving_when_the_server_stops_is_told_so() -> None:
    """The server stops while a connection's first request head is still arriving: the client is answered 503
    ``shutting_down``; it was closed with no answer (a body still arriving was told so already). A connection that
    sent nothing is closed in silence."""
    front = Front(None, "/nowhere", max_message_bytes=1024, deadlines=attrs.evolve(FAST, head=WAIT))
    begun, begun_at_front = trio.testing.memory_stream_pair()
    silent, silent_at_front = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(front.handle, begun_at_front)
        nursery.start_soon(front.handle, silent_at_front)
        await begun.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n")  # the head's end never comes
        await trio.testing.wait_all_tasks_blocked()
        front.stopping = True
        front.close()
        with trio.fail_after(WAIT):
            got = answers(await read_to_end(begun))
            assert await read_to_end(silent) == b""
    assert [status for status, _ in got] == [503], got
    assert json.loads(got[0][1])["error"] == "shutting_down", got


async def test_a_next_request_head_arriving_as_hypercorn_closes_for_the_stop_is_told_so(tmp_path: Path) -> None:
    """A kept-alive connection's next request head is still arriving when hypercorn, stopping, closes the connection
    after its last answer: the client gets that answer, then 503 ``shutting_down`` for the request it began (the
    connection was closed under it, with no answer)."""
    release = trio.Event()

    async def backend(listener: trio.socket.SocketType) -> None:
        connection, _ = await listener.accept()
        with connection:
            got = b""
            while b"\r\n\r\n" not in got:
                got += await connection.recv(65536)
            await connection.send(b"HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\nok")
            await release.wait()  # then closed, unannounced, as hypercorn does as it stops

    async with front_before(backend, tmp_path, attrs.evolve(FAST, head=WAIT)) as (front, client):
        await client.send_all(HEALTH_11)
        received = bytearray()
        with trio.fail_after(WAIT):
            while b"ok" not in received:
                received += await client.receive_some(65536)
        await client.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n")  # the next head, cut short
        await trio.testing.wait_all_tasks_blocked()
        front.stopping = True
        release.set()
        with trio.fail_after(WAIT):
            received += await read_to_end(client)
    got = answers(bytes(received))
    assert [status for status, _ in got] == [200, 503], got
    assert json.loads(got[1][1])["error"] == "shutting_down", got


async def read_to_end(stream: trio.abc.ReceiveStream) -> bytes:
    received = bytearray()
    while data := await stream.receive_some(65536):
        received += data
    return bytes(received)
