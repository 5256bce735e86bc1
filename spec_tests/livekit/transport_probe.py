"""The worker side (``LiveKitTransport``) against a real LiveKit server, in a process inside the namespace.

``python -m spec_tests.livekit.transport_probe SCENARIO URL KEY SECRET`` prints one JSON object of what
it observed; the tests assert on it. A scenario runs the transport as the stream server does (its own
trio-asyncio loop, a worker token) and looks at the room through the server's RoomService.

- ``ghost``: the first signalling connection is held silent by a local relay, so the connect times out
  while the SDK's next attempt (through the relay, now passing bytes) joins the room later; reports
  whether the worker identity was ever listed, and whether it still is once that join has ended.
- ``publish_refused``: a token that may join but not publish; reports the error of each of two frames.
- ``rooms``: a session's room as the stream server handles it (made, joined, closed): whether a worker token
  joins it before it is made and after it was deleted, and whether a wrong API secret makes a room.
- ``media``: a frame, 2 s of audio, the next frame, then leaving; reports how long each took and
  whether the worker was listed in the room before leaving, and still listed ``LEAVE_SEEN_WITHIN`` seconds
  after it (the server handles a leave on its own schedule: its room service may list a participant that has
  left for a moment, so the room is watched until the worker is gone, up to that bound).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import trio
import trio_asyncio
from livekit import api

from pipelines.contract import Audio
from server.tokens import TokenIssuer
from server.transport import TransportError
from server.transport.livekit import LiveKitTransport

ROOM = "probe-room"
IDENTITY = "chunkline-probe-worker"
#: how long the room service may still list a worker that has left: less than LiveKit's own wait for a
#: participant whose connection went away without a leave (its ICE timeouts, then 5 s more before it closes it:
#: disconnectCleanupDuration in pkg/rtc/participant.go), so a worker that did not leave still shows
LEAVE_SEEN_WITHIN = 3.0


async def participants(loop: Any, url: str, key: str, secret: str, room: str = ROOM) -> list[str]:
    """The room's identities, asked on the transport's own asyncio loop (livekit-api is asyncio code)."""

    async def listed() -> list[str]:
        lkapi = api.LiveKitAPI(url.replace("ws://", "http://"), key, secret)
        try:
            response = await lkapi.room.list_participants(api.ListParticipantsRequest(room=room))
            return sorted(p.identity for p in response.participants)
        finally:
            await lkapi.aclose()

    return await trio_asyncio.aio_as_trio(listed, loop=loop)()


async def create_room(loop: Any, url: str, key: str, secret: str) -> None:
    """Make the room, as the stream server does before any token for it is out (the server runs with
    ``room.auto_create: false``), straight through the RoomService (not through a relay)."""

    async def created() -> None:
        lkapi = api.LiveKitAPI(url.replace("ws://", "http://"), key, secret)
        try:
            await lkapi.room.create_room(api.CreateRoomRequest(name=ROOM, empty_timeout=60, departure_timeout=60))
        finally:
            await lkapi.aclose()

    await trio_asyncio.aio_as_trio(created, loop=loop)()


async def relay(listener: trio.SocketListener, upstream: tuple[str, int], held: list[trio.SocketStream], forwarded: trio.Event) -> None:
    """Forward connections to ``upstream``, except the first, which is accepted and never answered."""
    async with trio.open_nursery() as nursery:
        while True:
            client = await listener.accept()
            if not held:
                held.append(client)
                continue
            forwarded.set()
            nursery.start_soon(pipe_both, client, upstream)


async def pipe_both(client: trio.SocketStream, upstream: tuple[str, int]) -> None:
    server = await trio.open_tcp_stream(*upstream)

    async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            async for data in source:
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await sink.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, client, server)
        nursery.start_soon(pump, server, client)


async def ghost(url: str, key: str, secret: str) -> dict[str, Any]:
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    token = TokenIssuer(key, secret, 600).worker_token(ROOM, IDENTITY)
    held: list[trio.SocketStream] = []
    forwarded = trio.Event()
    seen: list[list[str]] = []
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        relay_port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(relay, listeners[0], (host, int(port)), held, forwarded)
        transport = LiveKitTransport(f"ws://127.0.0.1:{relay_port}", connect_timeout=0.5)
        loop = await nursery.start(transport.run)
        await create_room(loop, url, key, secret)
        started = time.monotonic()
        try:
            await transport.connect(ROOM, IDENTITY, token, timeout=0.5)
            error = None
        except TransportError as exc:
            error = str(exc)
        gave_up_after = time.monotonic() - started
        with trio.move_on_after(15):
            await forwarded.wait()  # the SDK's next attempt, after the caller gave up
        retried = forwarded.is_set()
        # watch the room while the late join completes (the worker must not stay): until it came and went
        with trio.move_on_after(10):
            while True:
                seen.append(await participants(loop, url, key, secret))
                if len(seen) > 1 and IDENTITY in seen[-2] and IDENTITY not in seen[-1]:
                    break
                await trio.sleep(0.2)  # bench-cost: the native join runs on its own schedule
        nursery.cancel_scope.cancel()
    return {
        "error": error,
        "gave_up_after": gave_up_after,
        "relay_held_first_connection": bool(held),
        "sdk_retried_after_timeout": retried,
        "ever_listed": any(IDENTITY in names for names in seen),
        "listed_at_end": bool(seen) and IDENTITY in seen[-1],
    }


async def publish_refused(url: str, key: str, secret: str) -> dict[str, Any]:
    token = (
        api.AccessToken(key, secret)
        .with_identity(IDENTITY)
        .with_grants(api.VideoGrants(room_join=True, room=ROOM, can_publish=False, can_subscribe=False))
        .to_jwt()
    )
    transport = LiveKitTransport(url, publish_timeout=2.0, api_key=key, api_secret=secret)
    errors: list[str | None] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(transport.run)
        await transport.open_room(ROOM, lifetime=60)
        connection = await transport.connect(ROOM, IDENTITY, token, timeout=10)
        frame = np.zeros((48, 64, 3), dtype=np.uint8)
        for _ in range(2):
            try:
                with trio.fail_after(15):
                    await connection.publish_frame(frame, 16.0)
                errors.append(None)
            except TransportError as exc:
                errors.append(str(exc))
        await connection.disconnect()
        nursery.cancel_scope.cancel()
    return {"errors": errors}


async def media(url: str, key: str, secret: str) -> dict[str, Any]:
    """A chunk of 2 s of audio between two chunks of video, then leaving: how long each step took."""
    token = TokenIssuer(key, secret, 600).worker_token(ROOM, IDENTITY)
    transport = LiveKitTransport(url, api_key=key, api_secret=secret)
    frame = np.full((96, 160, 3), 90, dtype=np.uint8)
    audio = Audio(bytes(2 * 48000 * 2), 48000, 1)  # 2 s of PCM16 mono: more than the SDK's default queue
    async with trio.open_nursery() as nursery:
        loop = await nursery.start(transport.run)
        await transport.open_room(ROOM, lifetime=60)
        connection = await transport.connect(ROOM, IDENTITY, token, timeout=10)
        await connection.publish_frame(frame, 16.0)
        started = time.monotonic()
        await connection.publish_audio(audio)
        audio_seconds = time.monotonic() - started
        started = time.monotonic()
        await connection.publish_frame(frame, 16.0)  # the next chunk's first frame
        next_frame_seconds = time.monotonic() - started
        listed_before = await participants(loop, url, key, secret)
        started = time.monotonic()
        await connection.disconnect()
        disconnect_seconds = time.monotonic() - started
        # the server drops the participant once it has handled the leave: watch the room until then, bounded
        listed_after = await participants(loop, url, key, secret)
        with trio.move_on_after(LEAVE_SEEN_WITHIN):
            while IDENTITY in listed_after:
                await trio.sleep(0.1)  # bench-cost: LiveKit's room service updates on the server's own schedule
                listed_after = await participants(loop, url, key, secret)
        gone_after_seconds = time.monotonic() - started
        nursery.cancel_scope.cancel()
    return {
        "audio_seconds": audio_seconds,
        "next_frame_seconds": next_frame_seconds,
        "disconnect_seconds": disconnect_seconds,
        "listed_before": IDENTITY in listed_before,
        "listed_after": IDENTITY in listed_after,
        "gone_after_seconds": gone_after_seconds,
    }


async def rooms(url: str, key: str, secret: str) -> dict[str, Any]:
    """The room of a session: a token joins it once the server made it; once the server closed it (deleted
    after its grace), the same token is refused; a transport with a wrong secret cannot make a room."""
    room = "probe-session-room"
    token = TokenIssuer(key, secret, 600).worker_token(room, IDENTITY)
    transport = LiveKitTransport(url, api_key=key, api_secret=secret)
    impostor = LiveKitTransport(url, api_key=key, api_secret="not-" + secret)
    errors: dict[str, str | None] = {}

    async def attempt(label: str, step: Any) -> None:
        try:
            await step()
            errors[label] = None
        except TransportError as exc:
            errors[label] = str(exc)

    async with trio.open_nursery() as nursery:
        loop = await nursery.start(transport.run)
        await nursery.start(impostor.run)
        await attempt("join_before_open", lambda: transport.connect(room, IDENTITY, token, timeout=10))
        await attempt("open_with_a_wrong_secret", lambda: impostor.open_room("probe-impostor-room", lifetime=60))
        await transport.open_room(room, lifetime=60)
        connection = await transport.connect(room, IDENTITY, token, timeout=10)
        listed_while_open = IDENTITY in await participants(loop, url, key, secret, room)
        await connection.disconnect()
        transport.close_room(room)
        with trio.fail_after(30):
            while await listed_rooms(loop, url, key, secret, room):
                await trio.sleep(0.2)  # bench-cost: the deletion waits out ROOM_CLOSE_GRACE in the background
        await attempt("join_after_close", lambda: transport.connect(room, IDENTITY, token, timeout=10))
        room_made_again = bool(await listed_rooms(loop, url, key, secret, room))
        nursery.cancel_scope.cancel()
    return {**errors, "listed_while_open": listed_while_open, "room_made_again": room_made_again}


async def listed_rooms(loop: Any, url: str, key: str, secret: str, room: str) -> list[str]:
    async def listed() -> list[str]:
        lkapi = api.LiveKitAPI(url.replace("ws://", "http://"), key, secret)
        try:
            return [r.name for r in (await lkapi.room.list_rooms(api.ListRoomsRequest(names=[room]))).rooms]
        finally:
            await lkapi.aclose()

    return await trio_asyncio.aio_as_trio(listed, loop=loop)()


SCENARIOS = {"ghost": ghost, "publish_refused": publish_refused, "media": media, "rooms": rooms}


def main() -> None:
    scenario, url, key, secret = sys.argv[1:5]
    result = trio.run(SCENARIOS[scenario], url, key, secret)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
