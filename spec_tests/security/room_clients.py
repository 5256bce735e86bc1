"""A room socket client for the front's in-memory tests: wsproto over any trio stream, every pong and text noted.

A reader may be given a bandwidth (``read(bytes_per_second=...)``): it then reads as a client on a link of that
speed does, on trio's autojump MockClock (:func:`spec_tests.virtual_time.elapse` refuses a real clock).
"""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Pong, Request, TextMessage

from server.front import Front
from server.room_socket import Deadlines
from spec_tests import virtual_time

__all__ = ["Client", "PATIENT", "join"]

#: no ping, pong, write or idle deadline falls within a test: what paces or ends a socket is what the test looks at
PATIENT = Deadlines(write=600.0, ping_interval=600.0, pong=1200.0, head=600.0, idle=600.0)


class Client:
    """One room socket through the front; a reader task notes every pong and text message as it arrives."""

    def __init__(self, stream: trio.abc.Stream, ws: WSConnection) -> None:
        self.stream, self.ws = stream, ws
        self.pongs = 0
        self.texts: list[dict[str, Any]] = []
        self.close_code: int | None = None  # the server's close frame's code, once it came
        self.arrived = trio.Event()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_json(self, message: Any) -> None:
        await self.send(self.ws.send(TextMessage(json.dumps(message))))

    async def read(self, bytes_per_second: float | None = None) -> None:
        """Note all that comes; with ``bytes_per_second``, no faster than that (16 KiB at a time)."""
        try:
            await self._read(bytes_per_second)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the test closed it

    async def _read(self, bytes_per_second: float | None) -> None:
        parts: list[str] = []
        while data := await self.stream.receive_some(1 << 20 if bytes_per_second is None else 1 << 14):
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, Pong):
                    self.pongs += 1
                elif isinstance(event, CloseConnection):
                    self.close_code = event.code
                elif isinstance(event, TextMessage):
                    parts.append(event.data)
                    if event.message_finished:
                        self.texts.append(json.loads("".join(parts)))
                        parts.clear()
            self.arrived.set()
            self.arrived = trio.Event()
            if bytes_per_second is not None:
                await virtual_time.elapse(len(data) / bytes_per_second)  # the link's time to carry what was read

    async def wait_for(self, predicate: Any, within: float) -> None:
        with trio.fail_after(within):
            while not predicate(self):
                await self.arrived.wait()


async def join(front: Front, nursery: trio.Nursery, created: dict[str, Any], token: str, *, read: bool = True) -> Client:
    """A socket that joined ``created``'s room with ``token`` through ``front`` over an in-memory stream (its reader
    started in ``nursery`` when ``read``)."""
    client_end, server_end = trio.testing.memory_stream_pair()
    nursery.start_soon(front.handle, server_end)
    ws = WSConnection(ConnectionType.CLIENT)
    await client_end.send_all(ws.send(Request(host="localhost", target=f"{created['websocket_path']}?token={token}")))
    while not any(isinstance(event, AcceptConnection) for event in ws.events()):
        ws.receive_data(await client_end.receive_some(65536))
    client = Client(client_end, ws)
    if read:
        nursery.start_soon(client.read)
    return client
