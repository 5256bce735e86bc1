"""A room's WebSocket path asked for over plain HTTP (no handshake) is refused naming what it needs: werkzeug's
400 said "the browser (or proxy) sent a request that this server could not understand", naming nothing."""

from __future__ import annotations

import pytest

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
