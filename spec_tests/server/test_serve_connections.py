"""The connections a real ``chunkline stream-serve`` takes: as many as its open-file limit can hold (it raises its
soft limit, or serves fewer and says so), and none it cannot answer once it stops (refused, not dropped)."""

from __future__ import annotations

import contextlib
import re
import resource
import signal
from pathlib import Path

import httpx
import trio

from server.front import MAX_CONNECTIONS
from server.open_files import DESCRIPTORS_PER_CONNECTION, RESERVED_DESCRIPTORS

from .served_process import EXIT_DEADLINE, Served, stream_serve

HEALTH = b"GET /v1/service/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def open_files_limit(pid: int) -> int:
    """The soft open-file limit of process ``pid``, as /proc says."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    return int(re.search(r"^Max open files\s+(\d+)", limits, re.MULTILINE).group(1))  # type: ignore[union-attr]


async def ask(url: str) -> bytes | None:
    """One request on a new connection: everything the server sent before closing it, or None when it refused the
    connection (refused, or reset unanswered: the kernel resets the connections a closing listener never accepted)."""
    sock = trio.socket.socket()
    try:
        await sock.connect(address(url))
    except ConnectionRefusedError:
        sock.close()
        return None
    stream = trio.SocketStream(sock)
    received = bytearray()
    with trio.fail_after(EXIT_DEADLINE):
        try:
            await stream.send_all(HEALTH)
            while data := await stream.receive_some(65536):
                received += data
        except trio.BrokenResourceError as exc:
            if not received and isinstance(exc.__cause__, ConnectionResetError | BrokenPipeError):
                await stream.aclose()
                return None
    await stream.aclose()
    return bytes(received)


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream(*address(url))


async def ready(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
        await served.wait_ready(client)


async def test_a_request_after_the_stop_is_refused_or_answered_never_dropped(short_tmp: Path) -> None:
    """With a client's keep-alive connection open the server gives open connections a grace before it exits; the
    front went on accepting then, and closed every new connection unanswered (hypercorn had stopped). Now each is
    answered or refused."""
    async with stream_serve(short_tmp) as served:
        await ready(served)
        idle = await connect(served.url)
        await idle.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then kept open
        await idle.receive_some(65536)
        served.process.send_signal(signal.SIGTERM)
        outcomes: list[bytes | None] = []
        with trio.move_on_after(EXIT_DEADLINE):
            while served.process.poll() is None:
                outcomes.append(await ask(served.url))
        assert await served.exit_code() == 0
        await idle.aclose()
    dropped = [outcome for outcome in outcomes if outcome is not None and not outcome.startswith(b"HTTP/1.1 ")]
    assert not dropped, f"{len(dropped)} of {len(outcomes)} connections were closed unanswered"
    assert None in outcomes  # the server stopped accepting before it exited


async def test_the_server_raises_its_open_file_limit_to_what_its_connection_cap_needs(short_tmp: Path) -> None:
    """Started with a soft limit of 1,024 (a common default) under this host's hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    needed = RESERVED_DESCRIPTORS + DESCRIPTORS_PER_CONNECTION * MAX_CONNECTIONS
    async with stream_serve(short_tmp, wrapper=["prlimit", f"--nofile=1024:{'unlimited' if hard < 0 else hard}"]) as served:
        await ready(served)
        assert open_files_limit(served.process.pid) == (needed if hard < 0 else min(needed, hard))
        assert (b"open-file limit" in served.log) == (0 <= hard < needed)


async def test_under_a_low_hard_limit_the_server_serves_fewer_connections_and_says_so(short_tmp: Path) -> None:
    """A hard limit of 1,024 leaves room for 256 connections: said at start, and the next one is answered 503
    naming that cap (the cap of 1,024 could never act there: accept failed with EMFILE and clients waited)."""
    cap = (1024 - RESERVED_DESCRIPTORS) // DESCRIPTORS_PER_CONNECTION
    async with stream_serve(short_tmp, wrapper=["prlimit", "--nofile=1024:1024"]) as served:
        await ready(served)
        await served.read_until(f"serve {cap} connections at once, not {MAX_CONNECTIONS}".encode())
        holders = [await connect(served.url) for _ in range(cap)]  # silent: each holds its place
        answer = await ask(served.url)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503 "), answer
        assert f"the server has {cap} connections open".encode() in answer, answer
        for holder in holders:
            await holder.aclose()


async def test_an_upload_still_arriving_when_the_server_stops_is_told_so(short_tmp: Path) -> None:
    """A create whose body is still arriving (at more than the minimum rate) when SIGTERM's drain and the connections'
    grace are over: the client is answered 503 ``shutting_down``; it got a broken pipe and no answer."""
    async with stream_serve(short_tmp) as served:
        await ready(served)
        upload = await connect(served.url)
        length = 8 * 1024 * 1024  # far more than the upload below sends before the stop
        await upload.send_all(b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n{\"identity\": \"" % length)
        served.process.send_signal(signal.SIGTERM)
        received = bytearray()

        async def keep_uploading() -> None:  # 64 KiB a second: four times the minimum rate, never done in time
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while True:
                    await upload.send_all(b"x" * 16384)
                    await trio.sleep(0.25)  # bench-cost: a client's upload pace, in real time (a real process)

        with trio.fail_after(EXIT_DEADLINE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_uploading)
                with contextlib.suppress(trio.BrokenResourceError):
                    while data := await upload.receive_some(65536):
                        received += data
                nursery.cancel_scope.cancel()
        assert await served.exit_code() == 0
        await upload.aclose()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), bytes(received)[:300]
    assert b'"shutting_down"' in body, body


