"""Room transports behind one narrow port: the embedded local rooms and LiveKit."""

from .base import (
    DataReceived,
    ParticipantJoined,
    ParticipantLeft,
    RoomConnection,
    RoomEvent,
    RoomTransport,
    TransportError,
)

__all__ = [
    "DataReceived",
    "ParticipantJoined",
    "ParticipantLeft",
    "RoomConnection",
    "RoomEvent",
    "RoomTransport",
    "TransportError",
]
