"""The tests' in-process WebSocket client: quart's test socket, except that it never waits on an app that has left.

quart-trio's test socket hands the app its messages through a buffer of 10 that nobody reads once the app's socket
handler has ended (the server closed the socket): a client that sent a few more, then left, waited for ever in its
``disconnect`` (it hung the whole suite at the 99 % line once in a few hundred runs of a burst test, the server
closing a stopped session's controller socket with messages still on their way). A real client gets an error
sending to a closed socket, and leaving one costs it nothing; this one does the same: once the app has left, a
send raises :class:`trio.BrokenResourceError` and a disconnect is a no-op.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, AnyStr

import trio
from quart.json import dumps, loads
from quart.testing.connections import WebsocketDisconnectError, WebsocketResponseError
from quart.utils import decode_headers

__all__ = ["ClientSocket", "client_of"]

BUFFER = 10  # messages either way in flight, as quart's own test socket holds


class ClientSocket:
    """One in-process WebSocket to the app (quart's ``TestWebsocketConnectionProtocol``)."""

    def __init__(self, app: Any, scope: Any) -> None:
        self.app = app
        self.scope = scope
        self.accepted = False
        self.headers: Any = None
        self.status_code: int | None = None
        self.response_data = bytearray()
        self._to_app, self._app_receives = trio.open_memory_channel[dict[str, Any]](BUFFER)
        self._app_sends, self._from_app = trio.open_memory_channel[bytes | str | Exception](BUFFER)
        self._nursery_manager: Any = None

    async def __aenter__(self) -> ClientSocket:
        self._nursery_manager = trio.open_nursery()
        nursery = await self._nursery_manager.__aenter__()
        nursery.start_soon(self._run_app)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.disconnect()
        await self._nursery_manager.__aexit__(exc_type, exc, tb)

    async def _run_app(self) -> None:
        try:
            await self.app(self.scope, self._app_receives.receive, self._app_send)
        finally:
            # what the app never read is gone with it; a sender waiting for room is told (BrokenResourceError)
            self._app_receives.close()

    async def receive(self) -> AnyStr:
        data = await self._from_app.receive()
        if isinstance(data, Exception):
            raise data
        return data  # type: ignore[return-value]

    async def send(self, data: AnyStr) -> None:
        """Raises :class:`trio.BrokenResourceError` once the app has left the socket, as a closed socket would."""
        key = "text" if isinstance(data, str) else "bytes"
        await self._to_app.send({"type": "websocket.receive", key: data})

    async def receive_json(self) -> Any:
        return loads(await self.receive())

    async def send_json(self, data: Any) -> None:
        await self.send(dumps(data))

    async def close(self, code: int) -> None:
        await self._leave({"type": "websocket.close", "code": code})

    async def disconnect(self) -> None:
        await self._leave({"type": "websocket.disconnect"})

    async def _leave(self, message: dict[str, Any]) -> None:
        try:
            await self._to_app.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the app left first, or this side already did: nothing to tell it
        finally:
            self._to_app.close()

    async def _app_send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "websocket.accept":
            self.accepted = True
        elif kind == "websocket.send":
            await self._app_sends.send(message.get("bytes") or message.get("text"))
        elif kind == "websocket.http.response.start":
            self.headers = decode_headers(message["headers"])
            self.status_code = message["status"]
        elif kind == "websocket.http.response.body":
            self.response_data.extend(message["body"])
            if not message.get("more_body", False):
                response = self.app.response_class(bytes(self.response_data), self.status_code, self.headers)
                await self._app_sends.send(WebsocketResponseError(response))
        elif kind == "websocket.close":
            await self._app_sends.send(WebsocketDisconnectError(message.get("code", 1000)))
            self._app_sends.close()


def client_of(test_app: Any) -> Any:
    """``test_app.test_client()``, its WebSockets :class:`ClientSocket`."""
    client = test_app.test_client()
    client.websocket_connection_class = ClientSocket
    return client

