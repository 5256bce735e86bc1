"""Room transports behind one narrow port: the embedded local rooms and LiveKit."""

from .base import (
    DataReceived,
    ParticipantJoined,
    ParticipantLeft,
    RoomConnection,
    RoomEvent,
    RoomTransport,
    TransportError,
    can_address,
)

__all__ = [
    "DataReceived",
    "ParticipantJoined",
    "ParticipantLeft",
    "RoomConnection",
    "RoomEvent",
    "RoomTransport",
    "TransportError",
    "can_address",
]
