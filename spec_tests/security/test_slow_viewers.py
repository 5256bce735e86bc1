"""A viewer that never reads holds a bounded amount of the server's memory, in bytes as well as messages.

A controller's data messages fan out to every other participant of its room. A viewer that stops reading
(handshake done, then nothing) keeps its unsent data messages queued until it is sent away: the queue was
bounded by count alone (1024), so a controller's 12 KiB messages (24 KiB once re-encoded) held 24 MiB for
each such viewer, 32 of them to a session, for as long as the write deadline let them stay. Now the queue is
bounded in bytes too (``TEXT_BACKLOG_BYTES``): past it the viewer is told ``too_slow`` and sent away.

The write and ping deadlines are set long here, so that what sends the viewer away is the queue's bound.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import attrs
import trio
from wsproto.events import CloseConnection, TextMessage

from server.transport.local_room import TEXT_BACKLOG, TEXT_BACKLOG_BYTES

from .test_hostile_server import FAST, WAIT, handshake, running

PATIENT = attrs.evolve(FAST, write=600.0, ping_interval=300.0, pong=600.0, idle=600.0)
#: 12,000 bytes as UTF-8 on the wire (within the data message limit), 24,000 once the server re-encodes it
MESSAGE = json.dumps({"topic": "chat", "payload": "\u2603" * 4000}, ensure_ascii=False)
FLOOD = 480  # with the control_rejected answer to each, 960 messages: under TEXT_BACKLOG by count
assert 2 * FLOOD < TEXT_BACKLOG and FLOOD * 24_000 > 2 * 4194304 + TEXT_BACKLOG_BYTES  # past what the kernel buffers


async def _open(server: Any, target: str, rcvbuf: int | None = None) -> tuple[trio.SocketStream, Any]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # fills at once: the server's writes wait
    sock.connect((server.host, server.port))
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    return stream, await handshake(stream, target)


async def test_a_viewer_that_never_reads_is_sent_away_once_its_queue_passes_its_byte_bound() -> None:
    async with running(deadlines=PATIENT, controller_timeout=3600) as server:
        created = await server.session()
        token = (await server.request("POST", f"/v1/stream/sessions/{created['session_id']}/tokens",
                                      {"identity": "lazy"}))[1]["token"]
        lazy, viewer = await _open(server, f"{created['websocket_path']}?token={token}", rcvbuf=4096)
        flooder, controller = await _open(server, f"{created['websocket_path']}?token={created['token']}")
        async with trio.open_nursery() as nursery:

            async def drain(stream: trio.SocketStream) -> None:
                while await stream.receive_some(1 << 20):
                    pass

            nursery.start_soon(drain, flooder)
            for _ in range(FLOOD):
                await flooder.send_all(controller.send(TextMessage(data=MESSAGE)))
            await flooder.send_all(controller.send(TextMessage(data=json.dumps({"topic": "chat", "payload": "end"}))))
            # the viewer reads at last: what the server kept for it, then its close or the last message
            seen: list[Any] = []
            parts: list[str] = []
            with trio.fail_after(WAIT * 3):
                while not seen or seen[-1] not in ("end", "closed"):
                    data = await lazy.receive_some(1 << 20)
                    viewer.receive_data(data or None)
                    for event in viewer.events():
                        if isinstance(event, TextMessage):
                            parts.append(event.data)
                            if event.message_finished:
                                message = json.loads("".join(parts))
                                parts.clear()
                                seen.append(message.get("payload") if message.get("topic") == "chat" else message)
                        elif isinstance(event, CloseConnection):
                            seen.append("closed")
                    if not data:
                        seen.append("closed")
            nursery.cancel_scope.cancel()
        assert seen[-1] == "closed", "a viewer that never read was kept past its byte bound"
        refused = [m["reason"] for m in seen if isinstance(m, dict) and m.get("type") == "refused"]
        assert refused in ([], ["too_slow"]), refused  # told why when it read in time for the last flush
        await lazy.aclose()
        await flooder.aclose()
