"""A room client gets its ``done`` and the close frame, not a reset, however chatty it is when its room closes.

A controller keeps sending (controls, pongs) while its session ends. If the server closed its room socket at
once, with some of those bytes unread or more still arriving, the kernel answered with a reset, and the client's
kernel then threw away what it had not read yet: ``done`` and the close frame (2 runs in 7 of an agent's
SIGTERM). Room sockets close as the front's refusals do, lingering (:func:`server.lingering.linger`):
the close frame, the write side shut, then what the client still sends read and dropped, bounded in bytes and
time, then the close. Through the real served front on loopback: a session deleted, and the server stopping.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from wsproto import WSConnection
from wsproto.events import CloseConnection, TextMessage

from server.room_socket import FRAME_BURST, Deadlines

from .test_hostile_server import FAST, WAIT, handshake, running, wait_for

FLOOD = 2 * FRAME_BURST  # past the burst the socket is read at its pace: most of these are unread at the close
CHATTY = 25  # controls sent one by one after the session was ended, before the client reads anything
CONTROL = {"topic": "tf.control", "payload": {"type": "control_state", "controls": ["w"]}}
#: the chatty controller reads nothing, so answers no ping, until the close: the pong deadline is set past what that
#: takes on a loaded host (with FAST's 1 s it was sent away 1008 before its session ended, 2 runs in 3 under load)
PATIENT_PONG = Deadlines(write=FAST.write, ping_interval=FAST.ping_interval, pong=WAIT, head=FAST.head, idle=WAIT)


class Reset(Exception):
    """The server reset the connection: what the client had not read yet was lost."""


async def chatty_controller(stream: trio.SocketStream, ws: WSConnection, end: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Flood the room, ``end`` it, keep sending without reading for a while, then read to the server's close:
    returns wsproto's events (raises Reset when the connection was reset)."""
    control = ws.send(TextMessage(data=json.dumps(CONTROL)))
    try:
        await stream.send_all(control * FLOOD)
        await end()
        for _ in range(CHATTY):
            await stream.send_all(control)
            await trio.sleep(0.02)  # bench-cost: a controller sending as a person steers, after the session ended
        received = bytearray()
        with trio.fail_after(WAIT):
            while data := await stream.receive_some(65536):
                received += data
    except trio.BrokenResourceError as exc:
        raise Reset(f"the connection was reset: {exc!r} (cause {exc.__cause__!r})") from None
    ws.receive_data(bytes(received))
    return list(ws.events())


def statuses(events: list[Any]) -> list[str]:
    texts = [json.loads(event.data) for event in events if isinstance(event, TextMessage)]
    return [m["payload"]["type"] for m in texts if m.get("topic") == "tf.status"]


def closes(events: list[Any]) -> list[int]:
    return [event.code for event in events if isinstance(event, CloseConnection)]


async def test_a_chatty_controller_of_a_deleted_session_reads_done_and_the_close_not_a_reset() -> None:
    async with running(PATIENT_PONG, controller_timeout=3600) as server:
        for _ in range(2):  # every time, not once by luck
            created = await server.session()
            stream = await server.raw()
            ws = await handshake(stream, f"{created['websocket_path']}?token={created['token']}")

            async def delete() -> None:
                status, _ = await server.request("DELETE", f"/v1/stream/sessions/{created['session_id']}")
                assert status == 200

            async with stream:
                events = await chatty_controller(stream, ws, delete)
            assert "done" in statuses(events) and closes(events) == [1000], events[-5:]


async def test_a_chatty_controller_reads_done_and_the_close_when_the_server_stops() -> None:
    seen: list[Any] = []
    async with trio.open_nursery() as nursery:
        stopping = trio.Event()
        async with running(PATIENT_PONG, controller_timeout=3600) as server:
            created = await server.session()
            stream = await server.raw()
            ws = await handshake(stream, f"{created['websocket_path']}?token={created['token']}")

            async def stop() -> None:
                stopping.set()  # leaving ``running`` below stops the server (what SIGTERM's handler does)

            async def client() -> None:
                async with stream:
                    seen.extend(await chatty_controller(stream, ws, stop))

            nursery.start_soon(client)
            await stopping.wait()
    assert "done" in statuses(seen) and closes(seen) == [1000], seen[-5:]


async def test_a_last_message_sent_with_the_close_frame_is_taken() -> None:
    """A controller's ``stop`` and its close frame, read in one go, lost the stop: the close was raised before the
    message parsed with it was taken. The session ran on, holding its slot (and its worker's lease), and ended 30 s
    later as ``room_empty``, a normal end. Whatever the peer finished before its close is taken first."""
    async with running(controller_timeout=3600) as server:
        for _ in range(2):  # every time, not once by luck
            created = await server.session()
            session = f"/v1/stream/sessions/{created['session_id']}"
            stream = await server.raw()
            ws = await handshake(stream, f"{created['websocket_path']}?token={created['token']}")

            async def record_in(states: tuple[str, ...], session: str = session) -> dict[str, Any] | None:
                record = (await server.request("GET", session))[1]
                return record if record["status"] in states else None

            await wait_for(lambda: record_in(("running",)), "the session to run")
            stop = ws.send(TextMessage(data=json.dumps({"topic": "tf.control", "payload": {"type": "stop"}})))
            async with stream:
                await stream.send_all(stop + ws.send(CloseConnection(code=1000)))  # one write: one read
                record = await wait_for(lambda: record_in(("closed", "failed")), "the stopped session to end")
            assert record["status"] == "closed" and record["drain_cause"] == "stop", record
