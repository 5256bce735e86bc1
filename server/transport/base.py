"""The transport port: what a room runner needs from a room, and nothing more.

A runner joins a room as the worker participant, publishes video frames (RGB ``H x W x 3`` uint8) and PCM audio,
sends and receives data on topics, hears participants join and leave, and sends away a participant the room may not
hold (a viewer over its session's seats: LiveKit lets a viewer's still-valid token back in, so the server removes
it). Data goes to the whole room (the room's news: status, chunks, the end) or to one participant (the answer to its
own message, such as a refused control). Two transports implement it: LiveKit (production, through trio-asyncio)
and the local rooms embedded in the server (the default: WebSocket clients with the same tokens, roles and topics).
A worker agent's connection to the authority's local rooms (:mod:`server.cluster.rooms`) has no ``send_away``: that
room's door, in the authority, holds the seats.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import attrs
import numpy as np

from pipelines.contract import Audio

__all__ = [
    "TransportError",
    "DataReceived",
    "ParticipantJoined",
    "ParticipantLeft",
    "RoomEvent",
    "RoomConnection",
    "RoomTransport",
]


class TransportError(RuntimeError):
    """The room could not be joined or used (unreachable server, refused token, lost connection)."""


@attrs.frozen
class DataReceived:
    topic: str
    payload: bytes
    sender_identity: str | None  # None when the transport could not tell who sent it
    #: the same sender's messages this one replaced while they waited their turn (LiveKit's pace, where nothing
    #: pushes back on a sender); its sender is told so. Always 0 in the local rooms, which push back instead.
    replaced: int = 0


@attrs.frozen
class ParticipantJoined:
    identity: str


@attrs.frozen
class ParticipantLeft:
    identity: str


RoomEvent = DataReceived | ParticipantJoined | ParticipantLeft


class RoomConnection(Protocol):
    """The worker's presence in one room."""

    @property
    def identity(self) -> str: ...

    def participants(self) -> frozenset[str]:
        """Identities of the other participants present now."""
        ...

    def events(self) -> AsyncIterator[RoomEvent]:
        """Data and participant events, in arrival order, until disconnected."""
        ...

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None: ...

    async def publish_audio(self, audio: Audio) -> None: ...

    async def send_data(self, topic: str, payload: bytes, *, reliable: bool = True, to: str | None = None) -> None:
        """Send to the whole room, or with ``to`` to that participant alone (an answer to its own message: the
        others hear nothing of it; dropped when it has left)."""
        ...

    async def send_away(self, identity: str, reason: str, detail: str) -> None:
        """Make ``identity`` leave the room (the worker stays): a local room tells its socket ``reason`` and ``detail``
        as a refusal, LiveKit removes it through the RoomService and tells it nothing more. Bounded in time; one that
        is not in the room is no failure; raises TransportError when it cannot be done."""
        ...

    async def disconnect(self) -> None:
        """Leave the room; bounded in time; idempotent."""
        ...


class RoomTransport(Protocol):
    name: str

    async def connect(self, room: str, identity: str, token: str, *, timeout: float) -> RoomConnection:
        """Join ``room`` as ``identity`` with a worker token, or raise TransportError within ``timeout``."""
        ...

    async def open_room(self, room: str, *, lifetime: float) -> None:
        """Make the room of a session about to be created, before any token for it is handed out; raise
        TransportError when that cannot be done. ``lifetime`` bounds how long an empty room may stay: the
        session's timeout (the server closes the room when the session ends, long before that)."""
        ...

    def close_room(self, room: str, last_word: bytes | None = None, *, worker_told: bool = False) -> None:
        """The room's session ended (never waits). ``last_word`` is its last ``tf.status`` message, for the
        transport to send as the server's when no worker said it (a session that ended queued, a lost worker's);
        ``worker_told``: the session's worker says it told the room itself."""
        ...
