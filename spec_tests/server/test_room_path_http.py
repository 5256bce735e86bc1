"""A room's WebSocket path asked for over plain HTTP (no handshake) is refused naming what it needs: werkzeug's
400 said "the browser (or proxy) sent a request that this server could not understand", naming nothing."""

from __future__ import annotations

import logging

import pytest
from quart.testing.connections import WebsocketResponseError

from .conftest import serve


@pytest.mark.parametrize("path", ["/v1/rooms/chunkline-abc/ws", "/v1/rooms/chunkline-abc/ws?token=x"])
async def test_a_room_path_without_a_websocket_handshake_is_a_400_naming_the_handshake(path: str) -> None:
    async with serve() as served:
        response = await served.client.get(path)
        body = await response.get_json()
    assert response.status_code == 400, body
    assert body["error"] == "bad_websocket_handshake", body
    assert "'/v1/rooms/chunkline-abc/ws' is a room's WebSocket" in body["detail"], body
    assert "Upgrade: websocket" in body["detail"] and "?token=" in body["detail"], body


@pytest.mark.parametrize("path", ["/v1/stream/health", "/v1/rooms/chunkline-abc/wsx"])
async def test_a_websocket_handshake_to_a_path_that_is_no_room_is_a_404(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under plain hypercorn (the front answers such a handshake itself) it was a 500: the not-found handler read the
    request's path outside any request's context, and the log had its traceback."""
    async with serve() as served:
        with pytest.RaisesGroup(WebsocketResponseError, flatten_subgroups=True) as answered:
            async with served.client.websocket(path) as ws:
                await ws.receive()
    (refusal,) = answered.value.exceptions
    response = refusal.response
    body = await response.get_json()
    assert response.status_code == 404, body
    assert body["error"] == "not_found" and repr(path) in body["detail"], body  # a handshake, not "a room's"
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text