async def read_all(stream: trio.SocketStream) -> bytes:
    """Everything the server sends on ``stream`` until it closes it (a reset after its last byte ends it too)."""
    received = bytearray()
    with trio.fail_after(EXIT_DEADLINE):
        with contextlib.suppress(trio.BrokenResourceError):
            while data := await stream.receive_some(65536):
                received += data
    return bytes(received)


async def read_answer(stream: trio.SocketStream) -> bytes:
    """One whole answer (its head and its ``Content-Length`` body) on a kept-alive connection."""
    received = bytearray()
    with trio.fail_after(EXIT_DEADLINE):
        while b"\r\n\r\n" not in received or len(received) < answer_length(bytes(received)):
            data = await stream.receive_some(65536)
            assert data, f"closed after {bytes(received)!r}"
            received += data
    return bytes(received)


def answer_length(received: bytes) -> int:
    head, _, _ = received.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    assert length is not None, head
    return len(head) + 4 + int(length.group(1))


async def kept_alive(served: Served) -> trio.SocketStream:
    """A connection to the ready server whose first request was answered 200 and which is kept open."""
    await ready(served)
    kept = await connect(served.url)
    await kept.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = await read_answer(kept)
    assert first.startswith(b"HTTP/1.1 200 "), first
    return kept


async def test_a_request_on_a_kept_alive_connection_after_the_stop_is_answered_not_dropped(short_tmp: Path) -> None:
    """Once SIGTERM's drain is over the server takes no new connection, and hypercorn closed each kept-alive one
    without a word: a request a client sent on one then was read and dropped, unanswered. It is answered 503
    ``shutting_down``, with ``Connection: close``."""
    async with stream_serve(short_tmp) as served:
        kept = await kept_alive(served)
        served.process.send_signal(signal.SIGTERM)
        with trio.fail_after(EXIT_DEADLINE):
            while await ask(served.url) is not None:  # answered until the drain is over, then refused
                pass
        await kept.send_all(b"GET /v1/stream/health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await read_all(kept)
        await kept.aclose()
        assert await served.exit_code() == 0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer[:300]
    assert b"connection: close" in head.lower(), head
    assert b'"shutting_down"' in body, body


async def test_a_kept_alive_connections_next_head_may_arrive_after_hypercorns_keep_alive_timeout(
    short_tmp: Path,
) -> None:
    """The front owns the client's connection: it passes a head on once it is whole, within ``Deadlines.head`` of
    its first byte and ``Deadlines.idle`` of the last byte moved. hypercorn, behind it, closed a connection it had
    heard nothing on for 5 s, so a next head begun before then and finished after was never answered."""
    async with stream_serve(short_tmp) as served:
        kept = await kept_alive(served)
        await kept.send_all(b"GET /v1/stream/health HTTP/1.1\r\n")
        await trio.sleep(6.0)  # bench-cost: past hypercorn's 5 s keep-alive timeout, in real time (a real process)
        await kept.send_all(b"Host: x\r\nConnection: close\r\n\r\n")
        answer = await read_all(kept)
        await kept.aclose()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


async def test_connections_their_clients_closed_hold_no_descriptor(short_tmp: Path) -> None:
    """A client that asks on a kept-alive connection and closes it after the answer (curl, a client pool closed) left
    hypercorn's end of the front's connection open until hypercorn's keep-alive ran out, 45 s: a descriptor each,
    which the front's connection cap did not count, and 75 such requests a second ran the server out of descriptors.
    Each is let go at once now."""
    keep_alive = HEALTH.replace(b"Connection: close\r\n", b"")
    async with stream_serve(short_tmp) as served:
        await ready(served)
        descriptors = Path(f"/proc/{served.process.pid}/fd")
        before = len(list(descriptors.iterdir()))
        for _ in range(40):
            stream = await connect(served.url)
            await stream.send_all(keep_alive)
            answer = bytearray()
            with trio.fail_after(EXIT_DEADLINE):
                while b"\r\n\r\n" not in answer:
                    answer += await stream.receive_some(65536)
            assert answer.startswith(b"HTTP/1.1 200"), bytes(answer)
            await stream.aclose()  # the client is done, its connection kept alive by the server
        with trio.move_on_after(10):  # far less than hypercorn's keep-alive (45 s), far more than a loaded host needs
            while len(list(descriptors.iterdir())) > before + 2:
                await trio.sleep(0.1)  # bench-cost: real-time poll of another process's descriptors, bounded
        assert len(list(descriptors.iterdir())) <= before + 2, sorted(p.resolve().name for p in descriptors.iterdir())
