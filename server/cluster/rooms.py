"""The local rooms seen from a worker agent: the room hub lives in the authority, the agent joins it
over a WebSocket with the worker token the authority minted.

Media is encoded next to the model (JPEG in the agent's threads) and sent as binary messages;
the hub fans them out exactly as it does for an in-process worker. This is the RoomTransport port
(:mod:`server.transport.base`) over :class:`server.transport.client.RoomClient`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlsplit

import numpy as np
import trio

from pipelines.contract import Audio

from ..json_limits import payload_body
from ..transport.base import DataReceived, ParticipantJoined, ParticipantLeft, RoomEvent, TransportError
from ..transport.client import RoomClient
from ..transport.local import encode_jpeg

__all__ = ["RemoteRooms", "RemoteRoomConnection"]


class RemoteRoomConnection:
    """The agent's runner in one room of the authority's hub."""

    def __init__(self, client: RoomClient, identity: str, participants: set[str], limiter: trio.CapacityLimiter) -> None:
        self._client = client
        self._identity = identity
        self._participants = participants
        self._limiter = limiter
        self._closed = False

    @property
    def identity(self) -> str:
        return self._identity

    def participants(self) -> frozenset[str]:
        return frozenset(self._participants)

    async def events(self) -> AsyncIterator[RoomEvent]:
        while not self._closed:
            try:
                message = await self._client.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                if self._closed:
                    return  # the runner left the room: its socket closing is no news
                # the hub reset the socket (the authority dropped this worker, or the network broke): the reason
                raise TransportError(f"the room hub connection broke: {exc}") from None
            if message is None:
                return
            if not isinstance(message, dict):
                continue
            kind = message.get("type")
            identity = message.get("identity")
            if kind == "participant_joined" and isinstance(identity, str):
                self._participants.add(identity)
                yield ParticipantJoined(identity)
            elif kind == "participant_left" and isinstance(identity, str):
                self._participants.discard(identity)
                yield ParticipantLeft(identity)
            elif kind == "data" and isinstance(message.get("topic"), str):
                payload = message.get("payload")
                raw = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                sender = message.get("from")
                yield DataReceived(message["topic"], raw, sender if isinstance(sender, str) else None)

    async def _send(self, send: Any, value: Any) -> None:
        if self._closed or self._client.closed:
            raise TransportError("the worker left the room")
        try:
            await send(value)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise TransportError(f"the room hub connection broke: {exc}") from exc

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None:
        jpeg = await trio.to_thread.run_sync(encode_jpeg, frame, limiter=self._limiter)
        await self._send(self._client.send_bytes, b"V" + jpeg)

    async def publish_audio(self, audio: Audio) -> None:
        message = b"A" + struct.pack("<IH", audio.sample_rate, audio.channels) + audio.pcm
        await self._send(self._client.send_bytes, message)

    async def send_data(self, topic: str, payload: bytes, *, reliable: bool = True, to: str | None = None) -> None:
        envelope = {"topic": topic, "payload": payload_body(payload)}
        if to is not None:
            envelope["to"] = to  # the hub delivers it to that participant alone
        await self._send(self._client.send_json, envelope)

    async def disconnect(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.move_on_after(2.0) as scope:
            scope.shield = True
            await self._client.aclose()


class RemoteRooms:
    """RoomTransport for an agent whose rooms are the authority's local rooms at ``base_url``."""

    name = "local"

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"rooms_url must be http://host:port, got {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port
        self.encode_limiter = trio.CapacityLimiter(2)

    async def open_room(self, room: str, *, lifetime: float) -> None:
        """Nothing to do here: the rooms are the authority's, made with its record of the session."""

    def close_room(self, room: str, last_word: bytes | None = None, *, worker_told: bool = False) -> None:
        """Nothing to do here: the rooms are the authority's, which closes them (and says a queued session's last
        word) when its record of the session ends."""

    async def connect(self, room: str, identity: str, token: str, *, timeout: float) -> RemoteRoomConnection:
        target = f"/v1/rooms/{quote(room, safe='')}/ws?token={quote(token, safe='')}"
        with trio.move_on_after(timeout) as scope:
            try:
                client = await RoomClient.connect(self._host, self._port, target)
            except (ConnectionError, OSError) as exc:
                raise TransportError(f"local room {room!r} at {self._host}:{self._port} unreachable: {exc}") from exc
            first = await client.receive()
        if scope.cancelled_caught:
            raise TransportError(f"local room {room!r}: no answer from {self._host}:{self._port} within {timeout:g} s")
        if not isinstance(first, dict) or first.get("type") != "joined":
            await client.aclose()
            reason = first.get("reason") if isinstance(first, dict) else "closed"
            raise TransportError(f"local room {room!r} refused the worker: {reason}")
        present = {p for p in first.get("participants", []) if isinstance(p, str)}
        return RemoteRoomConnection(client, identity, present, self.encode_limiter)
