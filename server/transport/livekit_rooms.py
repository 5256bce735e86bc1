"""The server's own side of LiveKit rooms, through the RoomService (the API secret's holder): it makes a session's
room before the session's token is out, lists who is in a room no worker of its own is in yet (a queued session's),
says a queued session's last word, and deletes the room when the session ends. The worker's side (joining, media, data) is :mod:`.livekit`, which owns the asyncio loop these calls run on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio_asyncio
from livekit import api

from ..protocol import STATUS_TOPIC
from .base import TransportError

__all__ = ["MAX_ROOM_TIMEOUT", "ROOM_CLOSE_GRACE", "RoomService", "http_url"]

log = logging.getLogger(__name__)

ROOM_CLOSE_GRACE = 2.0  # seconds from a session's end to its room's deletion: its last messages reach the clients
MAX_ROOM_TIMEOUT = 2**31 - 1  # seconds: LiveKit keeps a room's empty and departure timeouts in 32 bits
LEFT = api.ParticipantInfo.State.DISCONNECTED  # a participant listed on its way out: no longer in the room


def http_url(url: str) -> str:
    """The RoomService's address for a signalling url (``ws://`` and ``wss://`` become ``http://``, ``https://``)."""
    for scheme, http in (("ws://", "http://"), ("wss://", "https://")):
        if url.startswith(scheme):
            return http + url[len(scheme):]
    return url


class RoomService:
    """The rooms one server made, each until its session ends; every call is bounded by ``timeout``."""

    def __init__(self, url: str, api_key: str | None, api_secret: str | None, timeout: float) -> None:
        self.url = url
        self._api_key = api_key
        self._api_secret = api_secret
        self.timeout = timeout
        self._opened: set[str] = set()  # rooms made for sessions that have not ended
        self.to_delete: set[str] = set()  # rooms of ended sessions not deleted yet (each waits out its grace)

    async def open(self, loop: Any, room: str, lifetime: float) -> None:
        """Create ``room``, empty for at most ``lifetime`` seconds (whole, at least one, at most
        :data:`MAX_ROOM_TIMEOUT`); raises :class:`TransportError` naming the cause when LiveKit refuses or does not
        answer within ``timeout``."""
        if not (self._api_key and self._api_secret):
            raise TransportError("creating a LiveKit room needs the API key and secret (--livekit-api-key/-secret)")
        seconds = min(MAX_ROOM_TIMEOUT, max(1, math.ceil(lifetime)))
        request = api.CreateRoomRequest(name=room, empty_timeout=seconds, departure_timeout=seconds)
        prefix = f"could not create the LiveKit room {room!r} at {self.url}"
        try:
            await self._answer(loop, prefix, lambda rooms: rooms.create_room(request))
        except api.TwirpError as exc:
            why = exc.message or {401: "the API key or secret is wrong", 403: "the API key may not"}.get(exc.status, "")
            code = "" if exc.code == "unknown" else f" {exc.code}"
            raise TransportError(f"{prefix}: LiveKit refused (HTTP {exc.status}{code}{': ' + why if why else ''})") from None
        self._opened.add(room)

    async def participants(self, loop: Any, room: str) -> frozenset[str]:
        """Who is in ``room`` now, as LiveKit lists it (one that left is not); raises :class:`TransportError` naming
        the cause when LiveKit refuses or does not answer within ``timeout``."""
        prefix = f"could not list who is in the LiveKit room {room!r} at {self.url}"
        try:
            listed = await self._answer(
                loop, prefix, lambda rooms: rooms.list_participants(api.ListParticipantsRequest(room=room)))
        except api.TwirpError as exc:
            if exc.code == api.TwirpErrorCode.NOT_FOUND:
                return frozenset()  # the room is gone, and everyone with it
            raise TransportError(f"{prefix}: LiveKit refused (HTTP {exc.status}): {exc.message}") from None
        return frozenset(p.identity for p in listed.participants if p.state != LEFT)

    async def _answer(self, loop: Any, prefix: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """One RoomService call's answer within ``timeout``, or :class:`TransportError` (``prefix``, then why) when
        LiveKit is unreachable or silent; its refusals (``api.TwirpError``) are the caller's to read."""
        with trio.move_on_after(self.timeout):
            try:
                return await trio_asyncio.aio_as_trio(self._call, loop=loop)(call)
            except api.TwirpError:
                raise
            except Exception as exc:  # the server unreachable, or the SDK failing otherwise
                raise TransportError(f"{prefix}: {type(exc).__name__}: {exc}") from None
        raise TransportError(f"{prefix}: no answer within {self.timeout:g} s")

    def close(self, loop: Any, sends: trio.Nursery, room: str, last_word: bytes | None) -> None:
        """The room's session ended: in ``sends``, ``last_word`` goes to the room, and ``ROOM_CLOSE_GRACE`` later the
        room is deleted. A room this server did not make (a session refused as it was asked for) is left alone."""
        if room not in self._opened:
            return
        self._opened.discard(room)
        self.to_delete.add(room)
        sends.start_soon(self._close, loop, room, last_word)

    async def _close(self, loop: Any, room: str, last_word: bytes | None) -> None:
        if last_word is not None:
            await self._bounded(loop, room, "sending the session's last status", lambda rooms: rooms.send_data(
                api.SendDataRequest(room=room, data=last_word, kind=api.DataPacket.Kind.RELIABLE, topic=STATUS_TOPIC)))
        await trio.sleep(ROOM_CLOSE_GRACE)  # the last messages reach the clients before the room goes
        await self.delete(loop, room)

    async def delete(self, loop: Any, room: str) -> None:
        """Delete ``room`` now (its clients are sent away)."""
        self.to_delete.discard(room)
        await self._bounded(loop, room, "deleting the room", lambda rooms: rooms.delete_room(api.DeleteRoomRequest(room=room)))

    async def _bounded(self, loop: Any, room: str, what: str, call: Callable[[Any], Awaitable[Any]]) -> None:
        """One RoomService call, bounded; a room that is not there (nobody ever entered it) is no failure."""
        with trio.move_on_after(self.timeout) as deadline:
            try:
                await trio_asyncio.aio_as_trio(self._call, loop=loop)(call)
            except api.TwirpError as exc:
                if exc.code != api.TwirpErrorCode.NOT_FOUND:
                    log.warning("room %s: %s was refused: %s", room, what, exc.message)
            except Exception as exc:  # the server unreachable, or the SDK failing otherwise
                log.warning("room %s: %s failed: %s: %s", room, what, type(exc).__name__, exc)
        if deadline.cancelled_caught:
            log.warning("room %s: %s took longer than %g s", room, what, self.timeout)

    async def _call(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """Asyncio side: one call on a RoomService client of its own; its answer."""
        service = api.LiveKitAPI(http_url(self.url), self._api_key, self._api_secret)
        try:
            return await call(service.room)
        finally:
            await service.aclose()
