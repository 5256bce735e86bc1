"""A small Python client for the local rooms (scripts, bots, benchmarks, tests).

It speaks the wire format of :mod:`server.transport.local` over one WebSocket
(wsproto on a trio TCP stream): ``receive()`` returns text messages as dicts and
media messages as bytes (``b"V"`` + JPEG, ``b"A"`` + PCM), ``send_json`` sends
``{"topic": ..., "payload": ...}`` envelopes.

    client = await RoomClient.connect("127.0.0.1", 8088, f"{websocket_path}?token={token}")
    await client.send_json({"topic": "tf.control", "payload": {"type": "control_state", "controls": ["w"]}})
    message = await client.receive()
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import trio

__all__ = ["RoomClient"]


class RoomClient:
    """A local-room WebSocket client: text messages are dicts, media messages bytes (``b"V"`` + JPEG)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        from wsproto import ConnectionType, WSConnection

        self._stream = stream
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._pending: list[Any] = []
        self._send_lock = trio.Lock()
        self.closed = False

    @classmethod
    async def connect(cls, host: str, port: int, target: str) -> RoomClient:
        from wsproto.events import AcceptConnection, RejectConnection, Request

        stream = await trio.open_tcp_stream(host, port)
        client = cls(stream)
        await client._send(Request(host=f"{host}:{port}", target=target))
        while True:
            event = await client._next_event()
            if isinstance(event, AcceptConnection):
                return client
            if isinstance(event, RejectConnection) or event is None:
                await stream.aclose()
                raise ConnectionError(f"WebSocket {target} refused: {event!r}")
            client._pending.append(event)

    async def _send(self, event: Any) -> None:
        """Send one event; once the socket is closing or closed, ``trio.ClosedResourceError`` (wsproto's own error
        quoted the whole message, and a worker's session failed with it as its reason)."""
        from wsproto.utilities import LocalProtocolError

        async with self._send_lock:  # the close's answer may have gone out while this send waited here
            try:
                data = self._ws.send(event)
            except LocalProtocolError:
                raise trio.ClosedResourceError(f"the room socket is {self._ws.state.name.lower()}") from None
            await self._stream.send_all(data)

    async def _next_event(self) -> Any:
        while True:
            for event in self._ws.events():
                return event
            data = await self._stream.receive_some(262144)
            if not data:
                self._ws.receive_data(None)
                for event in self._ws.events():
                    return event
                return None
            self._ws.receive_data(data)

    async def send_json(self, message: Any) -> None:
        from wsproto.events import TextMessage

        await self._send(TextMessage(data=json.dumps(message)))

    async def send_bytes(self, data: bytes) -> None:
        from wsproto.events import BytesMessage

        await self._send(BytesMessage(data=data))

    async def receive(self) -> Any:
        """The next whole message (dict for text, bytes for media), or None once the server closed."""
        from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

        text: list[str] = []
        binary: list[bytes] = []
        while True:
            event = self._pending.pop(0) if self._pending else await self._next_event()
            if event is None:
                self.closed = True
                return None
            if isinstance(event, CloseConnection):
                self.closed = True
                from wsproto.utilities import LocalProtocolError

                # the peer may have dropped the connection without a closing handshake (1006): nothing to answer
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError, LocalProtocolError):
                    await self._send(event.response())
                return None
            if isinstance(event, Ping):
                await self._send(event.response())
            elif isinstance(event, TextMessage):
                text.append(event.data)
                if event.message_finished:
                    return json.loads("".join(text))
            elif isinstance(event, BytesMessage):
                binary.append(bytes(event.data))
                if event.message_finished:
                    return b"".join(binary)

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self._stream.aclose()
