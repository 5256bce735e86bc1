"""LiveKit rooms through trio-asyncio: the production implementation of the transport port.

The LiveKit Python SDK (``livekit.rtc``) is asyncio code over a Rust core. The
server is trio, so the transport keeps one trio-asyncio loop open for its whole
life and runs every SDK coroutine on it with ``aio_as_trio(..., loop=loop)``.
The loop is passed explicitly, so ``connect`` and the connection methods work
from any trio task (quart-trio request handlers and room runners are not
children of the task that opened the loop).

Starting it (required; ``connect`` raises :class:`TransportError` otherwise)::

    transport = LiveKitTransport(url)
    await nursery.start(transport.run)   # opens the loop; runs until cancelled

When ``run`` is cancelled it first disconnects the connections still open
(bounded by ``disconnect_timeout``), then closes the loop.

SDK objects that capture an event loop (``rtc.Room``, ``rtc.AudioSource``) are
only ever built inside coroutines running on that loop. Room callbacks
(``data_received``, ``participant_active``, ``participant_disconnected``,
``disconnected``, ``reconnecting``) run as asyncio callbacks of the same loop, i.e. on the trio
thread inside the loop's trio task, so they hand events to the runner with
``send_nowait`` on a trio memory channel.

Media (reference B.11) is :mod:`.livekit_media`: one VP8 video track, one PCM audio track. A track that
cannot be published (refused, or no answer within ``publish_timeout``) makes every later call raise that
error. Data goes through
``local_participant.publish_data(payload, reliable=..., topic=..., destination_identities=...)``: to the whole
room, or to one participant alone (an answer to its own message; LiveKit then forwards it to nobody else).

Events: a participant counts as joined when it is *active* (it can receive data then, so the first status messages
reach it). Data from a sender the room has not heard of yet waits for it (:mod:`.livekit_sender`). Each participant's
data is taken at the local rooms' pace (:mod:`.data_pace`; nothing pushes back on a LiveKit sender, so over the pace,
or while ``EVENT_BACKLOG`` data events are unread, its newest message waits in one slot and an older waiting one is
dropped, the newest saying how many it replaced: ``DataReceived.replaced``, which the runner tells the sender);
participant events are never held or dropped. When
the room is lost (worker removed, or the SDK still reconnecting after
``reconnect_timeout``, as when the server died), ``events()`` raises
:class:`TransportError` with the reason instead of ending.

Timeouts: ``connect`` is bounded by its ``timeout`` with ``trio.fail_after`` (an unreachable port fails in about 0.1
s, but a server that accepts and never answers would otherwise take 4 x (attempt timeout + about 3 s) inside the
SDK). ``connect_timeout`` is the SDK's per-attempt signal timeout (``RoomOptions.connect_timeout``, capped at the
overall ``timeout``). Giving up does not stop the SDK's native join, so the join runs on in its own asyncio task
and, should it succeed after all, the worker leaves the room at once (``abandoned_joins`` counts those still
running). ``disconnect`` leaves the room first (the server drops the tracks with the participant) and closes the
sources afterwards, all within ``disconnect_timeout``, and no sooner than ``DATA_FLUSH_GRACE`` after the last data
message it sent (leaving closes the data channel the message may still wait in).

Logging: livekit logs each connection retry at WARNING (the final failure at ERROR) on the ``livekit`` logger; this
module leaves logging alone (``logging.getLogger("livekit").setLevel(logging.ERROR)`` quiets it).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import trio
import trio_asyncio
from livekit import rtc

from pipelines.contract import Audio

from .base import DataReceived, ParticipantJoined, ParticipantLeft, RoomEvent, TransportError
from .data_pace import LatestWins
from .livekit_media import AUDIO_TRACK_NAME, MAX_VIDEO_BITRATE, VIDEO_TRACK_NAME, MediaPublisher, check_frame
from .livekit_rooms import RoomService
from .livekit_sender import SendersToCome

__all__ = ["AUDIO_TRACK_NAME", "MAX_VIDEO_BITRATE", "VIDEO_TRACK_NAME", "LiveKitTransport"]

log = logging.getLogger(__name__)

DATA_FLUSH_GRACE = 0.5  # seconds the worker stays after its last data message before it leaves
ACTIVE = rtc.ParticipantState.PARTICIPANT_STATE_ACTIVE  # a participant that may receive data (the first statuses)
EVENT_BACKLOG = 256  # data events kept for the runner (data beyond it is dropped; participant events never)


async def _wait_for(task: asyncio.Task[None]) -> None:
    """Asyncio side: wait for ``task`` without cancelling it when the wait is given up."""
    await asyncio.shield(task)


class _LiveKitConnection:
    """The worker's presence in one LiveKit room (implements the RoomConnection port)."""

    def __init__(self, transport: LiveKitTransport, loop: Any, room_name: str, identity: str) -> None:
        self._transport = transport
        self._loop = loop
        self.room_name = room_name
        self._identity = identity
        # unbounded, but data is counted: at most EVENT_BACKLOG data events wait here (more wait paced, one per
        # sender, newest wins), while participant events (one per join or leave, bounded by the room) always go in
        self._send, self._receive = trio.open_memory_channel[RoomEvent](math.inf)
        self._pending_data = 0
        self._paced = LatestWins(self._accept_data, loop.time, loop.call_later)
        self._unheard = SendersToCome(self._paced.offer, loop.call_later)  # from senders the room waits to hear of
        self.room: rtc.Room | None = None
        self.media: MediaPublisher | None = None
        self._closed = False  # disconnect() was called
        self._lost: str | None = None  # why the room went away on its own
        self._joining: asyncio.Task[None] | None = None
        self._reconnect_deadline: asyncio.TimerHandle | None = None
        self._broken: str | None = None  # a track could not be published: the connection is unusable
        self._data_sent_at: float | None = None  # trio time of the last data message sent

    @property
    def dropped_events(self) -> int:
        """Data messages a newer one from the same sender replaced while they waited their turn."""
        return self._paced.dropped

    @property
    def identity(self) -> str:
        return self._identity

    # -- asyncio side ----------------------------------------------------------------

    def _attach(self, room: rtc.Room) -> None:
        """Register the room callbacks (asyncio side, before connecting so nothing is missed)."""
        self.room = room
        room.on("data_received", self._on_data)
        # active, not connected: only then can the participant receive data (the first status messages)
        room.on("participant_active", self._on_joined)
        room.on("participant_connected", self._on_connected)
        room.on("participant_disconnected", self._on_left)
        room.on("disconnected", self._on_disconnected)
        room.on("reconnecting", self._on_reconnecting)
        room.on("reconnected", self._on_reconnected)

    def _deliver(self, event: RoomEvent) -> None:
        if self._closed or self._lost is not None:
            return
        try:
            self._send.send_nowait(event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def _stop_events(self) -> None:
        """The worker leaves (or gave up joining): no event reaches the runner any more."""
        self._closed = True
        self._unheard.close()
        self._paced.close()
        self._send.close()

    def _accept_data(self, event: DataReceived) -> bool:
        """Hand a paced data message to the runner; False (it waits) while EVENT_BACKLOG of them are unread."""
        if self._pending_data >= EVENT_BACKLOG and not (self._closed or self._lost is not None):
            return False
        self._pending_data += 1
        self._deliver(event)
        return True

    def _on_data(self, packet: rtc.DataPacket) -> None:
        if packet.participant is None:
            self._unheard.hold(packet.topic or "", bytes(packet.data))
        else:
            self._paced.offer(DataReceived(packet.topic or "", bytes(packet.data), packet.participant.identity))

    def _on_joined(self, participant: rtc.RemoteParticipant) -> None:
        self._deliver(ParticipantJoined(participant.identity))

    def _on_connected(self, participant: rtc.RemoteParticipant) -> None:
        """A participant the worker first hears of already active may get no ``participant_active`` of its own (the
        SDK reports a change of state it sees): it has joined now; a join counted twice is one join."""
        self._unheard.heard_of(participant.identity, participant.permissions.can_publish_data)
        if participant.state == ACTIVE:
            self._deliver(ParticipantJoined(participant.identity))

    def _on_left(self, participant: rtc.RemoteParticipant) -> None:
        last_word = self._paced.forget(participant.identity)
        if last_word is not None:  # its newest message waited its turn: it goes before the leaving, whatever waits
            self._pending_data += 1
            self._deliver(last_word)
        self._deliver(ParticipantLeft(participant.identity))

    def _on_disconnected(self, reason: Any = None) -> None:
        try:
            label = rtc.DisconnectReason.Name(reason) if isinstance(reason, int) else str(reason)
        except ValueError:
            label = str(reason)
        self._lose(f"LiveKit room {self.room_name!r} disconnected ({label})")

    def _on_reconnecting(self) -> None:
        """The signalling connection broke: the SDK retries for many seconds; give it ``reconnect_timeout``."""
        if self._reconnect_deadline is None:
            self._reconnect_deadline = self._loop.call_later(
                self._transport.reconnect_timeout,
                self._lose,
                f"LiveKit room {self.room_name!r} lost: no reconnection within {self._transport.reconnect_timeout:g} s",
            )

    def _on_reconnected(self) -> None:
        if self._reconnect_deadline is not None:
            self._reconnect_deadline.cancel()
            self._reconnect_deadline = None

    def _lose(self, why: str) -> None:
        """The room went away on its own: ``events()`` raises ``why``, and so does every later call."""
        if self._closed or self._lost is not None:
            return
        self._on_reconnected()
        self._lost = why
        self._unheard.close()
        self._paced.close()
        self._send.close()

    async def _aio_connect(self, url: str, token: str, attempt_timeout: float) -> None:
        """Join, in a task of its own that the caller's cancellation does not reach.

        Cancelling ``Room.connect`` only stops the Python side waiting: the native core may still join,
        leaving a worker in the room that nobody owns. So the join always runs to its end (bounded by the
        SDK's attempts), and :meth:`_leave_when_joined` takes the room back if the caller gave up.
        """
        room = rtc.Room(loop=self._loop)
        self._attach(room)
        # the worker's grant forbids subscribing, so it asks for nothing
        options = rtc.RoomOptions(auto_subscribe=False, connect_timeout=attempt_timeout)
        self._joining = self._loop.create_task(room.connect(url, token, options))
        await asyncio.shield(self._joining)
        self.media = MediaPublisher(room.local_participant, self._loop)

    def _leave_when_joined(self) -> asyncio.Task[None] | None:
        """Asyncio side, after the caller gave up: once the join ends, leave if it succeeded."""
        joining = self._joining
        if joining is None:
            return None

        async def leave() -> None:
            try:
                await joining
            except BaseException:  # noqa: BLE001 - the join failed: nobody is in the room
                return
            await self._aio_close()

        return self._loop.create_task(leave())

    async def _aio_close(self) -> None:
        """Leave first (the server unpublishes the tracks with the participant), then close the sources."""
        try:
            if self.room is not None:
                await self.room.disconnect()
        finally:
            if self.media is not None:
                await self.media.aclose()

    # -- trio side (the port) ------------------------------------------------------------

    def _check_usable(self) -> MediaPublisher:
        if self._closed:
            raise TransportError("the worker left the room")
        if self._lost is not None:
            raise TransportError(self._lost)
        if self._broken is not None:
            raise TransportError(self._broken)
        if self.media is None or self._transport._loop is not self._loop:
            raise TransportError("the LiveKit transport is not running")
        return self.media

    async def _on_aio(self, fn: Any, *args: Any) -> Any:
        return await trio_asyncio.aio_as_trio(fn, loop=self._loop)(*args)

    def participants(self) -> frozenset[str]:
        if self.room is None or self._closed:
            return frozenset()
        return frozenset(p.identity for p in self.room.remote_participants.values())

    async def events(self) -> AsyncIterator[RoomEvent]:
        """Room events until the worker leaves; raises TransportError when the room is lost instead."""
        async for event in self._receive:
            if isinstance(event, DataReceived):
                self._pending_data -= 1
            yield event
        if self._lost is not None and not self._closed:
            raise TransportError(self._lost)

    async def publish_frame(self, frame: np.ndarray, fps: float) -> None:
        media = self._check_usable()
        check_frame(frame, fps)
        if not media.video_ready:
            await self._publishing("publishing the video track", media.start_video, frame.shape[1], frame.shape[0], fps)
        media.capture_video(frame)  # a synchronous FFI call: no need to hop to asyncio

    async def publish_audio(self, audio: Audio) -> None:
        media = self._check_usable()
        if media.audio_source is None:
            await self._publishing("publishing audio", media.publish_audio, audio)
        else:
            await self._wrap("publishing audio", media.publish_audio, audio)

    async def _publishing(self, what: str, fn: Any, *args: Any) -> None:
        """Publish a track, bounded by ``publish_timeout``; a failure breaks the connection for good, so
        every later frame raises it again instead of going to a source nobody receives."""
        try:
            with trio.fail_after(self._transport.publish_timeout):
                await self._wrap(what, fn, *args)
        except trio.TooSlowError:
            self._broken = f"LiveKit: {what} got no answer within {self._transport.publish_timeout:g} s"
            raise TransportError(self._broken) from None
        except TransportError as exc:
            self._broken = str(exc)
            raise

    async def send_data(self, topic: str, payload: bytes, *, reliable: bool = True, to: str | None = None) -> None:
        self._check_usable()
        participant = self.room.local_participant  # type: ignore[union-attr]
        destination = [] if to is None else [to]  # empty: the whole room

        async def publish() -> None:
            await participant.publish_data(bytes(payload), reliable=reliable, topic=topic, destination_identities=destination)

        await self._wrap(f"sending data on {topic!r}", publish)
        self._data_sent_at = trio.current_time()

    async def send_away(self, identity: str, reason: str, detail: str) -> None:
        """Remove ``identity`` through the RoomService, within ``disconnect_timeout`` (LiveKit tells it no ``reason``)."""
        await self._transport.remove_participant(self.room_name, identity)

    async def _wrap(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return await self._on_aio(fn, *args)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"LiveKit: {what} failed: {exc}") from exc

    async def disconnect(self) -> None:
        """Unpublish, close the sources and leave the room; shielded and bounded by ``disconnect_timeout``."""
        if self._closed:
            return
        self._stop_events()
        self._transport._connections.discard(self)
        if self._transport._loop is not self._loop:
            return  # the loop is gone, and the room with it
        with trio.CancelScope(shield=True), trio.move_on_after(self._transport.disconnect_timeout) as scope:
            # the SDK's send returns once the message is handed to the data channel, which leaving closes: the last
            # word (a session's done) was lost under load, its room deleted before the clients heard it
            if self._data_sent_at is not None:
                await trio.sleep_until(self._data_sent_at + DATA_FLUSH_GRACE)
            try:
                await self._on_aio(self._aio_close)
            except Exception as exc:  # noqa: BLE001 - leaving is best effort
                log.warning("leaving LiveKit room %r: %s", self.room_name, exc)
        if scope.cancelled_caught:
            log.warning(
                "leaving LiveKit room %r took longer than %g s; gave up waiting",
                self.room_name,
                self._transport.disconnect_timeout,
            )


class LiveKitTransport:
    """Joins LiveKit rooms as the worker participant. Start :meth:`run` in a nursery first."""

    name = "livekit"

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 10.0,
        disconnect_timeout: float = 5.0,
        publish_timeout: float = 10.0,
        reconnect_timeout: float = 5.0,
        api_key: str | None = None,
        api_secret: str | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError("the LiveKit url must be a non-empty string (ws://, wss://, http:// or https://)")
        timeouts = (("connect_timeout", connect_timeout), ("disconnect_timeout", disconnect_timeout),
                    ("publish_timeout", publish_timeout), ("reconnect_timeout", reconnect_timeout))
        for label, value in timeouts:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{label} must be a finite number > 0, got {value!r}")
        self.url = url
        self.connect_timeout = float(connect_timeout)
        self.disconnect_timeout = float(disconnect_timeout)
        self.publish_timeout = float(publish_timeout)
        self.reconnect_timeout = float(reconnect_timeout)
        # the server's own side of its rooms (the RoomService: the API key and secret)
        self._rooms = RoomService(url, api_key, api_secret, self.disconnect_timeout)
        self._loop: Any = None
        self._sends: trio.Nursery | None = None  # the server's sends to rooms, while running
        self._connections: set[_LiveKitConnection] = set()
        self._leaving: set[asyncio.Task[None]] = set()  # abandoned joins, leaving once they end

    @property
    def running(self) -> bool:
        return self._loop is not None

    @property
    def abandoned_joins(self) -> int:
        """Connects given up on (timed out, cancelled) whose native join is still running; each leaves
        the room as soon as it ends, so no worker stays behind."""
        return len(self._leaving)

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the trio-asyncio loop until cancelled: ``await nursery.start(transport.run)``."""
        if self._loop is not None:
            raise RuntimeError("LiveKitTransport.run is already running")
        async with trio_asyncio.open_loop() as loop:
            self._loop = loop
            try:
                async with trio.open_nursery() as sends:
                    self._sends = sends
                    task_status.started(loop)
                    await trio.sleep_forever()
            finally:
                self._sends = None
                with trio.CancelScope(shield=True):
                    for connection in list(self._connections):
                        await connection.disconnect()
                    # a shutdown cancels the rooms' graces: their last words go, each is deleted now, its clients
                    # sent away (they stayed in rooms of ended sessions, which LiveKit keeps while anyone is in them)
                    await self._rooms.finish(loop)
                    with trio.move_on_after(self.disconnect_timeout):
                        for leaving in list(self._leaving):  # abandoned joins: wait for them to leave
                            await trio_asyncio.aio_as_trio(_wait_for, loop=loop)(leaving)
                    await self._rooms.aclose(loop)
                self._loop = None

    async def open_room(self, room: str, *, lifetime: float) -> None:
        """Create the session's room through the RoomService before its first token is handed out, so that a
        LiveKit server run with ``room.auto_create: false`` (as ``chunkline`` runs its own) refuses the tokens of
        an ended session once its room is deleted: with rooms made on join, any such token made the room again,
        empty, for as long as its holder liked. The room stays while empty for ``lifetime`` seconds; the server
        deletes it when the session ends. Raises :class:`TransportError`, naming the cause, when LiveKit refuses
        or does not answer within ``disconnect_timeout``."""
        await self._rooms.open(self._running_loop(), room, lifetime)

    async def list_participants(self, room: str) -> frozenset[str]:
        """Who is in ``room`` now, through the RoomService: how the server sees a room none of its workers is in (a
        queued session's). Raises :class:`TransportError`, naming the cause, when LiveKit refuses or does not answer
        within ``disconnect_timeout``."""
        return await self._rooms.participants(self._running_loop(), room)

    async def remove_participant(self, room: str, identity: str) -> None:
        """Send ``identity`` out of ``room`` through the RoomService (a viewer over its session's seats, which
        LiveKit's door let in); one not there is no failure. Raises :class:`TransportError`, naming the cause, when
        this transport holds no API key, or LiveKit refuses or does not answer within ``disconnect_timeout``."""
        await self._rooms.remove(self._running_loop(), room, identity)

    def close_room(self, room: str, last_word: bytes | None = None, *, worker_told: bool = False) -> None:
        """The room's session ended. In the background, each step within ``disconnect_timeout``: ``last_word``,
        its last ``tf.status`` message when no worker was there to send it (a session that ended queued), goes
        through the RoomService, which names no participant (clients take status without one as the server's:
        only a holder of the API secret can send it); ``ROOM_CLOSE_GRACE`` later the room is deleted, which sends
        its clients away, as the local rooms do once the worker's last messages are out."""
        if worker_told:  # the server reads no LiveKit room's data: the worker's word is taken
            last_word = None
        if self._sends is not None:
            self._rooms.close(self._loop, self._sends, room, last_word)

    async def connect(self, room: str, identity: str, token: str, *, timeout: float) -> _LiveKitConnection:
        """Join ``room`` as ``identity`` with a worker token, or raise TransportError within ``timeout``."""
        loop = self._running_loop()
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
            raise TransportError(f"connect timeout must be a finite number > 0, got {timeout!r}")
        connection = _LiveKitConnection(self, loop, room, identity)
        prefix = f"could not connect to LiveKit at {self.url} within {timeout:g} s"
        try:
            with trio.fail_after(timeout):
                await trio_asyncio.aio_as_trio(connection._aio_connect, loop=loop)(
                    self.url, token, min(self.connect_timeout, float(timeout))
                )
        except trio.TooSlowError:
            await self._abandon(connection)
            raise TransportError(f"{prefix}: no answer (timed out)") from None
        except rtc.ConnectError as exc:
            raise TransportError(f"{prefix}: {exc.message}") from exc
        except Exception as exc:  # a malformed url or token, or the SDK failing otherwise
            await self._abandon(connection)
            raise TransportError(f"{prefix}: {type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled by the caller
            await self._abandon(connection)
            raise
        self._connections.add(connection)
        return connection

    def _running_loop(self) -> Any:
        """The loop the RoomService calls and the joins run on (TransportError while the transport is not running)."""
        if self._loop is None:
            raise TransportError("the LiveKit transport is not running: start it first with `await nursery.start(transport.run)`")
        return self._loop

    async def _abandon(self, connection: _LiveKitConnection) -> None:
        """Give up a connect: the worker leaves the room as soon as (and if ever) the native join succeeds."""
        connection._stop_events()
        with trio.CancelScope(shield=True):
            leaving = await trio_asyncio.aio_as_trio(self._start_leaving, loop=self._loop)(connection)
        if leaving is not None:
            self._leaving.add(leaving)
            leaving.add_done_callback(self._leaving.discard)

    async def _start_leaving(self, connection: _LiveKitConnection) -> asyncio.Task[None] | None:
        return connection._leave_when_joined()
