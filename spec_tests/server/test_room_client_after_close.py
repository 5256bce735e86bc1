"""The room client (``server.transport.client.RoomClient``) refuses a send after the server closed the socket with
``trio.ClosedResourceError``, which its callers take as a closed connection.

It raised wsproto's ``LocalProtocolError``, whose text quotes the whole message: an agent whose authority closed its
room sockets failed the session with "LocalProtocolError: Event TextMessage(data='{"topic": "tf.metrics", ...}')
cannot be sent in state ConnectionState.CLOSED" as its reason, where a broken socket read "the room hub connection
broke: ...". A WebSocket server on loopback that accepts and then closes at once.
"""

from __future__ import annotations

import functools

import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Request

from server.transport.client import RoomClient


async def accept_then_close(stream: trio.SocketStream) -> None:
    ws = WSConnection(ConnectionType.SERVER)
    async with stream:
        while True:
            ws.receive_data(await stream.receive_some(65536))
            if any(isinstance(event, Request) for event in ws.events()):
                break
        await stream.send_all(ws.send(AcceptConnection()) + ws.send(CloseConnection(code=1000, reason="bye")))
        with trio.move_on_after(5):  # the client's answer to the close, then its end
            while await stream.receive_some(65536):
                pass


async def test_a_send_after_the_server_closed_the_socket_is_a_closed_resource() -> None:
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(functools.partial(trio.serve_tcp, accept_then_close, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        client = await RoomClient.connect("127.0.0.1", port, "/rooms/r?token=t")
        assert await client.receive() is None and client.closed  # the close, answered
        with pytest.raises(trio.ClosedResourceError, match="the room socket is closed"):
            await client.send_json({"topic": "tf.metrics", "payload": {"x": 1}})
        await client.aclose()
        nursery.cancel_scope.cancel()
