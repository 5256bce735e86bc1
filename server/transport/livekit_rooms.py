"""The server's own side of LiveKit rooms, through the RoomService (the API secret's holder): it makes a session's
room before the session's token is out, lists who is in a room no worker of its own is in yet (a queued session's),
removes a viewer over its session's seats, says a queued session's last word, and deletes the room when the session ends. The worker's side (joining, media, data) is :mod:`.livekit`, which owns the asyncio loop these calls run on.

Every call goes through one RoomService client (one aiohttp session, its connections kept and reused), made on the
first call and closed with the transport; a client whose call failed otherwise than by LiveKit's refusal (the
server gone, a connection broken) is replaced by a new one for the next calls. A client a call (a room's creation,
a list, a send) made for itself, as before, opened a connection for each: a RoomService round trip cost a TCP
handshake, and a server at the token checks' and the poll's pace left thousands of closed connections behind.

Rooms of ended sessions (their last words, their deletions) take :data:`ENDS_AT_ONCE` calls at a time: 10,000
queued sessions ended at once (the shutdown) sent 10,000 last words at once, each on a connection of its own, and
every one of them ran past its deadline. What a stop leaves undone (:meth:`RoomService.finish`) is done within
:data:`STOP_DEADLINE`: the last words go only to rooms somebody is in now (one list of the rooms, not one call a
room), then every room is deleted.
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

__all__ = ["ENDS_AT_ONCE", "MAX_ROOM_TIMEOUT", "ROOM_CLOSE_GRACE", "STOP_DEADLINE", "RoomService", "http_url"]

log = logging.getLogger(__name__)

ROOM_CLOSE_GRACE = 2.0  # seconds from a session's end to its room's deletion: its last messages reach the clients
MAX_ROOM_TIMEOUT = 2**31 - 1  # seconds: LiveKit keeps a room's empty and departure timeouts in 32 bits
ENDS_AT_ONCE = 32  # RoomService calls for ended sessions' rooms under way at once (last words, deletions)
STOP_DEADLINE = 10.0  # seconds a stop has for the rooms' last words and deletions (within the server's stop bound)
NAMES_A_LIST = 1000  # rooms one ListRooms names, at most (a stop lists the rooms it still has words for)
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
        self._unsaid: dict[str, bytes] = {}  # rooms of ended sessions whose last words were not sent yet
        self._ends = trio.CapacityLimiter(ENDS_AT_ONCE)
        self._client: _Client | None = None  # the client calls share (asyncio side), made on the first
        self._clients: set[_Client] = set()  # every client not closed yet (a replaced one, until its calls end)
        #: clients made so far (one for the transport's life unless one broke)
        self.clients_made = 0

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

    async def remove(self, loop: Any, room: str, identity: str) -> None:
        """Send ``identity`` out of ``room`` (RemoveParticipant: a viewer over its session's seats, which LiveKit's door
        let in); one not there (gone already, or the room) is no failure. Raises :class:`TransportError` naming the
        cause when LiveKit refuses otherwise or does not answer within ``timeout``."""
        prefix = f"could not remove {identity!r} from the LiveKit room {room!r} at {self.url}"
        if not (self._api_key and self._api_secret):
            raise TransportError(f"{prefix}: that needs the API key and secret (--livekit-api-key/-secret)")
        try:
            await self._answer(loop, prefix, lambda rooms: rooms.remove_participant(
                api.RoomParticipantIdentity(room=room, identity=identity)))
        except api.TwirpError as exc:
            if exc.code != api.TwirpErrorCode.NOT_FOUND:
                raise TransportError(f"{prefix}: LiveKit refused (HTTP {exc.status}): {exc.message}") from None

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
        room is deleted (:data:`ENDS_AT_ONCE` such calls at a time). A room this server did not make (a session
        refused as it was asked for) is left alone."""
        if room not in self._opened:
            return
        self._opened.discard(room)
        self.to_delete.add(room)
        if last_word is not None:
            self._unsaid[room] = last_word
        sends.start_soon(self._close, loop, room)

    async def _close(self, loop: Any, room: str) -> None:
        if room in self._unsaid:
            async with self._ends:
                await self._say(loop, room)
        await trio.sleep(ROOM_CLOSE_GRACE)  # the last messages reach the clients before the room goes
        async with self._ends:
            await self.delete(loop, room)

    async def _say(self, loop: Any, room: str) -> None:
        """The room's last word, unless it was said already (once: a stop may take over a close under way). A call
        the stop cuts leaves the word unsaid, for :meth:`finish` to say: taken out as its call began, it was lost
        (32 calls under way at a stop, most of them not sent yet) and those rooms' clients never heard why."""
        last_word = self._unsaid.pop(room, None)
        if last_word is None:
            return
        try:
            await self._bounded(loop, room, "sending the session's last status", lambda rooms: rooms.send_data(
                api.SendDataRequest(room=room, data=last_word, kind=api.DataPacket.Kind.RELIABLE, topic=STATUS_TOPIC)))
        except trio.Cancelled:
            self._unsaid.setdefault(room, last_word)  # LiveKit may have it already: twice beats never
            raise

    async def delete(self, loop: Any, room: str) -> None:
        """Delete ``room`` now (its clients are sent away)."""
        self.to_delete.discard(room)
        await self._bounded(loop, room, "deleting the room", lambda rooms: rooms.delete_room(api.DeleteRoomRequest(room=room)))

    async def finish(self, loop: Any) -> None:
        """The transport stops (its closes were cancelled): within :data:`STOP_DEADLINE`, the last words not said
        yet go to the rooms somebody is in now (a room nobody is in has nobody to tell), then, a grace later, every
        room of an ended session is deleted, :data:`ENDS_AT_ONCE` calls at a time. What the deadline leaves is
        logged (LiveKit ends those rooms when their empty timeout runs out)."""
        with trio.move_on_after(STOP_DEADLINE):
            occupied = await self._occupied(loop, sorted(self._unsaid))
            for room in set(self._unsaid) - occupied:
                del self._unsaid[room]
            await self._each(loop, sorted(occupied), self._say)
            if occupied:
                await trio.sleep(min(ROOM_CLOSE_GRACE, 1.0))
            await self._each(loop, sorted(self.to_delete), self.delete)
        if self._unsaid or self.to_delete:
            log.warning("the transport stopped with %d last word(s) unsaid and %d room(s) not deleted after %g s",
                        len(self._unsaid), len(self.to_delete), STOP_DEADLINE)

    async def _each(self, loop: Any, rooms: list[str], step: Callable[[Any, str], Awaitable[None]]) -> None:
        async def one(room: str) -> None:
            async with self._ends:
                await step(loop, room)

        async with trio.open_nursery() as nursery:
            for room in rooms:
                nursery.start_soon(one, room)

    async def _occupied(self, loop: Any, rooms: list[str]) -> set[str]:
        """Which of ``rooms`` somebody is in now, one ListRooms for :data:`NAMES_A_LIST` of them (all of them where
        LiveKit cannot say: logged)."""
        occupied: set[str] = set()
        for start in range(0, len(rooms), NAMES_A_LIST):
            names = rooms[start : start + NAMES_A_LIST]
            prefix = f"could not list {len(names)} LiveKit room(s) at {self.url}"
            try:
                listed = await self._answer(loop, prefix, lambda service: service.list_rooms(api.ListRoomsRequest(names=names)))
            except (TransportError, api.TwirpError) as exc:
                log.warning("%s: their last words go to each of them", exc)
                occupied.update(names)
                continue
            occupied.update(room.name for room in listed.rooms if room.num_participants)
        return occupied

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
        """Asyncio side: one call on the shared client; one that fails otherwise than by LiveKit's refusal (the
        server gone, a connection broken) has the client replaced for the calls after it."""
        client = self._client
        if client is None:
            client = self._client = _Client(api.LiveKitAPI(http_url(self.url), self._api_key, self._api_secret))
            self._clients.add(client)
            self.clients_made += 1
        client.calls += 1
        try:
            return await call(client.service.room)
        except api.TwirpError:
            raise
        except Exception:
            if self._client is client:
                self._client = None
            raise
        finally:
            client.calls -= 1
            if self._client is not client and not client.calls:  # replaced, and its last call is over
                await self._close_client(client)

    async def _close_client(self, client: _Client) -> None:
        if client in self._clients:
            self._clients.discard(client)
            await client.service.aclose()

    async def _close_clients(self) -> None:
        self._client = None
        for client in list(self._clients):
            await self._close_client(client)

    async def aclose(self, loop: Any) -> None:
        """Close the clients (the transport stops; a later call makes a new one)."""
        await trio_asyncio.aio_as_trio(self._close_clients, loop=loop)()


class _Client:
    """A RoomService client (an aiohttp session) and the calls under way on it."""

    __slots__ = ("calls", "service")

    def __init__(self, service: Any) -> None:
        self.service = service
        self.calls = 0
