"""A client's deadlines do not count the time a pipeline held the server's loop.

Code that never awaits (``loop_holding_world.py``: a create whose ``check_options`` sleeps) holds trio's thread, and
nothing is read, answered or written meanwhile. The front's deadlines ran on that same loop: the moment it ran again,
each one that fell inside the hold fired, and clients were blamed for the server's pause. A request whose head and
body had arrived in time was answered ``408``; a controller that answered every ping was closed as silent. Now
:mod:`server.loop_holds` takes each hold out of those deadlines (and out of the answer deadline, which had answered
such a create ``504`` while its handler made the session: ``test_held_loop_stops.py``), and out of a room's wait
for its controller, which failed a session whose controller came during a hold.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from typing import Any

import httpx
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, Request

from server.room_socket import Deadlines, PING_INTERVAL, PONG_DEADLINE

from .test_held_loop_stops import CASES, Server

STREAM_SERVE = CASES[0].values[0]
PAST_THE_HEAD = Deadlines().head + 4  # seconds the loop is held: past a request's head and body deadlines
PAST_THE_PONG = PONG_DEADLINE + PING_INTERVAL + 2  # past the silence a peer may keep, and a ping's look after it


def hold(url: str, seconds: float, answered: list[int]) -> threading.Thread:
    """A create whose options' check holds the loop ``seconds``; its status goes to ``answered``."""

    def create() -> None:
        answered.append(httpx.post(f"{url}/v1/stream/sessions", json={"identity": "holder", "config": {"hold": seconds}},
                                   timeout=seconds + 60).status_code)

    thread = threading.Thread(target=create, daemon=True)
    thread.start()
    return thread


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=PAST_THE_PONG + 60)


def answer_of(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the one answer on ``sock`` (read until the server closes, or the body is whole)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), json.loads(body or b"null")


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_request_that_arrived_during_a_hold_is_answered_not_timed_out() -> None:
    """Two requests begun before a hold of 14 s and finished during it (one its head, one its body): each is answered
    by the app once the loop is back. Before, both were ``408``: their 10 s deadlines fired as the loop came back."""
    server = Server(STREAM_SERVE)
    try:
        url = server.ready()
        body = json.dumps({"identity": 5}).encode()  # refused by the app's own check (400), not the pipeline's
        head = (b"POST /v1/stream/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        heads, bodies = connect(url), connect(url)
        heads.sendall(head[:20])
        bodies.sendall(head + body[:3])
        answered: list[int] = []
        holder = hold(url, PAST_THE_HEAD, answered)
        server.until(re.compile(rb"holding the loop\n"), 30.0)
        heads.sendall(head[20:] + body)  # all of it while the loop is held
        bodies.sendall(body[3:])
        for sock in (heads, bodies):
            status, found = answer_of(sock)
            assert (status, found["error"]) == (400, "invalid_field"), (status, found, server.log.decode())
            sock.close()
        holder.join(PAST_THE_HEAD + 60)
        assert answered == [200], server.log.decode(errors="replace")
        assert "did not arrive within its deadline" not in server.log.decode(errors="replace")
    finally:
        server.end()


def test_a_controller_that_answers_pings_is_not_sent_away_for_a_hold() -> None:
    """A controller whose pongs could not be read while the loop was held 22 s stays: before, the first look after
    the hold found it silent past the 15 s pong deadline and closed it (``no answer to pings``)."""
    server = Server([*STREAM_SERVE, "--max-sessions-per-worker", "2"])  # the controller's session and the holder's
    try:
        url = server.ready()
        created = httpx.post(f"{url}/v1/stream/sessions", json={"identity": "player"}, timeout=30).json()
        sock = connect(url)
        ws = WSConnection(ConnectionType.CLIENT)
        sock.sendall(ws.send(Request(host="x", target=f"{created['websocket_path']}?token={created['token']}")))
        closed: list[CloseConnection] = []
        accepted = threading.Event()

        def answer_pings() -> None:  # as any WebSocket client library does, on a thread of its own
            with contextlib.suppress(OSError):  # the test shuts the socket
                read_and_answer()

        def read_and_answer() -> None:
            while data := sock.recv(65536):
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, AcceptConnection):
                        accepted.set()
                    elif isinstance(event, Ping):
                        sock.sendall(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        closed.append(event)
                        return

        reader = threading.Thread(target=answer_pings, daemon=True)
        reader.start()
        assert accepted.wait(30), server.log.decode(errors="replace")
        answered: list[int] = []
        hold(url, PAST_THE_PONG, answered).join(PAST_THE_PONG + 60)
        assert answered == [200], server.log.decode(errors="replace")
        time.sleep(PING_INTERVAL + 1)  # bench-cost: the keep-alive's next look, past the hold, finds it alive
        log = server.log.decode(errors="replace")
        assert not closed and "no answer to pings" not in log, (closed, log)
        sock.shutdown(socket.SHUT_RDWR)
        reader.join(10)
        sock.close()
    finally:
        server.end()


CONTROLLER_WAIT = 4.0  # --controller-timeout: seconds a new room waits for its controller
PAST_THE_WAIT = CONTROLLER_WAIT + 5  # seconds the loop is held


def test_a_controller_that_joins_as_a_hold_ends_is_not_counted_late() -> None:
    """A room's wait for its controller leaves out a hold: a controller that came 1 s after the session was made and
    found the loop held 9 s joins as the loop is back. Before, the 4 s wait had passed inside the hold, and the session
    failed ``the controller 'player' did not join within 4 s`` the moment the loop ran again."""
    server = Server([*STREAM_SERVE, "--max-sessions-per-worker", "2", "--controller-timeout", str(CONTROLLER_WAIT)])
    try:
        url = server.ready()
        created = httpx.post(f"{url}/v1/stream/sessions", json={"identity": "player"}, timeout=30).json()
        assert "websocket_path" in created, created
        answered: list[int] = []
        holder = hold(url, PAST_THE_WAIT, answered)
        server.until(re.compile(rb"holding the loop\n"), 30.0)
        sock = connect(url)  # the controller comes during the hold: its join is read once the loop is back
        ws = WSConnection(ConnectionType.CLIENT)
        sock.sendall(ws.send(Request(host="x", target=f"{created['websocket_path']}?token={created['token']}")))
        holder.join(PAST_THE_WAIT + 60)
        assert answered == [200], server.log.decode(errors="replace")
        session = f"{url}/v1/stream/sessions/{created['session_id']}"
        deadline = time.monotonic() + 30
        while (view := httpx.get(session, timeout=30).json())["status"] != "running" and time.monotonic() < deadline:
            time.sleep(0.1)  # bench-cost: the session's start, polled over HTTP as a client would
        assert view["status"] == "running", (view, server.log.decode(errors="replace"))
        sock.close()
    finally:
        server.end()
